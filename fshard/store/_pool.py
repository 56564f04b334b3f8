"""A bounded pool of page-aligned, reusable I/O buffers.

Each buffer is its own anonymous mmap: page-aligned (so a later O_DIRECT path needs no copy), and a tensor made
with `torch.frombuffer(mm, count=n)` has a storage of exactly n bytes at offset 0. That matters because tensornvme
sizes each iovec by `tensor.storage().nbytes()` starting at `data_ptr()`: a view with an offset into a larger
storage (the usual over-allocate-and-slice way to align) would make it read or write past the end of the storage.

Capacities are rounded up to the block size, so a buffer fits any item up to its capacity and is reused by the
next item of a similar size (best fit). The pool is bounded in buffer count and in bytes; when a new buffer does
not fit, free buffers are dropped first, and only when every buffer is in use does acquire() raise.

Results handed to the caller (NVMeStore.get without `out`) are lent: the buffer comes back to a bounded spare list
when the last tensor over it dies, and the next result of a similar size reuses it, as torch's caching allocators
do. Fresh memory costs a page fault per page (and here a host fault, since freed guest memory is reported back to
the host), so `t = store.get(k).wait()` in a loop reads at the speed of a read into reused memory.
"""
from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import List, Optional

import numpy as np
import torch

from ..errors import ArgumentError, PoolExhaustedError

PAGE = mmap.PAGESIZE


def _round_up(n: int, block: int) -> int:
    return max(block, (n + block - 1) // block * block)


HUGE = 2 << 20


class AlignedBuffer:
    """One page-aligned buffer of `capacity` bytes; from 2 MiB up it starts on a 2 MiB boundary (see __init__)."""

    __slots__ = ("mm", "capacity", "pinned", "address", "offset")

    def __init__(self, capacity: int):
        # Private, not shared (Python's default): only private anonymous memory can get transparent huge pages,
        # which direct I/O pins and maps with far fewer page lookups (256 MiB read 0.12-0.13 s vs 0.14-0.17 s).
        # Large buffers start on a 2 MiB boundary, so huge pages cover all of them, not only their aligned middle:
        # cold reads of 1 GiB ran 5-10% faster so (RESULTS.md (NVMe store), after run L). The padding is never
        # touched, so it costs address space, not memory.
        huge = capacity >= HUGE
        self.mm = mmap.mmap(-1, capacity + (HUGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))  # the temporary export ends here
        self.offset = -base % HUGE if huge else 0
        self.capacity = capacity
        self.address = base + self.offset
        self.pinned = _maybe_pin(self)

    def bytes(self, n: int) -> torch.Tensor:
        """A uint8 tensor over the first n bytes, whose storage is exactly n bytes (safe to hand to tensornvme)."""
        if n > self.capacity:
            raise ArgumentError(f"{n} bytes do not fit a {self.capacity}-byte buffer")
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=self.offset)


