"""The optimizer protocol (``Optimizer``, ``Row``, ``UnitOptState``, ``OptState``), its implementations on flat shards
(``fs.adamw``; ``fs.muon`` and ``fs.adafactor``, collective; ``fs.partition``, several optimizers over parameter
groups), and the learning-rate schedules (``fs.schedules``).

Its public names, listed in ``__all__``; the modules behind them are private."""
from . import schedules
from ._adamw import AdamW, AdamWState, adamw
from ._adafactor import Adafactor, AdafactorState, adafactor
from ._muon import Muon, muon
from ._partition import Partition, PartitionState, partition
from ._protocol import OptState, Optimizer, Row, UnitOptState

__all__ = ["adamw", "AdamW", "AdamWState", "Optimizer", "Row", "UnitOptState", "OptState", "schedules",
           "muon", "Muon", "partition", "Partition", "PartitionState", "adafactor", "Adafactor", "AdafactorState"]
