"""File layout and space management: one tensornvme engine per slot file, one item version per slot.

Why slots and not one big file with our own extent allocator: tensornvme 0.1.0 cannot be told where to write.
Each write asks its own SpaceManager for an offset, each read *frees* that extent, and only a read can free one.
Its allocator also leaks (freeing the last extent forgets a free neighbour), which is the unbounded-growth defect.
So a shared engine file cannot keep an old version safe while a new one is written, cannot delete without reading,
and cannot be re-read. Giving every slot its own engine and file makes placement trivial and exact: the engine
holds at most one entry, always at offset 0, so its allocator never fragments or leaks, and the file is exactly the
item. Space is then managed at slot granularity:

- a new version always goes to a free slot, so the old version is untouched until the new write is checked;
- a free slot keeps its blocks, and the next version of a similar size overwrites them. On this ext4 disk,
  overwriting allocated blocks runs at ~9 GB/s (page cache) while a first write into new blocks runs at 0.3-0.6
  GB/s (allocation, unwritten-extent conversion), so reuse is what makes writes fast. Best fit: the smallest free
  slot that is large enough; a slot more than 25% too large is trimmed first (items of two sizes, a stored
  parameter's chunk beside its moments' at half the size, would otherwise drift into the larger slots: 1.33x the
  live bytes on disk, measured);
- space is reserved with posix_fallocate before the write, so a full disk fails cleanly up front, before any byte
  of the new version is written (tensornvme would not report the short write; the size is checked after anyway);
- delete() truncates its slot to 0 bytes: the space is returned at once. Free slots beyond `max_free()` (by
  default one per live item) are destroyed (tensornvme's destructor closes and removes the file);
- a slot whose entry was never read still holds a tensornvme registration, which only a read could clear, so it is
  destroyed rather than reused.

The disk footprint is therefore the live items plus, at most, one free slot per live item (the previous versions'
blocks, kept for reuse), whatever the number of put/get rounds.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from typing import Callable, List, Optional

import torch

from ..errors import StoreDirectoryError, StoreError, StoreWriteError
from ._owner import PREFIX, TermCleanup, sweep, unguard, write_owner

_ENGINE_KEY = "v"  # each engine holds at most one entry, so one fixed key suffices
DIO_ALIGN = 4096  # O_DIRECT buffer address, length and offset alignment we ask for (ext4 needs <= 4096)


def _next_fds(n: int = 2) -> tuple:
    """The descriptors the next ``n`` open()s will get: the lowest unused ones (POSIX)."""
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
    for fd in fds:
        os.close(fd)
    return tuple(fds)


def _engine_fd(ino: int, dev: int, mine: int, hints: tuple = ()) -> Optional[int]:
    """The descriptor tensornvme opened on our file: the only other fd in this process naming the same inode.
    ``hints`` first (``_next_fds()`` just before the engine was made: it opens its io_uring, then the file, so it
    gets the second of them unless another thread opened a descriptor in between), then every descriptor: stating
    every descriptor for every new slot is quadratic in the slots (4,000 slots: 29.1 s, against 1.8 s with the
    hints; a 4.87B GPT's store has about 9,000 per rank)."""
    for fd in hints:
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if fd != mine and st.st_ino == ino and st.st_dev == dev:
            return fd
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == mine:
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if st.st_ino == ino and st.st_dev == dev:
            found.append(fd)
    return found[0] if len(found) == 1 else None


def open_store_dir(directory: str, create: bool) -> str:
    """Check `directory` and make this store's private subdirectory in it; errors name the path."""
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        if not create:
            raise StoreDirectoryError(f"store directory {directory!r} does not exist (create=False)")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise StoreDirectoryError(f"cannot create store directory {directory!r}: {e.strerror or e}") from e
    if not os.path.isdir(directory):
        raise StoreDirectoryError(f"store directory {directory!r} is not a directory")
    try:  # a real creation, not os.access: it also catches read-only mounts and root on read-only filesystems
        own = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
    except OSError as e:
        raise StoreDirectoryError(f"store directory {directory!r} is not writable: {e.strerror or e}") from e
    try:
        write_owner(own)  # what lets a later store prove this directory's owner gone (_owner.py)
    except OSError as e:
        shutil.rmtree(own, ignore_errors=True)
        raise StoreDirectoryError(f"cannot write the owner record in {own!r}: {e.strerror or e}") from e
    sweep(directory, own)  # directories of dead processes (killed, or ended by SIGTERM before this fix)
    return own


class Slot:
    """One file and the tensornvme engine bound to it."""

    __slots__ = ("path", "fd", "ino", "engine", "armed", "efd", "direct_ok", "_direct")

    def __init__(self, path: str, backend: str, n_entries: int = 2):
        from tensornvme._C import Offloader  # the bare engine: DiskOffloader's wrapper would free our storages

        self.path = path
        try:  # we create the file: tensornvme's open() result is unchecked and a failure would go unnoticed
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise StoreWriteError(f"cannot create store file {path!r}: {e.strerror or e}") from e
        self.ino = os.fstat(self.fd).st_ino
        hints = _next_fds()[::-1]
        try:
            self.engine = Offloader(path, n_entries, backend)
        except Exception:
            os.close(self.fd)
            os.unlink(path)
            raise
        self.armed = False  # True while the engine holds a registered (written, not yet read) entry
        # O_DIRECT on tensornvme's own file description (it opens without it; its io_uring/aio requests use the
        # plain fd, looked up at submission): set per request with F_SETFL, so aligned items bypass the page cache.
        st = os.fstat(self.fd)
        self.efd = _engine_fd(st.st_ino, st.st_dev, self.fd, hints)
        self._direct = False
        self.direct_ok = self.efd is not None and self._set_direct(True) and self._set_direct(False)

    def _set_direct(self, on: bool) -> bool:
        try:
            flags = fcntl.fcntl(self.efd, fcntl.F_GETFL)
            fcntl.fcntl(self.efd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
        except OSError:  # EINVAL: the filesystem has no O_DIRECT
            return False
        self._direct = on
        return True

    def _mode(self, direct: bool) -> None:
        if direct != self._direct and not self._set_direct(direct):
            raise StoreError(f"cannot switch O_DIRECT {'on' if direct else 'off'} for {self.path!r}")

    def write(self, vecs: List[torch.Tensor], direct: bool = False) -> None:
        self._mode(direct)  # no request is in flight on this slot: it is ours between acquire and release
        self.engine.async_writev(vecs, _ENGINE_KEY)  # one request, at offset 0 (the engine's only entry)
        self.armed = True

    def read(self, vecs: List[torch.Tensor], direct: bool = False) -> None:
        self._mode(direct)
        self.engine.async_readv(vecs, _ENGINE_KEY)  # completion frees the engine's extent; the bytes stay
        self.armed = False

    def wait(self) -> None:
        self.engine.synchronize()  # runs tensornvme's completion loop; holds the GIL while it blocks

    def pread(self, u8: torch.Tensor, offset: int = 0) -> int:
        """Plain positional read, for a slot the engine can no longer read (see NVMeStore.get)."""
        return os.preadv(self.fd, [u8.numpy()], offset)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def problem(self, nbytes: int) -> Optional[str]:
        """Why this file cannot hold `nbytes` valid bytes, or None. Checked by path so a deletion shows."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"file {self.path!r} was deleted"
        if st.st_ino != self.ino:
            return f"file {self.path!r} was replaced"
        if st.st_size < nbytes:
            return f"file {self.path!r} is truncated: {st.st_size} bytes on disk, {nbytes} expected"
        return None

    def truncate(self, nbytes: int = 0) -> None:
        os.ftruncate(self.fd, nbytes)

    def reserve(self, nbytes: int) -> None:
        """Make sure the file has blocks for nbytes: a full disk fails here, before anything is written."""
        size = self.size()
        if size > nbytes + nbytes // 4:  # do not pin a large slot's space under a smaller item
            self.truncate(nbytes)
        elif size < nbytes:
            try:
                os.posix_fallocate(self.fd, 0, nbytes)
            except OSError as e:
                raise StoreWriteError(f"cannot reserve {nbytes} bytes in {self.path!r}: {e.strerror or e}") from e

    def destroy(self) -> None:
        if self.engine is None:
            return
        if not os.path.exists(self.path):  # tensornvme's destructor prints an error when the file is gone
            try:
                os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
            except OSError:
                pass
        self.engine = None  # destructor: synchronize, close, remove the file
        os.close(self.fd)


class SlotSpace:
    """Free list of slots for one store directory."""

    def __init__(self, directory: str, backend: str, max_free: Callable[[], int] = lambda: 64):
        self.directory, self.backend, self.max_free = directory, backend, max_free
        self._free: List[Slot] = []
        self._all: set = set()
        self._next = 0

    def acquire(self, nbytes: int) -> Slot:
        """A slot with space reserved for nbytes. Raises StoreWriteError when the disk is full."""
        slot = self._best_free(nbytes)
        if slot is None:
            path = os.path.join(self.directory, f"slot-{self._next:06d}")
            self._next += 1
            slot = Slot(path, self.backend)
            self._all.add(slot)
        try:
            slot.reserve(nbytes)
        except BaseException:
            self.discard(slot)
            raise
        return slot

    def _best_free(self, nbytes: int) -> Optional[Slot]:
        if not self._free:
            return None
        # Smallest that fits, else the largest (it grows); among equals the most recently freed, whose pages are
        # the likeliest to still be in the page cache.
        sizes = [s.size() for s in self._free]
        order = sorted(range(len(sizes)), key=lambda i: (sizes[i], -i))
        fits = [i for i in order if sizes[i] >= nbytes]
        return self._free.pop(fits[0] if fits else order[-1])

    def release(self, slot: Slot, trim: bool = False) -> None:
        """The slot's version is dead. Keep the slot (and its blocks, unless `trim`) for reuse."""
        if slot.armed or len(self._free) >= self.max_free():
            return self.discard(slot)
        if trim:
            try:
                slot.truncate()
            except OSError:
                return self.discard(slot)
        self._free.append(slot)

    def discard(self, slot: Slot) -> None:
        self._all.discard(slot)
        try:  # free the blocks now: the io_uring ring holds a file reference that is dropped only later
            slot.truncate()
        except OSError:
            pass
        slot.destroy()

    @property
    def slots(self) -> int:
        return len(self._all)

    def files(self) -> List[str]:
        return [s.path for s in self._all]

    def disk_bytes(self) -> int:
        """Bytes the slot files occupy on disk (allocated blocks, not apparent size)."""
        total = 0
        for s in self._all:
            try:
                total += os.fstat(s.fd).st_blocks * 512
            except OSError:
                pass
        return total

    def close(self) -> None:
        for s in list(self._all):
            s.destroy()
        self._all.clear()
        self._free.clear()


def cleanup(space: SlotSpace, directory: str, term: Optional[TermCleanup] = None) -> None:
    """Close every engine and remove the store's directory. Used by close(), weakref.finalize and atexit (and
    `term`, the SIGTERM handler, removes the directory when the process is terminated; see _owner.py)."""
    try:
        space.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        unguard(term, directory)