def round_up(n: int, block: int) -> int:
    return (n + block - 1) // block * block


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), as one single-threaded memcpy when both are contiguous: torch's parallel copy leaves its
    OpenMP threads spinning, which takes the cores the kernel needs to run the I/O (2 vCPUs here)."""
    if dst.is_contiguous() and src.is_contiguous() and src.device.type == "cpu" and dst.dtype == src.dtype:
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def raw_bytes(addr: int, n: int) -> torch.Tensor:
    """A uint8 tensor over the n bytes at `addr` whose storage is exactly those bytes (tensornvme sizes each iovec
    by its storage). It does not own the memory: whoever uses it keeps the owner alive."""
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8)


class Iovecs:
    """The requests that move `u8` (contiguous bytes in memory) to or from a file range in which the bytes start
    at offset `phase`, every request aligned to `block` in memory address, file offset and length (O_DIRECT).

    With `phase` equal to u8's own address modulo `block`, memory pages and file blocks line up: the aligned
    middle of u8 is read or written in place, and only the partial first and last blocks go through a small edge
    buffer (at most 2 blocks copied, whatever the size). This is why an ordinary torch tensor (64-byte aligned)
    needs no staging copy for O_DIRECT. With block 1 (buffered I/O) it is u8 itself."""

    def __init__(self, u8: torch.Tensor, phase: int, block: int):
        n, addr = u8.numel(), u8.data_ptr()
        assert u8.is_contiguous() and (block == 1 or addr % block == phase), "memory phase must match the file's"
        self.u8, self.phase = u8, phase
        self.head = min(n, block - phase) if phase else 0  # item bytes in the first, partial block
        mid = (n - self.head) // block * block
        self.tail = n - self.head - mid
        edges = (phase > 0) + (self.tail > 0)
        self.edges = aligned_empty(edges * block) if edges else None  # owns the edge blocks (zero padding)
        e = self.edges.data_ptr() if edges else 0
        self.first = raw_bytes(e, block) if phase else None
        self.last = raw_bytes(e + block * (phase > 0), block) if self.tail else None
        self.vecs = ([self.first] if phase else []) + ([raw_bytes(addr + self.head, mid)] if mid else []) + \
            ([self.last] if self.tail else [])

    def fill(self) -> "Iovecs":
        """Before a write: copy u8's partial blocks into the edge buffer."""
        n = self.u8.numel()
        if self.first is not None:
            self.first[self.phase:self.phase + self.head] = self.u8[:self.head]
        if self.last is not None:
            self.last[:self.tail] = self.u8[n - self.tail:]
        return self

    def scatter(self) -> None:
        """After a read: copy the partial blocks from the edge buffer into u8."""
        n = self.u8.numel()
        if self.first is not None:
            self.u8[:self.head] = self.first[self.phase:self.phase + self.head]
        if self.last is not None:
            self.u8[n - self.tail:] = self.last[:self.tail]


def _maybe_pin(buf: AlignedBuffer) -> bool:
    # Page-locked host memory lets a later H2D copy run asynchronously; only worth it (and possible) with CUDA.
    # Each registration is undone when the mapping dies: the driver keeps a registered range's pages pinned after
    # munmap, and a later mapping at the same address then fails to register ("part or all of the requested memory
    # range is already mapped", seen on an H100), an error the next CUDA call in the process raised.
    if not torch.cuda.is_available():
        return False
    try:
        cudart = torch.cuda.cudart()
        if cudart.cudaHostRegister(buf.address, buf.capacity, 0) != 0:
            return False
        weakref.finalize(buf.mm, cudart.cudaHostUnregister, buf.address).atexit = False
        return True
    except Exception:  # pinning is an optimisation; an unpinned buffer still works
        return False


def aligned_empty(nbytes: int, block: int = 4096) -> torch.Tensor:
    """A fresh page-aligned uint8 tensor of exactly nbytes (not pooled: the caller owns it)."""
    return AlignedBuffer(_round_up(nbytes, block)).bytes(nbytes)


