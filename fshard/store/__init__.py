"""Tensor stores for offloaded state: `CPUStore` (host memory) and `NVMeStore` (disk, through tensornvme).

    store = NVMeStore(directory, backend="uring")     # or "aio"
    store.put(key, tensor).wait()                     # async write; `tensor` may be reused after wait()
    t = store.get(key).wait()                         # async read, checksum-verified
    with store.stream(keys, depth=2, writeback=True) as s:
        for item in s:                                # read(i+1) || compute(i) || write(i-1)
            update(item.tensor); s.writeback(item)

Design notes: design/STORE.md.
"""
from ._cpu import CPUStore
from ..errors import (CorruptedItemError, MissingKeyError, PoolExhaustedError, StoreClosedError,
                      StoreDirectoryError, StoreError, StoreWriteError)
from ._handle import DONE, FAILED, IN_FLIGHT, EventLog, Handle
from ._nvme import NVMeStore
from ._pool import AlignedBuffer, BufferPool, aligned_empty_like
from ._protocol import ItemMeta, Store
from ._stream import Stream, StreamItem

__all__ = [
    "Store", "CPUStore", "NVMeStore", "Handle", "EventLog", "ItemMeta", "Stream", "StreamItem", "BufferPool",
    "AlignedBuffer", "aligned_empty_like", "StoreError", "StoreDirectoryError", "MissingKeyError", "CorruptedItemError",
    "StoreWriteError", "StoreClosedError", "PoolExhaustedError", "IN_FLIGHT", "DONE", "FAILED",
]
