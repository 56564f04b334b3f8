"""NVMeStore: tensors on disk through tensornvme, made safe.

put: items >= direct_min_bytes (1 MiB) are written with O_DIRECT (set on tensornvme's descriptor, see _layout),
others buffered. A page-aligned tensor (or, buffered, any whole contiguous CPU storage) goes to tensornvme as is;
otherwise it is staged through a pool buffer. The new version goes to a free slot with space reserved up front (a
full disk fails there), its checksum is taken while the kernel writes, and on wait() the file must hold the whole
item (tensornvme ignores write results, so a short write shows only in the size). Only then is the key switched
to the new version and the old slot released. At most `max_inflight_writes` puts are outstanding.

get: file presence, identity and size are checked, the bytes are read into an aligned buffer (or `out`), and the
checksum is verified before the tensor is returned. tensornvme can read an entry once (its read frees the entry), so
the first get after a put goes through tensornvme and a repeated get of an unchanged item uses a plain pread on the
same slot file, which no one else writes. The offloaded optimizer reads each item once and writes it back, so its
reads all go through tensornvme.

The store is meant to be used from one thread; its operations are not locked.
"""
from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, Iterable, List, Optional

import torch

from ._checksum import checksum, validate_kind
from ._errors import CorruptedItemError, MissingKeyError, StoreClosedError, StoreError, StoreWriteError
from ._handle import EventLog, Handle
from ._layout import DIO_ALIGN, Slot, SlotSpace, cleanup, open_store_dir
from ._pool import round_up, AlignedBuffer, BufferPool, aligned_empty, aligned_for_direct as _aligned, copy_bytes as _copy
from ._protocol import ItemMeta, as_bytes, from_bytes, is_engine_ready, meta_of


@dataclass
class _Item:
    meta: ItemMeta
    slot: Optional[Slot]  # None for 0-byte items, which never touch the disk
    direct: bool = False  # written with O_DIRECT (the file holds nbytes rounded up to DIO_ALIGN)


