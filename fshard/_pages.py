"""New large CPU buffers of a step in transparent huge pages where the kernel maps them afresh: ``empty`` and
``advise``; and the long-lived state (parameter shards, optimizer rows) in huge pages: ``state_empty``, ``state_copy``.

Why: a step allocates large buffers anew every time (gathered units, this rank's sections of a bucket, the
exchange's receive buffers). glibc serves a block past its mmap threshold (32 MiB at most) with a fresh mapping,
and a smaller one from its heap, whose top it gives back to the kernel when enough of it is free; either way
every 4 KiB page of new memory faults in and is cleared by the kernel when it is first written. On the development
machine (a VM) a fault costs about 2.7 us: writing a new 50 MiB buffer took 45 ms and 12.8k faults against 9.3 ms
into one already mapped, and the 117M GPT at two ranks took 89-126k faults a rank a step (benchmarks/RESULTS.md,
"Session 44"), which DDP, whose buckets and gradients stay mapped, does not pay. Advised, the same buffer took 14 ms
and 537 faults (its unaligned ends stay in 4 KiB pages; the kernel still clears every page once).

What: after torch allocates a buffer of at least ``MIN_BYTES`` (16 MiB) on the CPU, and before anything writes it,
``advise`` asks the kernel (``madvise(MADV_HUGEPAGE)``) for huge pages over each whole, huge-page aligned range of it
that no page backs yet (``mincore``): memory the kernel would map afresh. Memory the heap reuses, already mapped,
is left as it is: it costs no fault, and asking there would only split glibc's heap mapping. It is a hint: the
buffer is torch's, freed by torch, its contents and results the same bits, and where the kernel has no transparent
huge pages (``enabled`` is ``never``, not Linux), where ``FSHARD_HUGE_PAGES=0``, or on CUDA, nothing is done.

The state: a buffer that lives from update to update (4 MiB or more: ``STATE_MIN_BYTES``) is asked for as above
before its first write and, where glibc's heap reused memory already mapped in 4 KiB pages, collapsed into huge
pages after it (``MADV_COLLAPSE``: the kernel copies them, once); a new version written by an update that keeps its
input is asked for where new only. An update's pass over its state then walks the page tables once per 2 MiB
(design/ARCHITECTURE.md, "The state in huge pages").

Alternatives, measured (RESULTS "Session 44"): buffers of fshard's own mapping in huge pages, always fresh, took
the heap's reuse away where glibc had it (the 27.4M GPT at two ranks went from 1.05x to 1.13x DDP: the kernel clears
every new page); advising from 4 MiB on showed no gain at the 27.4M GPT's sizes, hence 16 MiB; keeping the buffers
from step to step (a pool) holds a gradient's worth of memory through the next forward and raises the peak
(design/ARCHITECTURE.md, "The pool of freed gathered buffers"); glibc's thresholds and torch's
``THP_MEM_ALLOC_ENABLE`` are the whole process's settings, not a library's to make.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import warnings

import torch

HUGE = 2 << 20  # bytes of a transparent huge page where sysfs does not say (x86-64; arm64 with 4 KiB base pages)
PAGE = mmap.PAGESIZE
_BIT0 = bytes(b & 1 for b in range(256))  # mincore's byte -> its resident bit (the others are reserved)
# Smaller buffers are left alone: glibc mostly serves them from its heap, reused (the 27.4M GPT's 12.6 MB blocks and
# 6.3 MB sections: no gain measured, RESULTS "Session 44"); the 117M GPT's 25 MB sections and 50 MB blocks gain.
MIN_BYTES = 16 << 20
# A state buffer lives from step to step, so even a few whole huge pages in it pay at every update (a 27.4M GPT's
# blocks: 12.6 MB at one rank, 6.3 MB at two).
STATE_MIN_BYTES = 4 << 20
MADV_COLLAPSE = 25  # (Linux's; Python's mmap module has no name for it before 3.13)


@functools.cache
def _libc():
    """libc's ``madvise`` and ``mincore`` and the huge page's bytes, or None where huge pages cannot be asked for
    (read once a process)."""
    v = os.environ.get("FSHARD_HUGE_PAGES", "").strip()
    if v not in ("", "0", "1"):  # (read at a step's first large buffer: a warning, not an error in the step)
        warnings.warn(f"FSHARD_HUGE_PAGES (environment)={v!r} is not 0 or 1: ignored, huge pages are asked for as by "
                      "default; set it to 0 to turn them off, or unset it.", RuntimeWarning, stacklevel=2)
    if v == "0" or not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        try:  # (arm64 with 64 KiB base pages: 512 MiB)
            with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
                huge = int(f.read())
        except (OSError, ValueError):
            huge = HUGE
        libc = ctypes.CDLL(None)
        madvise, mincore = libc.madvise, libc.mincore
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return madvise, mincore, huge


def available() -> bool:
    """Whether ``advise`` can ask for huge pages here."""
    return _libc() is not None


def advise(buf: torch.Tensor | torch.UntypedStorage) -> None:
    """Ask for huge pages over the ranges of a new CPU buffer (a tensor's storage, or a storage) that no page backs
    yet; call it before anything writes the buffer. Does nothing below ``MIN_BYTES``, on CUDA, or where
    ``available()`` is False."""
    _advise(buf, MIN_BYTES)


def _advise(buf: torch.Tensor | torch.UntypedStorage, min_bytes: int) -> list[tuple[int, int]]:
    """``advise`` from ``min_bytes``; returns the runs of the buffer's whole huge pages that were backed already
    (the heap's reused memory), as (address, bytes), for ``collapse``."""
    s = buf.untyped_storage() if isinstance(buf, torch.Tensor) else buf
    if s.nbytes() < min_bytes or s.device.type != "cpu" or (fns := _libc()) is None:
        return []
    madvise, mincore, huge = fns
    start, end = -(-s.data_ptr() // huge) * huge, (s.data_ptr() + s.nbytes()) // huge * huge
    if end <= start:
        return []
    vec = (ctypes.c_ubyte * ((end - start) // PAGE))()
    if mincore(start, end - start, vec) != 0:
        return []  # (not mapped as expected: leave it to the kernel's defaults)
    runs = unbacked(start, bytes(vec), huge)
    for addr, length in runs:
        madvise(addr, length, mmap.MADV_HUGEPAGE)
    return _between(start, end, runs)


def _between(start: int, end: int, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) that ``runs`` (sorted, inside it) leave out, as (address, bytes)."""
    out, at = [], start
    for addr, length in runs + [(end, 0)]:
        if addr > at:
            out.append((at, addr - at))
        at = addr + length
    return out


def collapse(runs: list[tuple[int, int]]) -> None:
    """Move the pages of ``runs`` (whole huge pages of a written buffer, as ``advise`` returns them) into huge pages
    now (``MADV_COLLAPSE``, Linux 6.1 and later: the kernel copies them; an older kernel, or one that cannot find
    huge pages, refuses, and the pages stay as they are)."""
    if not runs or (fns := _libc()) is None:
        return
    for addr, length in runs:
        fns[0](addr, length, MADV_COLLAPSE)


def state_empty(numel: int, dtype: torch.dtype, device, write) -> torch.Tensor:
    """A new long-lived state buffer (a parameter shard, an optimizer row: read and written at every update), written
    by ``write(t)``, in huge pages from ``STATE_MIN_BYTES``: the pages the kernel maps afresh are asked for before the
    write (``advise``), those the heap reused are collapsed after it (``collapse``). Why: an update is one pass over
    its state at the memory's speed, and in 4 KiB pages every page walks the page tables (RESULTS "Session 46":
    torch's fused AdamW, SGD and Adagrad kernels 7-13% faster over the same tensors in huge pages)."""
    return settled(torch.empty(numel, dtype=dtype, device=device), write)


def settled(t: torch.Tensor, write) -> torch.Tensor:
    """``state_empty`` on a buffer just allocated: ``t``, written by ``write(t)``, its whole huge pages asked for
    where unbacked, collapsed where the heap reused them."""
    reused = _advise(t, STATE_MIN_BYTES)
    write(t)
    collapse(reused)
    return t


def state_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()`` for a new version of a state buffer (an update that does not donate its input): advised as
    ``state_empty``'s where the kernel maps it afresh; not collapsed (a copy of the pages at every step would cost
    what it saves)."""
    if t.device.type != "cpu" or t.nbytes < STATE_MIN_BYTES or not t.is_contiguous():
        return t.clone()
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    _advise(out, STATE_MIN_BYTES)
    return out.copy_(t)


def unbacked(start: int, resident: bytes, huge: int = HUGE) -> list[tuple[int, int]]:
    """The maximal runs, as (address, bytes), of whole huge pages (``huge`` bytes) from ``start`` (a multiple of
    ``huge``) in which no page is resident; ``resident`` has mincore's byte per base page (bit 0: resident), whole
    huge pages of them."""
    bits, per, runs, run = resident.translate(_BIT0), huge // PAGE, [], None  # run: the start of the current run
    for k in range(len(bits) // per + 1):
        free = (k + 1) * per <= len(bits) and bits.count(0, k * per, (k + 1) * per) == per
        if free and run is None:
            run = start + k * huge
        elif not free and run is not None:
            runs.append((run, start + k * huge - run))
            run = None
    return runs


def empty(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype, device=device)``, then ``advise``: a new buffer about to be written."""
    t = torch.empty(numel, dtype=dtype, device=device)
    advise(t)
    return t
