"""Where tests/test_cuda.py::test_offload_frees_the_moments_from_gpu_memory's bytes are (issue #43, session 50:
with the moments offloaded the GPU held 270.2 MB before a step against 341.6 MB with them there, 71 MB less where
the moments are 134.7 MB, in one run of two). The test's model and steps, in a process of their own, with torch's allocation history on: the live blocks at the
point the test reads ``memory_allocated``, grouped by the innermost fshard (or test) frame that allocated them.

    python3 benchmarks/gpu/memory43.py        (on a GPU machine, from the repository root, PYTHONPATH with examples/)
"""
from __future__ import annotations

import collections
import gc
import sys

import torch

import fshard as fs
from gpt import GPT, GPTConfig, loss_fn, synthetic_batches

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # (tests/test_cuda.py's)


def where(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "/fshard/" in name or "memory43" in name or "/examples/" in name:
            return f"{name.split('/fshard/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(torch)"


def main() -> int:
    cfg = GPTConfig(vocab=4096, dim=512, n_layers=4, n_heads=8, seq=64)
    mesh = fs.Mesh.local("cuda")
    for k in ("gpu", "host"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(max_entries=200000)  # (before init: the state's blocks named too)
        torch.manual_seed(0)
        state = fs.init(GPT(cfg), mesh, fs.adamw(**HP))
        moments = sum(2 * s.exp_avg.nbytes for s in state.opt_state.values())
        ts = (fs.offload_state(fs.CPUStore()),) if k == "host" else ()
        with fs.compose(loss_fn, *ts) as step:
            for b in synthetic_batches(cfg, 2, 3, seed=0):
                state, _ = step(state, tuple(t.cuda() for t in b))
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            by = collections.Counter()
            for seg in snap["segments"]:
                for blk in seg["blocks"]:
                    if blk["state"] == "active_allocated":
                        by[where(blk.get("frames", []))] += blk["size"]
            print(f"[memory43] {k}: allocated {base / 1e6:.1f} MB (moments {moments / 1e6:.1f} MB); "
                  f"params {sum(p.nbytes for p in state.params.values()) / 1e6:.1f} MB", flush=True)
            for site, n in by.most_common(12):
                print(f"[memory43]   {n / 1e6:8.1f} MB  {site}", flush=True)
        del state
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
