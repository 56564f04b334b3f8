"""CPUStore: the in-memory Store, same protocol as NVMeStore. Used when offload goes to host RAM only, and as the
reference in tests. Tensors are copied on put (pinned when CUDA is present, so H2D copies can be asynchronous).
An item's checksum is taken when ``meta`` first asks for it, not on put: nothing reads a CPUStore's items back
through a checksum check (an NVMeStore verifies its files), and a put-time pass over every byte cost fs.init of a
6.3B GPT one single-threaded sweep of its 75 GB of moments and parameters. A stream reads items by ``layout``
(dtype, shape and size only), so a step takes no checksum either."""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Optional, Sequence

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
        self._stale: set = set()  # keys put or updated in place since meta() last took their checksum
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
        return self._commit(key, copy)

    def put_stacked(self, key: Hashable, rows: Sequence[torch.Tensor], width: int) -> Handle:
        """``put(key, item)`` of the ``(len(rows), width)`` item whose row j is ``rows[j]`` (1-D, any device, at
        most ``width`` elements) zero padded at its end, without making that item first: each row is copied
        straight into the store's memory. A stack then a put writes the bytes twice, through a temporary of the
        item's size (optimizer rows in chunk items, fshard/state/_stored.py's ``write_rows``)."""
        self.collect()
        self._check_open()
        item = torch.empty((len(rows), width), dtype=rows[0].dtype, pin_memory=self.pin)
        for j, r in enumerate(rows):
            n = r.numel()
            item[j, :n].copy_(r.detach().reshape(-1))
            if n < width:
                item[j, n:].zero_()
        return self._commit(key, item)

    def _commit(self, key: Hashable, item: torch.Tensor) -> Handle:
        self._items[key] = item
        self._meta[key] = meta_of(item, 0)  # (its checksum taken when meta() first asks: _stale)
        self._stale.add(key)
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
        if key in self._stale:  # put, or updated in place, since its checksum was taken
            self._meta[key] = meta_of(self._items[key], checksum(as_bytes(self._items[key])))
            self._stale.discard(key)  # (after: a failed checksum leaves the key stale, never a placeholder)
        return self._meta[key]

    def layout(self, key: Hashable) -> ItemMeta:
        """``meta(key)`` without its checksum (the field may be stale): the dtype, shape and size a stream reads an
        item by, without a pass over its bytes (the stream asks for every item it reads)."""
        if key not in self._meta:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
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
