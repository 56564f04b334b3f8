"""The optimizer protocol (``Optimizer``, ``Row``, ``UnitOptState``, ``OptState``), the optimizers that implement it
on flat shards, and the learning-rate schedules (``fs.schedules``).

The optimizers, each equal to its torch twin (README, "Optimizers"): ``adamw`` (also ``fs.adamw``), ``adam``,
``sgd``, ``adagrad``, ``rmsprop``, ``lion`` (the Lion paper's, as optax.lion), and ``from_torch`` (any elementwise
torch optimizer, run by torch's own implementation), elementwise; ``muon`` and ``adafactor`` (also ``fs.muon``,
``fs.adafactor``), whose updates are collective; ``partition`` (also ``fs.partition``), several optimizers over
parameter groups (design/OPTIM_GROUPS.md). ``Elementwise`` is the elementwise ones' shared base: an optimizer of your
own declares its ``rows`` and writes ``update_run`` (examples/custom_optimizer.py).

Its public names, listed in ``__all__``; the modules behind them are private."""
from . import schedules
from ._adam import Adam, Lion, adam, lion
from ._adamw import AdamW, AdamWState, adamw
from ._adafactor import Adafactor, AdafactorState, adafactor
from ._classic import SGD, Adagrad, RMSprop, adagrad, rmsprop, sgd
from ._elementwise import Elementwise
from ._from_torch import FromTorch, from_torch
from ._muon import Muon, muon
from ._partition import Partition, PartitionState, partition
from ._protocol import OptState, Optimizer, Row, UnitOptState

__all__ = ["adamw", "adam", "sgd", "adagrad", "rmsprop", "lion", "from_torch", "muon", "adafactor", "partition",
           "AdamW", "AdamWState", "Adam", "SGD", "Adagrad", "RMSprop", "Lion", "FromTorch", "Muon", "Adafactor",
           "AdafactorState", "Partition", "PartitionState", "Elementwise", "Optimizer", "Row", "UnitOptState",
           "OptState", "schedules"]
