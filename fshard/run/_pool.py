"""``BufferPool``: the memory of gathered buffers freed in a step, kept for that step's later gathers (CPU only).

Why: a gathered unit is freed after its use by emptying its storage (``resize_(0)``) and refilled in place for the
next use, so that every view on it sees the new data. On CPU each refill is a new allocation, and glibc serves one
past its mmap threshold (32 MiB at most: a block of the 117M GPT is 50 MB) with a fresh mapping whose every page
faults in and is cleared: with gather_ahead, forward gathers every unit and backward gathers every one again, 135-
230k page faults a step at two ranks, most of the system CPU that DDP, which keeps its buckets, does not spend
(benchmarks/RESULTS.md, "Session 40").

What: a storage being freed hands its memory to the pool (``UntypedStorage._swap_data_ptr_`` moves the allocation
between two storages: the buffer's storage object stays, empty, as ``resize_(0)`` leaves it), and a refill of the
same byte size takes it back, so the memory moves and nothing is mapped afresh. The run keeps a freed buffer only
while a gather of its size is still to come (in forward, backward re-gathers every unit; in backward, the units
whose backward has not begun: ``StepRun._keeps``); else it goes back to the allocator at once, as before. The pool
is emptied when the call ends: nothing is held between steps.

Not on CUDA (the caching allocator already keeps freed blocks, tied to the gather stream) and not where torch
lacks the swap (then each refill allocates, as before).

Alternatives, measured (design/ARCHITECTURE.md, "The pool of freed gathered buffers"): keeping every freed buffer
(from step to step, or to the step's end) takes more faults away but holds the freed units through backward, where
the gradients need the memory (kept to the step's end: the 117M GPT's peak RSS +76 MiB, +378 MiB with
``reshard_after_forward=False``); glibc's own thresholds (``MALLOC_MMAP_THRESHOLD_``, ``mallopt``) are the
process's, not fshard's.
"""
from __future__ import annotations

import torch

from .. import _pages

_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class BufferPool:
    """Freed gathered storages' memory by byte size, for a step's later gathers (CPU)."""

    def __init__(self):
        self._free: dict[int, list[torch.UntypedStorage]] = {}  # nbytes -> storages holding memory, unused
        self.reused = 0  # bytes of refills served from the pool (until ``clear``)
        self.peak = 0  # the most bytes held at once (until ``clear``)

    @staticmethod
    def applies(device: torch.device) -> bool:
        return _SWAP and device.type == "cpu"

    @property
    def nbytes(self) -> int:
        """Bytes held now (memory of this process that no tensor uses)."""
        return sum(n * len(v) for n, v in self._free.items())

    def count(self, nbytes: int) -> int:
        """Buffers of ``nbytes`` held now."""
        return len(self._free.get(nbytes, ()))

    def refill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory: a freed buffer's of that size if the pool holds one."""
        held = self._free.get(nbytes)
        if held:
            storage._swap_data_ptr_(held.pop())  # storage takes the memory; the empty storage left is dropped
            self.reused += nbytes
        else:
            storage.resize_(nbytes)
            _pages.advise(storage)  # new memory: in huge pages where the kernel maps it afresh (fshard/_pages.py)

    def free(self, storage: torch.UntypedStorage) -> None:
        """Empty ``storage`` (as ``resize_(0)``), keeping its memory for a later ``refill`` of the same size."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        keep = torch.UntypedStorage(0, device=storage.device)
        keep._swap_data_ptr_(storage)  # keep takes the memory; storage is left empty
        self._free.setdefault(nbytes, []).append(keep)
        self.peak = max(self.peak, self.nbytes)

    def clear(self) -> None:
        """Let go of every buffer held (to the allocator)."""
        self._free, self.reused, self.peak = {}, 0, 0
