"""Where tests/test_cuda.py::test_offload_frees_the_moments_from_gpu_memory's bytes are (issue #43, session 50:
with the moments offloaded the GPU held 270.2 MB before a step against 341.6 MB with them there, 71 MB less where
the moments are 134.7 MB, in one run of two). The test's own measurement (tests/test_cuda.py ``_memory``), in a
process of its own, with torch's allocation history on: at the point it reads ``memory_allocated``, the live
blocks grouped by the innermost fshard (or example) frame that allocated them.

    python3 benchmarks/gpu/memory43.py        (on a GPU machine, from the repository root, PYTHONPATH with examples/)
"""
from __future__ import annotations

import collections
import sys

import torch

sys.path.insert(0, "tests")
import fshard as fs  # noqa: E402
from test_cuda import _memory  # noqa: E402


def where(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "/fshard/" in name or "/examples/" in name or "/tests/" in name:
            return f"{name.split('/fshard/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(torch)"


def at_base(k: str) -> None:
    by = collections.Counter()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                by[where(blk.get("frames", []))] += blk["size"]
    print(f"[memory43] {k}: allocated {torch.cuda.memory_allocated() / 1e6:.1f} MB", flush=True)
    for site, n in by.most_common(12):
        print(f"[memory43]   {n / 1e6:8.1f} MB  {site}", flush=True)


def main() -> int:
    torch.cuda.memory._record_memory_history(max_entries=200000)  # (before init: the state's blocks named too)
    peaks, moments = _memory(fs.Mesh.local("cuda"), at_base)
    print(f"[memory43] moments {moments / 1e6:.1f} MB; (resident, peak) bytes {peaks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
