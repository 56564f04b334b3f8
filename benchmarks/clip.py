"""The cost of clip_by_global_norm's norm at world size N, against what each DDP rank pays in clip_grad_norm_.

Run (N ranks on this machine over gloo, 1 thread each, serialized with other benchmarks):
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/clip.py --world-size 2

Each rank holds its shards of the example GPT's gradients (GPTConfig(), 27.4M fp32 elements in 77 parameters;
random values). Timed in turn, 9 rounds, medians (rank 0's; every path is synchronous across ranks):
  fshard, torch's bits        fshard/_clip._global_norm: each parameter's torch fp32 norm, continued from rank to
                              rank (N - 1 small all-reduces, then the norms' all-reduce)
  fshard, rounded             the same with native_available() False: float64 partial sums, one all-reduce
  fshard, one float64 sum     Grads.with_sq_norm (what skip_nonfinite uses)
  torch, whole gradients      torch.nn.utils.get_total_norm over the full gradients, as each DDP rank runs it
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]


def _rank(rounds: int):
    import fshard as fs
    import fshard.transforms._clip as clip
    from fshard.protocol._stages import Grads
    from fshard.dist._collectives import Comm
    from gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    mesh = fs.Mesh.from_env()
    model = GPT(GPTConfig())
    state = fs.init(model, mesh, fs.adamw())
    g = torch.Generator().manual_seed(mesh.rank)
    shards = {u.name: torch.randn(u.shard_numel, generator=g) for u in state.spec.units}
    grads = Grads(shards, spec=state.spec, active={u.name: [True] * len(u.trainable) for u in state.spec.units})
    full = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    comm = Comm(mesh)
    ops = clip._ops

    def rounded():
        clip._ops = lambda: SimpleNamespace(native_available=lambda: False, sq_norm=fs.ops.sq_norm)
        try:
            return clip._global_norm(comm, grads)
        finally:
            clip._ops = ops

    fns = {"fshard, torch's bits": lambda: clip._global_norm(comm, grads), "fshard, rounded": rounded,
           "fshard, one float64 sum": lambda: grads.with_sq_norm(comm).sq_norm,
           "torch, whole gradients": lambda: float(torch.nn.utils.get_total_norm(full, 2.0))}
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    from _dist import run_ranks
    res = run_ranks(_rank, args.world_size, args.rounds, timeout_s=900)[0]
    base = res["torch, whole gradients"]
    print(f"world size {args.world_size}, {os.cpu_count()} cores, median of {args.rounds} (rank 0)")
    for k, v in res.items():
        print(f"  {k:26s} {v * 1e3:8.2f} ms   {v / base:5.2f}x torch")


if __name__ == "__main__":
    main()
