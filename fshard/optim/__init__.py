"""The optimizer protocol (``Optimizer``, ``Row``, ``UnitOptState``, ``OptState``), the optimizers that implement it
on flat shards, and the learning-rate schedules (``fs.schedules``).

The optimizers, each equal to its torch twin (README, "Optimizers"): ``adamw`` (also ``fs.adamw``), ``adam``,
``sgd``, ``adagrad``, ``rmsprop``, ``lion`` (the Lion paper's, as optax.lion), and ``from_torch`` (any elementwise
torch optimizer, run by torch's own implementation). ``Elementwise`` is their shared base: an optimizer of your own
declares its ``rows`` and writes ``update_run`` (examples/custom_optimizer.py).

Its public names, listed in ``__all__``; the modules behind them are private."""
from . import schedules
from ._adam import Adam, Lion, adam, lion
from ._adamw import AdamW, AdamWState, adamw
from ._classic import SGD, Adagrad, RMSprop, adagrad, rmsprop, sgd
from ._elementwise import Elementwise
from ._from_torch import FromTorch, from_torch
from ._protocol import OptState, Optimizer, Row, UnitOptState

__all__ = ["adamw", "adam", "sgd", "adagrad", "rmsprop", "lion", "from_torch", "AdamW", "AdamWState", "Adam", "SGD",
           "Adagrad", "RMSprop", "Lion", "FromTorch", "Elementwise", "Optimizer", "Row", "UnitOptState", "OptState",
           "schedules"]
