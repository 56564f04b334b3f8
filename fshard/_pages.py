"""New large CPU buffers of a step in transparent huge pages where the kernel maps them afresh: ``empty`` and
``advise``.

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
    s = buf.untyped_storage() if isinstance(buf, torch.Tensor) else buf
    if s.nbytes() < MIN_BYTES or s.device.type != "cpu" or (fns := _libc()) is None:
        return
    madvise, mincore, huge = fns
    start, end = -(-s.data_ptr() // huge) * huge, (s.data_ptr() + s.nbytes()) // huge * huge
    if end <= start:
        return
    vec = (ctypes.c_ubyte * ((end - start) // PAGE))()
    if mincore(start, end - start, vec) != 0:
        return  # (not mapped as expected: leave it to the kernel's defaults)
    for addr, length in unbacked(start, bytes(vec), huge):
        madvise(addr, length, mmap.MADV_HUGEPAGE)


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