class NVMeStore:
    def __init__(self, directory: str, backend: str = "uring", *, create: bool = True, checksum: str = "fast",
                 max_buffers: int = 16, max_buffer_bytes: int = 1 << 30, block: int = 4096,
                 max_free_slots: Optional[int] = None, max_inflight_writes: int = 4,
                 direct: bool = True, direct_min_bytes: int = 1 << 20, events: Optional[EventLog] = None):
        try:
            from tensornvme._C import get_backends
        except ImportError as e:
            raise StoreError("NVMeStore needs tensornvme (pip install tensornvme; see scripts/bootstrap.sh)") from e
        if backend not in get_backends():
            raise ValueError(f"tensornvme backend {backend!r} is not available; built with {sorted(get_backends())}")
        self.backend = backend
        self.checksum_kind = validate_kind(checksum)
        self.directory = open_store_dir(directory, create)
        # Free slots kept for reuse: by default one per live item, since each put of a stream round needs one, and
        # recreating a slot costs a first write into new blocks (10x slower here) and, on aio, a 65 ms engine setup.
        # (The callable must not reference self: the finalizer below holds the SlotSpace strongly.)
        items: Dict[Hashable, _Item] = {}
        keep = (lambda: max(16, len(items))) if max_free_slots is None else (lambda: max_free_slots)
        self._space = SlotSpace(self.directory, backend, keep)
        # Runs on close(), on garbage collection, and at interpreter exit (finalize registers with atexit).
        self._finalizer = weakref.finalize(self, cleanup, self._space, self.directory)
        self.pool = BufferPool(max_buffers, max_buffer_bytes, block)
        self.events = events
        self._items = items
        self._pending: Dict[Hashable, List[Handle]] = {}
        self._writes: Deque[Handle] = deque()  # puts in flight, oldest first
        self._staged: Deque[Handle] = deque()  # operations holding a pool buffer, oldest first
        self.max_inflight_writes = max_inflight_writes
        # Items of at least direct_min_bytes bypass the page cache (O_DIRECT) when the filesystem allows it.
        self.direct_min_bytes = direct_min_bytes if direct else float("inf")
        # Direct items are read direct too. Reading them buffered on uring was tried and measured no faster (run E
        # in benchmarks/RESULTS.md (NVMe store)); it is kept as a switch for experiments.
        self.direct_reads = True
        self._executor: Optional[ThreadPoolExecutor] = None
        self._closed = False

    # ---- put ---------------------------------------------------------------------------------------------
    def put(self, key: Hashable, tensor: torch.Tensor) -> Handle:
        self._check_open()
        self._settle(key)  # earlier operations on this key complete first: puts commit in order
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            u8 = as_bytes(t.contiguous())
            self._commit(key, _Item(meta_of(t, checksum(u8, self.checksum_kind)), None))
            return Handle.completed("write", key, None, self.events)
        staged: Optional[AlignedBuffer] = None
        try:
            slot = self._space.acquire(round_up(nbytes, DIO_ALIGN))
        except StoreWriteError as e:
            raise self._write_failed(key, str(e)) from e
        direct = slot.direct_ok and nbytes >= self.direct_min_bytes
        try:
            if is_engine_ready(t) and (not direct or _aligned(t, nbytes)):
                u8 = as_bytes(t)  # zero copy; the handle keeps `t` alive until the write is reaped
                span = u8
            else:  # staged: an unaligned tensor goes through a pool buffer, padded to whole blocks for O_DIRECT
                n = round_up(nbytes, DIO_ALIGN) if direct else nbytes
                staged = self._acquire_buffer(n)
                span = staged.bytes(n)
                u8 = span[:nbytes]
                _copy(u8.view(t.dtype).view(t.shape), t)
            slot.write(span, direct)
        except BaseException as e:
            self._give_back(staged)
            self._space.discard(slot)
            if isinstance(e, Exception) and not isinstance(e, StoreError):
                raise StoreWriteError(f"tensornvme rejected the write of key {key!r} to {slot.path!r}: {e}") from e
            raise
        # Checksum after submission: io_uring usually hands a buffered write to a kernel worker, so this pass over
        # the same (unchanging) source bytes runs on the other core while the kernel copies them.
        meta = meta_of(t, checksum(u8, self.checksum_kind))

        def finish(_keep_alive: torch.Tensor = span) -> None:  # the kernel reads from span until reaped
            try:
                slot.wait()
            finally:
                self._give_back(staged)
            problem = slot.problem(nbytes)  # a short write into new space shows as a short file
            if problem is not None:
                self._space.discard(slot)
                raise self._write_failed(key, problem)
            self._commit(key, _Item(meta, slot, direct))

        h = self._track(Handle("write", key, finish, self.events))
        self._writes.append(h)
        self._hold(h, staged)
        while self._writes and (self._writes[0].done() or len(self._writes) > self.max_inflight_writes):
            self._writes.popleft().reap()  # bound the kernel's outstanding writes; errors stay in the handle
        return h

    def _write_failed(self, key: Hashable, why: str) -> StoreWriteError:
        kept = "the previous version is kept" if key in self._items else "nothing was stored"
        return StoreWriteError(f"write of key {key!r} failed ({why}); the disk may be full or failing; {kept}")

    def _commit(self, key: Hashable, item: _Item) -> None:
        old = self._items.get(key)
        self._items[key] = item
        if old is not None and old.slot is not None:
            self._space.release(old.slot)

    # ---- get ---------------------------------------------------------------------------------------------
    def get(self, key: Hashable, out: Optional[torch.Tensor] = None) -> Handle:
        """Read `key`. With `out` (same dtype and shape), the bytes land there and `out` is returned."""
        self._check_open()
        self._settle(key, writes_only=True)
        item = self._items.get(key)
        if item is None:
            raise MissingKeyError(f"key {key!r} is not in the NVMeStore at {self.directory!r} "
                                  f"(never put, deleted, or its put failed)")
        meta = item.meta
        if out is not None and (out.dtype != meta.dtype or tuple(out.shape) != meta.shape):
            raise ValueError(f"out has {out.dtype} {tuple(out.shape)}, key {key!r} holds {meta.dtype} {meta.shape}")
        if meta.nbytes == 0:
            value = torch.empty(meta.shape, dtype=meta.dtype) if out is None else out
            return Handle.completed("read", key, value, self.events)
        slot = item.slot
        problem = slot.problem(meta.nbytes)
        if problem is not None:
            return Handle.failed("read", key, CorruptedItemError(f"cannot read key {key!r}: {problem}"), self.events)
        direct = item.direct and slot.armed and self.direct_reads  # the pread fallback (below) stays buffered
        span_n = round_up(meta.nbytes, DIO_ALIGN) if item.direct else meta.nbytes  # = written size
        staged: Optional[AlignedBuffer] = None
        if (out is not None and is_engine_ready(out) and span_n == meta.nbytes
                and (not direct or _aligned(out, meta.nbytes))):
            span = as_bytes(out)  # in place
        elif out is not None:  # unaligned `out`: read into a pool buffer, then one copy
            staged = self._acquire_buffer(span_n)
            span = staged.bytes(span_n)
        else:
            span = aligned_empty(span_n, self.pool.block)
        u8 = span[:meta.nbytes]
        if slot.armed:
            try:
                slot.read(span, direct)
            except BaseException:
                self._give_back(staged)
                raise
            waiter = slot.wait
        else:  # the engine already consumed its entry; the file still holds the item and no one writes it
            waiter = self._pool_executor().submit(slot.pread, u8).result

        def finish() -> torch.Tensor:
            try:
                n = waiter()
                problem = slot.problem(meta.nbytes)
                if problem is None and n is not None and n != meta.nbytes:
                    problem = f"short read of {n} bytes from {slot.path!r}, {meta.nbytes} expected"
                if problem is not None:
                    raise CorruptedItemError(f"cannot read key {key!r}: {problem}")
                if checksum(u8, self.checksum_kind) != meta.checksum:
                    raise CorruptedItemError(f"key {key!r}: checksum mismatch reading {slot.path!r}; the file "
                                             f"was corrupted or modified after the put")
                if out is None:
                    return from_bytes(u8, meta)
                if staged is not None:
                    _copy(out, from_bytes(u8, meta))
                return out
            finally:
                self._give_back(staged)

        return self._hold(self._track(Handle("read", key, finish, self.events)), staged)

    # ---- delete, close, introspection --------------------------------------------------------------------
    def delete(self, key: Hashable) -> None:
        self._check_open()
        self._settle(key)
        item = self._items.pop(key, None)
        if item is None:
            raise MissingKeyError(f"key {key!r} is not in the NVMeStore at {self.directory!r}")
        if item.slot is not None:
            self._space.release(item.slot, trim=True)  # delete gives the disk space back now

    def meta(self, key: Hashable) -> ItemMeta:
        self._settle(key, writes_only=True)
        if key not in self._items:
            raise MissingKeyError(f"key {key!r} is not in the NVMeStore at {self.directory!r}")
        return self._items[key].meta

    def keys(self) -> List[Hashable]:
        self.flush()
        return list(self._items)

    def __contains__(self, key: Hashable) -> bool:
        self._settle(key, writes_only=True)
        return key in self._items

    def __len__(self) -> int:
        self.flush()
        return len(self._items)

    def flush(self) -> None:
        """Reap every operation in flight. Errors stay in their handles."""
        for key in list(self._pending):
            self._settle(key)

    def file_of(self, key: Hashable) -> Optional[str]:
        """The file holding `key` (for tools and fault-injection tests)."""
        item = self._items.get(key)
        return None if item is None or item.slot is None else item.slot.path

    def files(self) -> List[str]:
        return self._space.files()

    def disk_bytes(self) -> int:
        """Disk space the store's files occupy (allocated blocks)."""
        return self._space.disk_bytes()

    @property
    def slots(self) -> int:
        return self._space.slots

    @property
    def resident_bytes(self) -> int:
        """Host memory the store holds: its buffer pool (items themselves live on disk)."""
        return self.pool.resident_bytes

    def stream(self, keys: Iterable[Hashable], depth: int = 2, writeback: bool = False,
               max_writes: Optional[int] = None):
        from ._stream import Stream

        return Stream(self, keys, depth=depth, writeback=writeback, max_writes=max_writes)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._items.clear()
            self.pool.clear()
            self._finalizer()

    def __enter__(self) -> "NVMeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"NVMeStore at {self.directory!r} is closed")

    def _track(self, h: Handle) -> Handle:
        self._pending.setdefault(h.key, []).append(h)
        return h

    def _settle(self, key: Hashable, writes_only: bool = False) -> None:
        handles = self._pending.get(key)
        if not handles:
            return
        for h in handles:
            if not writes_only or h.kind == "write":
                h.reap()
        handles[:] = [h for h in handles if not h.done()]
        if not handles:
            del self._pending[key]

    def _acquire_buffer(self, nbytes: int) -> AlignedBuffer:
        while not self.pool.can_acquire(nbytes) and self._staged:
            self._staged.popleft().reap()  # oldest first: the rest stay in flight (no pipeline drain)
        if not self.pool.can_acquire(nbytes):
            self.flush()  # staged operations in flight hold buffers; finishing them gives the buffers back
        return self.pool.acquire(nbytes)

    def _hold(self, h: Handle, staged: Optional[AlignedBuffer]) -> Handle:
        if staged is not None:
            self._staged.append(h)
            while self._staged and self._staged[0].done():
                self._staged.popleft()
        return h

    def _give_back(self, buf: Optional[AlignedBuffer]) -> None:
        if buf is not None:
            self.pool.release(buf)

    def _pool_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fshard-store")
        return self._executor
