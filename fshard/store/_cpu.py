"""CPUStore: the in-memory Store, same protocol as NVMeStore. Used when offload goes to host RAM only, and as the
reference in tests. Tensors are copied on put (pinned when CUDA is present, so H2D copies can be asynchronous)."""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Optional

import torch

from ._checksum import checksum
from ..errors import MissingKeyError, StoreClosedError, StoreError
from ._handle import EventLog, Handle
from ._pool import BufferPool
from ._protocol import DeferredDeletes, ItemMeta, as_bytes, meta_of


class CPUStore(DeferredDeletes):
    directory = None  # items live in host memory
    def __init__(self, *, pin: Optional[bool] = None, max_buffers: int = 16, max_buffer_bytes: int = 1 << 30,
                 events: Optional[EventLog] = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.pool = BufferPool(max_buffers, max_buffer_bytes)
        self.events = events
        self._items: Dict[Hashable, torch.Tensor] = {}
        self._meta: Dict[Hashable, ItemMeta] = {}
        self._stale: set = set()  # keys updated in place (stream_in_place): their checksum is taken again on meta()
        self._closed = False
        self._init_deferred()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("CPUStore is closed")

    def put(self, key: Hashable, tensor: torch.Tensor) -> Handle:
        self.collect()
        self._check_open()
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
        copy.copy_(tensor.detach())
        self._items[key] = copy
        self._meta[key] = meta_of(copy, checksum(as_bytes(copy)))
        self._stale.discard(key)
        return Handle.completed("write", key, None, self.events)

    def get(self, key: Hashable, out: Optional[torch.Tensor] = None) -> Handle:
        self._check_open()
        src = self._items.get(key)
        if src is None:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
        value = src.clone() if out is None else out.copy_(src)
        return Handle.completed("read", key, value, self.events)

    def delete(self, key: Hashable) -> None:
        self._check_open()
        if self._items.pop(key, None) is None:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
        del self._meta[key]
        self._stale.discard(key)

    def meta(self, key: Hashable) -> ItemMeta:
        if key not in self._meta:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
        if key in self._stale:  # updated in place since its checksum was taken
            self._stale.discard(key)
            self._meta[key] = meta_of(self._items[key], checksum(as_bytes(self._items[key])))
        return self._meta[key]

    def borrow(self, key: Hashable) -> torch.Tensor:
        """The stored tensor itself, to read (not write) while the item lives: a stored parameter's copy straight
        to a GPU from pinned memory (fshard/state/_stored.py, ``StoredParam.upload``)."""
        self._check_open()
        src = self._items.get(key)
        if src is None:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
        return src

    def read_into(self, key: Hashable, out: torch.Tensor) -> None:
        """Copy the item into ``out`` (same number of elements), cast to ``out``'s dtype: one pass, where
        ``get`` and a cast take two (a stored parameter's read for its gather, fshard/state/_stored.py)."""
        self._check_open()
        src = self._items.get(key)
        if src is None:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
        out.copy_(src.view(out.shape))

    def stream_in_place(self, keys: Iterable[Hashable]) -> "InPlaceStream":
        """Like ``stream(keys, writeback=True)``, but each item's tensor is the stored tensor itself, so an update
        writes the item where it lives, with no copy out and back: for a caller that writes every item back under
        its own key (an update with ``donate=True``, whose input may be overwritten). Writing one under another
        key is refused."""
        self.collect()
        self._check_open()
        return InPlaceStream(self, list(keys))

    def keys(self) -> List[Hashable]:
        self.collect()
        return list(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        self.collect()
        return len(self._items)

    @property
    def resident_bytes(self) -> int:
        return sum(m.nbytes for m in self._meta.values()) + self.pool.resident_bytes

    def stream(self, keys: Iterable[Hashable], depth: int = 2, writeback: bool = False,
               max_writes: Optional[int] = None):
        self.collect()
        from ._stream import Stream

        return Stream(self, keys, depth=depth, writeback=writeback, max_writes=max_writes)

    def close(self) -> None:
        self._items.clear()
        self._meta.clear()
        self.pool.clear()
        self._closed = True

    def __enter__(self) -> "CPUStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InPlaceStream:
    """``CPUStore.stream_in_place``: the stream protocol (iterate, ``writeback``, ``release``, ``close``) over the
    stored tensors themselves."""

    def __init__(self, store: CPUStore, keys: List[Hashable]):
        self.store, self._keys, self._next = store, keys, 0

    def __iter__(self) -> "InPlaceStream":
        return self

    def __next__(self):
        from ._stream import StreamItem

        if self._next >= len(self._keys):
            raise StopIteration
        key = self._keys[self._next]
        self._next += 1
        self.store._check_open()
        t = self.store._items.get(key)
        if t is None:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
        return StreamItem(key, self._next - 1, t, None)

    def writeback(self, item, tensor: Optional[torch.Tensor] = None, key: Optional[Hashable] = None) -> Handle:
        if key is not None and key != item.key:
            raise StoreError(f"an in-place stream writes items under their own keys; {item.key!r} was to go "
                             f"under {key!r}: use CPUStore.stream for a new version")
        if tensor is not None and tensor is not item.tensor:
            item.tensor.copy_(tensor)
        self.store._stale.add(item.key)
        item._open = False
        return Handle.completed("write", item.key, None, self.store.events)

    def release(self, item) -> None:
        item._open = False

    def close(self) -> None:
        pass
