"""The optimizer protocol (``Optimizer``, ``Row``, ``UnitOptState``, ``OptState``), its implementation ``fs.adamw`` on
flat shards, and the learning-rate schedules (``fs.schedules``).

Its public names, listed in ``__all__``; the modules behind them are private."""
from . import schedules
from ._adamw import AdamW, AdamWState, adamw
from ._protocol import OptState, Optimizer, Row, UnitOptState

__all__ = ["adamw", "AdamW", "AdamWState", "Optimizer", "Row", "UnitOptState", "OptState", "schedules"]
