"""The process's allocator: give freed blocks of 1 MiB and more back to the OS (glibc's ``M_MMAP_THRESHOLD``).

glibc serves a large allocation with its own ``mmap`` and returns it to the OS on ``free``, but only above a
threshold that it raises, up to 32 MiB, each time such a block is freed. From then on the step's many allocations of
a few MiB (gathered units, gradients, store reads, casts) come from the heap arenas, where freed memory stays with
the process, fragmented, and the resident set grows from step to step. Measured (tests/test_offload_params.py, 24
units of 4 MiB, parameters and moments in an NVMeStore): the peak RSS grew by 240, 372 then 408 MiB over three steps
whose fshard-owned peak was 24 MiB; with the threshold fixed at 1 MiB (which also stops glibc from moving it), 46,
51 and 51 MiB. With the moments only offloaded: 376 MiB against 226. It is what made ``step.plan`` under-predict
the scale trials' RSS by 25-32% (benchmarks/RESULTS.md, "The largest model").

So ``import fshard`` fixes the threshold at ``FSHARD_MMAP_THRESHOLD`` bytes (default 1 MiB; 0 leaves glibc's
dynamic threshold), like ``torch.set_num_threads``, a setting of the process. Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def set_mmap_threshold() -> int | None:
    """Fix glibc's mmap threshold as the environment says; returns the bytes set, or None where nothing was set."""
    want = int(os.environ.get("FSHARD_MMAP_THRESHOLD", str(1 << 20)))
    if want <= 0 or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(want))
    except (OSError, AttributeError):  # not glibc
        return None
    return want if ok == 1 else None