def aligned_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor like `t` (dtype, shape) on page-aligned memory of its own: NVMeStore
    puts and gets such tensors in place with O_DIRECT when their size is a multiple of 4 KiB (no staging copy)."""
    n = t.numel() * t.element_size()
    return aligned_empty(n).view(t.dtype).view(t.shape) if n else torch.empty_like(t, device="cpu")


def _come_back(pool_ref: "weakref.ref[BufferPool]", buf: AlignedBuffer) -> None:
    # Runs when the last tensor over a lent buffer dies, in whichever thread drops it: list appends are atomic.
    pool = pool_ref()
    if pool is not None and pool.spare_bytes + buf.capacity <= pool.max_spare_bytes:
        pool._spare.append(buf)


class BufferPool:
    def __init__(self, max_buffers: int = 16, max_bytes: int = 1 << 30, block: int = 4096,
                 max_spare_bytes: Optional[int] = None):
        if block <= 0 or block % PAGE and PAGE % block:
            raise ArgumentError(f"block size {block} must divide or be a multiple of the page size {PAGE}")
        self.max_buffers, self.max_bytes, self.block = max_buffers, max_bytes, block
        self._free: List[AlignedBuffer] = []
        self._in_use = 0
        self._resident = 0
        # Every mapping this pool made or adopted, by address, held weakly (an entry goes when its last tensor
        # does): the store reads in place only into these (see NVMeStore.get).
        self._made: "weakref.WeakValueDictionary[int, mmap.mmap]" = weakref.WeakValueDictionary()
        # Lent buffers whose tensors have died, kept for the next lend(); bounded apart from the pool's own buffers
        # (results the caller holds are not the pool's to count).
        self._spare: List[AlignedBuffer] = []
        self.max_spare_bytes = max_bytes if max_spare_bytes is None else max_spare_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes held by the pool: its buffers, in use or free, and the spare lent buffers (not those lent out)."""
        return self._resident + self.spare_bytes

    @property
    def spare_bytes(self) -> int:
        return sum(b.capacity for b in list(self._spare))

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def free_buffers(self) -> int:
        return len(self._free)

    def can_acquire(self, nbytes: int) -> bool:
        cap = _round_up(nbytes, self.block)
        if any(b.capacity >= cap for b in self._free):
            return True
        freeable = sum(b.capacity for b in self._free)
        return (self._in_use < self.max_buffers and self._resident - freeable + cap <= self.max_bytes)

    def acquire(self, nbytes: int) -> AlignedBuffer:
        cap = _round_up(nbytes, self.block)
        fits = [b for b in self._free if b.capacity >= cap]
        if fits:  # best fit: the smallest free buffer that holds the item
            buf = min(fits, key=lambda b: b.capacity)
            self._free.remove(buf)
            self._in_use += 1
            return buf
        # Make room by dropping free buffers (largest first) until the new one fits both bounds.
        self._free.sort(key=lambda b: b.capacity)
        while self._free and (self._count() >= self.max_buffers or self._resident + cap > self.max_bytes):
            self._drop(self._free.pop())
        if self._count() >= self.max_buffers or self._resident + cap > self.max_bytes:
            raise PoolExhaustedError(
                f"buffer pool exhausted: {self._in_use} buffers / {self._resident} bytes in use, bounds "
                f"{self.max_buffers} buffers / {self.max_bytes} bytes, {cap} bytes requested")
        buf = self.adopt(AlignedBuffer(cap))
        self._resident += cap
        self._in_use += 1
        return buf

    def adopt(self, buf: AlignedBuffer) -> AlignedBuffer:
        """Record a buffer made for the store outside the pool's bounds (lent memory), so owns() knows it."""
        self._made[buf.address] = buf.mm  # the mapping runs at least `capacity` bytes past the address
        return buf

    def owns(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, addr + nbytes) lies in one live buffer this pool made or adopted."""
        return any(start <= addr and addr + nbytes <= start + len(mm) for start, mm in list(self._made.items()))

    def lend(self, nbytes: int, room: int = 0) -> torch.Tensor:
        """A uint8 tensor of exactly nbytes on page-aligned memory that becomes the caller's, in a buffer of at least
        `room` bytes (so that it fits the next item of the same size whatever its phase). The buffer comes back to
        the spare list when the last tensor over it dies (see the module docstring)."""
        cap = _round_up(max(nbytes, room), self.block)
        spare = list(self._spare)  # another thread may append meanwhile; best fit, at most twice too large
        fits = [b for b in spare if cap <= b.capacity <= 2 * cap]
        if fits:
            buf = min(fits, key=lambda b: b.capacity)
            self._spare.remove(buf)
        else:
            buf = self.adopt(AlignedBuffer(cap))
        # The array owns the export of the mapping and the tensor's storage owns the array, so the array dies
        # exactly when the last tensor (or view) over these bytes does; its storage is exactly nbytes (tensornvme).
        arr = np.frombuffer(buf.mm, dtype=np.uint8, count=nbytes, offset=buf.offset)
        weakref.finalize(arr, _come_back, weakref.ref(self), buf).atexit = False
        return torch.from_numpy(arr)

    def release(self, buf: AlignedBuffer) -> None:
        self._in_use -= 1
        self._free.append(buf)

    def clear(self) -> None:
        """Drop the free and spare buffers (buffers in use are dropped when released after this)."""
        while self._free:
            self._drop(self._free.pop())
        self._spare.clear()

    def _count(self) -> int:
        return self._in_use + len(self._free)

    def _drop(self, buf: AlignedBuffer) -> None:
        self._resident -= buf.capacity
        # The mmap is unmapped when the last tensor over it is gone; closing it now could fail on exported views.
        del buf
