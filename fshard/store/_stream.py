"""Pipelined streaming over stored items: read(i+1..i+depth) || caller's compute on i || write-back(i-1).

    with store.stream(keys, depth=2, writeback=True) as s:
        for item in s:
            adamw_update(item.tensor)      # the next reads are in flight meanwhile
            s.writeback(item)              # async; the buffer returns to the pool when the write is reaped

Items live in pool buffers, so memory is bounded by (depth + 1 + max_writes) buffers whatever the number of keys.
Write-backs are reaped lazily (when more than `max_writes` are outstanding, when the pool needs a buffer, or at
close), so write(i-1) stays in flight while the caller works on i. Without writeback, an item's tensor is valid
until the next item is requested: clone it to keep it. With writeback, every item must be written back or
released before advancing, so an update is never silently dropped.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, Hashable, Iterable, List, Optional, Tuple

import torch

from ._handle import Handle
from ._pool import AlignedBuffer
from ..errors import ArgumentError, StoreError


def check_depth(store: Any, depth: int, who: str) -> None:
    """Refuse, up front, a stream the store's pool cannot hold: `depth` reads, the caller's item and one write."""
    pool = getattr(store, "pool", None)
    if pool is not None and depth + 2 > pool.max_buffers:
        raise ArgumentError(f"{who} needs {depth + 2} pool buffers but the store's pool allows {pool.max_buffers}; "
                            f"lower depth or make the store with max_buffers >= {depth + 2}")


class StreamItem:
    __slots__ = ("key", "index", "tensor", "_buf", "_open")

    def __init__(self, key: Hashable, index: int, tensor: torch.Tensor, buf: AlignedBuffer):
        self.key, self.index, self.tensor, self._buf, self._open = key, index, tensor, buf, True

    def __repr__(self) -> str:
        return f"StreamItem({self.key!r}, {self.index})"


class Stream:
    def __init__(self, store: Any, keys: Iterable[Hashable], depth: int = 2, writeback: bool = False,
                 max_writes: Optional[int] = None):
        if depth < 1:
            raise ArgumentError(f"depth must be >= 1, got {depth}")
        self.store, self.keys, self.depth, self.writeback_mode = store, list(keys), depth, writeback
        self.max_writes = depth if max_writes is None else max_writes
        check_depth(store, depth, f"a stream of depth {depth}")
        self._reads: Deque[Tuple[int, Hashable, AlignedBuffer, Handle]] = deque()
        self._writes: Deque[Tuple[Handle, AlignedBuffer]] = deque()
        self._next_read = 0
        self._current: Optional[StreamItem] = None
        self._closed = False

    # ---- iteration ---------------------------------------------------------------------------------------
    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamItem:
        if self._closed:
            raise StopIteration
        cur = self._current
        if cur is not None and cur._open:
            if self.writeback_mode:
                raise StoreError(f"stream item {cur.key!r} was neither written back nor released before the "
                                 f"next item was requested")
            self.release(cur)
        self._current = None
        self._submit_reads()
        if not self._reads:
            self.close()
            raise StopIteration
        index, key, buf, h = self._reads.popleft()
        try:
            tensor = h.wait()
        except BaseException:
            self.store.pool.release(buf)
            raise
        self._submit_reads()  # reads i+1..i+depth go out before the caller starts on i
        self._current = StreamItem(key, index, tensor, buf)
        if self.store.events is not None:
            self.store.events.record("yield", key)
        return self._current

    def _submit_reads(self) -> None:
        while self._next_read < len(self.keys) and len(self._reads) < self.depth:
            key = self.keys[self._next_read]
            # dtype, shape and size; a store that can give them without its checksum (CPUStore.layout) skips it
            meta = (self.store.layout if hasattr(type(self.store), "layout") else self.store.meta)(key)
            phase = self.store.phase(key) if hasattr(self.store, "phase") else 0  # read in place (NVMeStore)
            buf = self._acquire(phase + meta.nbytes)
            out = buf.bytes(phase + meta.nbytes)[phase:].view(meta.dtype).view(meta.shape)
            try:
                h = self.store.get(key, out=out)
            except BaseException:
                self.store.pool.release(buf)
                raise
            self._reads.append((self._next_read, key, buf, h))
            self._next_read += 1

    def _acquire(self, nbytes: int) -> AlignedBuffer:
        while not self.store.pool.can_acquire(nbytes) and self._writes:
            self._reap_oldest_write()
        return self.store.pool.acquire(nbytes)

    # ---- write-back --------------------------------------------------------------------------------------
    def writeback(self, item: StreamItem, tensor: Optional[torch.Tensor] = None,
                  key: Optional[Hashable] = None) -> Handle:
        """Write the item (or `tensor`, copied into the item's buffer) back under its key (or under `key`, a new
        version that leaves the item's own key as it was), asynchronously."""
        if not item._open:
            raise StoreError(f"stream item {item.key!r} was already written back or released")
        if tensor is not None and tensor is not item.tensor:
            item.tensor.copy_(tensor)
        h = self.store.put(item.key if key is None else key, item.tensor)
        item._open = False
        self._writes.append((h, item._buf))
        while len(self._writes) > self.max_writes:
            self._reap_oldest_write()
        return h

    def release(self, item: StreamItem) -> None:
        """Give the item's buffer back without writing it."""
        if item._open:
            item._open = False
            self.store.pool.release(item._buf)

    def _reap_oldest_write(self) -> None:
        h, buf = self._writes.popleft()
        try:
            h.wait()
        finally:
            self.store.pool.release(buf)

    # ---- state, for overlap tests and monitoring ---------------------------------------------------------
    def inflight_reads(self) -> List[Hashable]:
        return [key for _, key, _, h in self._reads if not h.done()]

    def inflight_writes(self) -> List[Hashable]:
        return [h.key for h, _ in self._writes if not h.done()]

    # ---- close -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish every write-back (raising the first error) and give every buffer back."""
        if self._closed:
            return
        self._closed = True
        error: Optional[BaseException] = None
        if self._current is not None:
            self.release(self._current)
        while self._reads:  # the kernel may still be filling these buffers: reap before giving them back
            _, _, buf, h = self._reads.popleft()
            h.reap()
            self.store.pool.release(buf)
        while self._writes:
            try:
                self._reap_oldest_write()
            except BaseException as e:  # noqa: BLE001 - keep going so every buffer comes back
                error = error or e
        if error is not None:
            raise error

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
