"""``fs.set_mmap_threshold``: have glibc give freed blocks of ``nbytes`` and more back to the OS at once.

glibc serves a large allocation with its own ``mmap`` and returns it to the OS on ``free``, but only above a
threshold that it raises, up to 32 MiB, each time such a block is freed. From then on a step's many allocations of
a few MiB (gathered units, gradients, store reads, casts) come from the heap arenas, where freed memory stays with
the process, fragmented, and the resident set grows from step to step. Measured (tests/test_offload_params.py, 24
units of 4 MiB, parameters and moments in an NVMeStore): the peak RSS grew by 240, 372 then 408 MiB over three steps
whose fshard-owned peak was 24 MiB; with the threshold fixed at 1 MiB (which also stops glibc from moving it), 46,
51 and 51 MiB; with the moments only offloaded, 376 against 226 MiB.

It costs time: every such allocation is then a fresh mapping whose pages fault in. The 27.4M GPT's step took
1.32-1.42 s with it against 0.97-1.04 s without (benchmarks/step.py, same run), so it is not the default: a run
bound by memory (benchmarks/scale.py's) asks for it, as a setting of the process like ``torch.set_num_threads``;
``FSHARD_MMAP_THRESHOLD=bytes`` in the environment applies it at ``import fshard``.
"""
from __future__ import annotations

import ctypes
import os
import sys
import warnings

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def set_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (freed blocks that large go back to the OS at
    once; glibc stops raising the threshold). Returns whether it was set (False where the C library is not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(int(nbytes))) == 1
    except (OSError, AttributeError):  # not glibc
        return False


def from_env() -> None:
    """Apply ``FSHARD_MMAP_THRESHOLD`` (bytes) if the environment sets it."""
    v = os.environ.get("FSHARD_MMAP_THRESHOLD")
    if not v:
        return
    try:
        nbytes = int(v)
    except ValueError:  # (at import: a bad value must not break ``import fshard``)
        warnings.warn(f"FSHARD_MMAP_THRESHOLD (environment)={v!r} is not a number of bytes: ignored, the allocator is "
                      "left as it is; set it to e.g. 1048576, or unset it.", RuntimeWarning, stacklevel=2)
        return
    if nbytes > 0:
        set_mmap_threshold(nbytes)
