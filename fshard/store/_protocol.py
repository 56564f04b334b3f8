"""The Store protocol shared by CPUStore and NVMeStore, and the per-item metadata they keep in memory."""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Optional, Protocol, Tuple, runtime_checkable

import torch

from ..errors import MissingKeyError
from ._handle import Handle


@dataclass(frozen=True)
class ItemMeta:
    """What a get needs to rebuild the tensor and check it. Kept in memory: store files are scratch space."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    nbytes: int
    checksum: int


def meta_of(t: torch.Tensor, checksum: int) -> ItemMeta:
    return ItemMeta(t.dtype, tuple(t.shape), t.numel() * t.element_size(), checksum)


def is_engine_ready(t: torch.Tensor) -> bool:
    """Can tensornvme read/write this tensor in place? It sizes the I/O by the whole storage from data_ptr(), so
    the tensor must be a contiguous CPU tensor covering exactly its storage."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (0-dim and empty included)."""
    return t.reshape(-1).view(torch.uint8)


def from_bytes(u8: torch.Tensor, meta: ItemMeta) -> torch.Tensor:
    return u8.view(meta.dtype).view(meta.shape)


@runtime_checkable
class Store(Protocol):
    """Asynchronous key -> tensor store. `put` and `get` return handles; `wait()` on a put means the caller may
    reuse the tensor, `wait()` on a get returns a tensor equal to what was put (dtype, shape, bytes).

    `directory` is where the items live on disk, or None for a store in memory; `resident_bytes` is the host memory
    the store holds. `delete_later` and `collect` give the store the lifetime of its items (`DeferredDeletes`).
    `session_lock` (optional; CPUStore and NVMeStore have one, from `DeferredDeletes`): an RLock that each thread
    using the store holds around its operations, the step's offload and a background fs.save; moments in a store
    without one cannot be saved with blocking=False."""

    directory: Optional[str]
    resident_bytes: int

    def put(self, key: Hashable, tensor: torch.Tensor) -> Handle: ...  # tensor: on any device (a GPU shard too)

    def get(self, key: Hashable, out: Optional[torch.Tensor] = None) -> Handle: ...

    def delete(self, key: Hashable) -> None: ...

    def meta(self, key: Hashable) -> ItemMeta: ...

    def keys(self) -> Iterable[Hashable]: ...

    def stream(self, keys: Iterable[Hashable], depth: int = 2, writeback: bool = False) -> Any: ...

    def delete_later(self, keys: Iterable[Hashable]) -> None: ...

    def collect(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Store": ...

    def __exit__(self, *exc: Any) -> None: ...


STORE_ATTRS = ("directory", "resident_bytes", "put", "get", "delete", "meta", "keys", "stream", "delete_later",
               "collect", "close", "__enter__", "__exit__")


def is_store(obj: Any) -> bool:
    """Whether ``obj`` has every attribute of ``Store``, by ``hasattr``. ``isinstance(obj, Store)`` looks attributes
    up statically from Python 3.12 on, so it refuses a wrapper that forwards them with ``__getattr__`` (a store with
    fault injection, a proxy); 3.11 accepted it (seen on the GPU machine's Python 3.12)."""
    return all(hasattr(obj, a) for a in STORE_ATTRS)


class DeferredDeletes:
    """``delete_later`` and ``collect`` for a store that is used from one thread: a key whose deletion is asked for
    from anywhere (a finalizer runs in whichever thread drops the last reference, perhaps in the middle of a store
    operation) is deleted by the store's own next ``put``, ``stream``, ``keys()``, ``len()`` or ``collect()``. So
    the store, not whoever wrote an item, owns its lifetime."""

    def _init_deferred(self) -> None:
        self._later: deque = deque()  # append and popleft are atomic: safe from a finalizer in another thread
        # Held around a sequence of operations by each thread that uses the store (the step's offload, a background
        # save reading items), so that two never use it at once; the store's own operations do not take it.
        self.session_lock = threading.RLock()

    def delete_later(self, keys: Iterable[Hashable]) -> None:
        """Delete ``keys`` at the store's next operation (missing keys are ignored); safe from any thread."""
        self._later.extend(keys)

    def collect(self) -> None:
        """Delete now what ``delete_later`` was asked to (from the thread that uses the store)."""
        while self._later:  # (a plain check first: collect() runs at every put, mostly with nothing to do)
            try:
                key = self._later.popleft()
            except IndexError:  # another thread emptied it first
                return
            if self._closed:
                continue
            try:
                self.delete(key)
            except MissingKeyError:
                pass


def locked(store):
    """``store.session_lock`` held (a context manager), or nothing for a store that has no lock."""
    lock = getattr(store, "session_lock", None)
    return lock if lock is not None else contextlib.nullcontext()
