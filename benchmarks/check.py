"""The cost of one cross-rank check (fshard/dist/_agreement.py: an all-gather of ``[h, failed]``) against the bare
gloo collectives it could be: an all-reduce of 3 float64 (the check until session 47: ``[h, h*h, failed]``) and an
all-gather of 2.

    flock /tmp/fshard-bench.lock .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/check.py

Each figure is the median over ``--rounds`` rounds (the three alternating) of the mean over ``--n`` back-to-back
calls on every rank (rank 0 prints); the ranks start each together (a barrier). benchmarks/RESULTS.md, issues #24,
#42.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    import fshard as fs
    from fshard.dist._collectives import Comm

    mesh = fs.Mesh.from_env()
    buf = torch.zeros(3, dtype=torch.float64)
    mine, every = torch.zeros(2, dtype=torch.float64), torch.zeros(2 * mesh.world_size, dtype=torch.float64)
    comm = Comm(mesh, verify=True)
    cases = {"bare gloo all-reduce of 3 float64": lambda: dist.all_reduce(buf),
             "bare gloo all-gather of 2 float64": lambda: dist.all_gather_single(every, mine),
             "fshard check (Comm._check)": lambda: comm._check(("all_gather", "x", "float32", 10))}
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.n):
                fn()
            times[name].append((time.perf_counter() - t0) / args.n * 1e6)
    if mesh.rank == 0:
        for name, ts in times.items():
            print(f"{name}: {statistics.median(ts):.1f} us (rounds {min(ts):.1f}-{max(ts):.1f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
