"""The optimizer (``fs.adamw`` on flat shards) and the learning-rate schedules (``fs.schedules``).

Its public names, listed in ``__all__``; the modules behind them are private."""
from . import schedules
from ._adamw import AdamW, AdamWState, adamw

__all__ = ["adamw", "AdamW", "AdamWState", "schedules"]
