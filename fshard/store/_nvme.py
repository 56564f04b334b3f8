"""NVMeStore: tensors on disk through tensornvme, made safe.

put: items >= direct_min_bytes (1 MiB) are written with O_DIRECT (set on tensornvme's descriptor, see _layout),
others buffered. A contiguous tensor is written in place: its bytes start in the file at its address modulo 4 KiB
(the item's phase), so memory pages and file blocks line up and only the partial first and last blocks are copied
(Iovecs in _pool); a non-contiguous one is staged through a pool buffer. The new version goes to a free slot with
space reserved up front (a full disk fails there), its checksum is taken while the kernel writes, and on wait() the
file must hold the whole item (tensornvme ignores write results, so a short write shows only in the size). Only
then is the key switched to the new version and the old slot released. At most `max_inflight_writes` puts are
outstanding.

get: file presence, identity and size are checked, the bytes are read into `out` in place when `out` is the
store's own memory (empty_for, the pool's buffers: huge pages) at the item's phase, else into a pool buffer and
copied once, and the checksum is verified before the tensor is returned. tensornvme can read an entry once (its
read frees the entry), so the first get after a put goes through tensornvme and a repeated get of an unchanged
item uses a plain pread on the same slot file, which no one else writes. The offloaded optimizer reads each item
once and writes it back, so its reads all go through tensornvme.

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
from ._handle import EventLog, Handle
from ._layout import DIO_ALIGN, Slot, SlotSpace, cleanup, open_store_dir
from ._owner import guard
from ._pool import round_up, AlignedBuffer, BufferPool, Iovecs, copy_bytes as _copy
from ._protocol import DeferredDeletes, ItemMeta, as_bytes, from_bytes, meta_of
from ..errors import (ArgumentError, CorruptedItemError, MissingKeyError, StoreClosedError, StoreError,
                      StoreWriteError)


@dataclass
class _Item:
    meta: ItemMeta
    slot: Optional[Slot]  # None for 0-byte items, which never touch the disk
    direct: bool = False  # written with O_DIRECT (the file holds phase + nbytes rounded up to DIO_ALIGN)
    phase: int = 0  # the item's bytes start at this file offset: the source's address modulo DIO_ALIGN (direct)


class NVMeStore(DeferredDeletes):
    def __init__(self, directory: str, backend: str = "uring", *, create: bool = True, checksum: str = "fast",
                 max_buffers: int = 16, max_buffer_bytes: int = 1 << 30, block: int = 4096,
                 max_free_slots: Optional[int] = None, max_inflight_writes: int = 16,
                 direct: bool = True, direct_min_bytes: int = 1 << 20, events: Optional[EventLog] = None):
        try:
            from tensornvme._C import get_backends
        except ImportError as e:
            raise StoreError("NVMeStore needs tensornvme (pip install tensornvme; see scripts/bootstrap.sh)") from e
        if backend not in get_backends():
            raise ArgumentError(f"tensornvme backend {backend!r} is not available; built with {sorted(get_backends())}")
        self.backend = backend
        self.checksum_kind = validate_kind(checksum)
        self.directory = open_store_dir(directory, create)
        # Free slots kept for reuse: by default one per live item, since each put of a stream round needs one, and
        # recreating a slot costs a first write into new blocks (10x slower here) and, on aio, a 65 ms engine setup.
        # (The callable must not reference self: the finalizer below holds the SlotSpace strongly.)
        items: Dict[Hashable, _Item] = {}
        keep = (lambda: max(16, len(items))) if max_free_slots is None else (lambda: max_free_slots)
        self._space = SlotSpace(self.directory, backend, keep)
        # Runs on close(), on garbage collection, and at interpreter exit (finalize registers with atexit); SIGTERM
        # removes the directory through guard's handler, and a later store removes it if the process was killed.
        self._finalizer = weakref.finalize(self, cleanup, self._space, self.directory, guard(self.directory))
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
        self._init_deferred()

    # ---- put ---------------------------------------------------------------------------------------------
    def put(self, key: Hashable, tensor: torch.Tensor) -> Handle:
        self.collect()
        self._check_open()
        self._settle(key)  # earlier operations on this key complete first: puts commit in order
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            u8 = as_bytes(t.contiguous())
            self._commit(key, _Item(meta_of(t, checksum(u8, self.checksum_kind)), None))
            return Handle.completed("write", key, None, self.events)
        staged: Optional[AlignedBuffer] = None
        contiguous = t.device.type == "cpu" and t.is_contiguous()
        # where the bytes start in the file, for an O_DIRECT write (buffered items start at 0)
        phase = t.data_ptr() % DIO_ALIGN if contiguous and nbytes >= self.direct_min_bytes else 0
        try:
            slot = self._space.acquire(round_up(phase + nbytes, DIO_ALIGN))
        except StoreWriteError as e:
            raise self._write_failed(key, str(e)) from e
        direct = slot.direct_ok and nbytes >= self.direct_min_bytes
        block = DIO_ALIGN if direct else 1
        try:
            if contiguous:  # in place: the middle of the tensor as is, at most two edge blocks copied
                u8 = as_bytes(t)
                io = Iovecs(u8, t.data_ptr() % DIO_ALIGN if direct else 0, block).fill()
            else:  # staged: a non-contiguous tensor goes through a pool buffer, padded to whole blocks
                staged = self._acquire_buffer(round_up(nbytes, block))
                span = staged.bytes(round_up(nbytes, block))
                u8 = span[:nbytes]
                _copy(u8.view(t.dtype).view(t.shape), t)
                io = Iovecs(span, 0, block)
            phase = io.phase
            slot.write(io.vecs, direct)
        except BaseException as e:
            self._give_back(staged)
            self._space.discard(slot)
            if isinstance(e, Exception) and not isinstance(e, StoreError):
                raise StoreWriteError(f"tensornvme rejected the write of key {key!r} to {slot.path!r}: {e}") from e
            raise
        # Checksum after submission: io_uring usually hands a buffered write to a kernel worker, so this pass over
        # the same (unchanging) source bytes runs on the other core while the kernel copies them.
        meta = meta_of(t, checksum(u8, self.checksum_kind))

        def finish(_keep_alive=(io, t)) -> None:  # the kernel reads from the tensor and the edges until reaped
            try:
                slot.wait()
            finally:
                self._give_back(staged)
            problem = slot.problem(phase + nbytes)  # a short write into new space shows as a short file
            if problem is not None:
                self._space.discard(slot)
                raise self._write_failed(key, problem)
            self._commit(key, _Item(meta, slot, direct, phase))

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
            raise ArgumentError(f"out has {out.dtype} {tuple(out.shape)}, key {key!r} holds {meta.dtype} {meta.shape}")
        if meta.nbytes == 0:
            value = torch.empty(meta.shape, dtype=meta.dtype) if out is None else out
            return Handle.completed("read", key, value, self.events)
        slot = item.slot
        phase, n = item.phase, meta.nbytes
        problem = slot.problem(phase + n)
        if problem is not None:
            return Handle.failed("read", key, CorruptedItemError(f"cannot read key {key!r}: {problem}"), self.events)
        dest = as_bytes(out) if out is not None and out.device.type == "cpu" and out.is_contiguous() else None
        staged: Optional[AlignedBuffer] = None
        io: Optional[Iovecs] = None
        if not slot.armed:  # the engine already consumed its entry; the file still holds the item, no one writes it
            u8 = dest if dest is not None else self.pool.lend(n)
            waiter = self._pool_executor().submit(slot.pread, u8, phase).result
        else:  # read the item's file range as it was written: same phase and block, so the same requests
            direct = item.direct and self.direct_reads
            block = DIO_ALIGN if item.direct else 1
            # In place into the store's own memory only. A caller's tensor (4 KiB pages) splits a direct read into
            # requests of ~1.8 MiB instead of ~3.2 and costs kernel work per page: 1.6-2.0 GB/s here, where a read
            # into a pool buffer plus one copy ran at 2.4 (benchmarks/RESULTS.md, NVMe store runs J and K).
            if dest is not None and (block == 1 or (dest.data_ptr() % block == phase
                                                    and self.pool.owns(dest.data_ptr(), n))):
                io = Iovecs(dest, phase, block)  # in place, edges copied after the read
                u8 = dest
            else:  # out's memory does not line up with the file (or no out): a whole aligned span, then a view
                span_n = round_up(phase + n, block)
                if out is not None:
                    staged = self._acquire_buffer(span_n)
                    span = staged.bytes(span_n)
                else:  # the caller's result: lent memory, reused once the caller drops it (room for any phase)
                    span = self.pool.lend(span_n, room=round_up(n, block) + block)
                io, u8 = Iovecs(span, 0, block), span[phase:phase + n]
            try:
                slot.read(io.vecs, direct)
            except BaseException:
                self._give_back(staged)
                raise
            waiter = slot.wait

        def finish() -> torch.Tensor:
            try:
                got = waiter()
                problem = slot.problem(phase + n)
                if problem is None and got is not None and got != n:
                    problem = f"short read of {got} bytes from {slot.path!r}, {n} expected"
                if problem is not None:
                    raise CorruptedItemError(f"cannot read key {key!r}: {problem}")
                if io is not None:
                    io.scatter()
                if checksum(u8, self.checksum_kind) != meta.checksum:
                    raise CorruptedItemError(f"key {key!r}: checksum mismatch reading {slot.path!r}; the file "
                                             f"was corrupted or modified after the put")
                if out is None:
                    return from_bytes(u8, meta)
                if u8 is not dest:
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

    def phase(self, key: Hashable) -> int:
        """Where `key`'s bytes start within a 4 KiB block of its file. A destination for get() whose address has
        the same offset within its page is read in place (Stream allocates its buffers that way)."""
        self._settle(key, writes_only=True)
        item = self._items.get(key)
        return 0 if item is None else item.phase

    def empty_for(self, key: Hashable) -> torch.Tensor:
        """An uninitialised tensor with `key`'s dtype and shape, in the store's own (huge-page) memory, whose address
        has the item's phase: get(key, out=it) reads into it in place (no pool buffer, no copy). Its memory is lent
        like a get's result (BufferPool.lend): reused by the store once the tensor dies."""
        meta = self.meta(key)
        phase = self.phase(key)
        if meta.nbytes == 0:
            return torch.empty(meta.shape, dtype=meta.dtype)
        return self.pool.lend(phase + meta.nbytes)[phase:].view(meta.dtype).view(meta.shape)

    def keys(self) -> List[Hashable]:
        self.collect()
        self.flush()
        return list(self._items)

    def __contains__(self, key: Hashable) -> bool:
        self._settle(key, writes_only=True)
        return key in self._items

    def __len__(self) -> int:
        self.collect()
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
        self.collect()
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
            self.pool.max_spare_bytes = 0  # results the caller still holds are dropped when they die, not kept
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
        # Only operations in flight are kept: a done handle is dropped at once, so the store never keeps a result
        # alive that the caller has let go (its memory is lent, see BufferPool.lend).
        self._pending.setdefault(h.key, []).append(h)
        h._on_done = self._untrack
        return h

    def _untrack(self, h: Handle) -> None:
        handles = self._pending.get(h.key, [])
        if h in handles:  # Handle has no __eq__: identity
            handles.remove(h)
            if not handles:
                del self._pending[h.key]

    def _settle(self, key: Hashable, writes_only: bool = False) -> None:
        for h in list(self._pending.get(key, ())):
            if not writes_only or h.kind == "write":
                h.reap()

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
            # a store dropped without close() ends its thread as it dies (before the directory goes: newer first)
            weakref.finalize(self, self._executor.shutdown, wait=True)
        return self._executor
