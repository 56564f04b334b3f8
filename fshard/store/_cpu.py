"""CPUStore: the in-memory Store, same protocol as NVMeStore. Used when offload goes to host RAM only, and as the
reference in tests. Tensors are copied on put (pinned when CUDA is present, so H2D copies can be asynchronous)."""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Optional

import torch

from ._checksum import checksum
from ..errors import MissingKeyError, StoreClosedError
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

    def meta(self, key: Hashable) -> ItemMeta:
        if key not in self._meta:
            raise MissingKeyError(f"key {key!r} is not in the CPUStore (never put, or deleted)")
        return self._meta[key]

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
