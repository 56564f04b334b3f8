"""``fs.save``, ``fs.load``, ``fs.latest``: DCP checkpoints in FSDP2's layout, the files of a checkpoint
directory, and what a load trusts a checkpoint for.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._load import load
from ._save import SaveHandle, latest, save

__all__ = ["save", "load", "latest", "SaveHandle"]
