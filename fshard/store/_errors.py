"""Error classes of the store. Every message names the key and, for disk errors, the file or directory."""
from __future__ import annotations

from ..errors import FshardError


class StoreError(FshardError, RuntimeError):
    """Base class of every error the store raises on purpose (an ``fs.FshardError``)."""


class StoreDirectoryError(StoreError):
    """The store directory is missing, cannot be created, or is not writable."""


class MissingKeyError(StoreError, KeyError):
    """The key was never put, or was deleted. Also a KeyError, so `except KeyError` works."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "missing key"


class CorruptedItemError(StoreError):
    """What was read back is not what was put: checksum mismatch, truncated or deleted file."""


class StoreWriteError(StoreError):
    """A write did not reach the file in full (disk full, I/O error). The previous version is kept."""


class StoreClosedError(StoreError):
    """The store was used after close()."""


class PoolExhaustedError(StoreError):
    """The buffer pool is at its count or byte bound and nothing can be given back."""
