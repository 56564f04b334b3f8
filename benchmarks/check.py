"""The cost of one cross-rank check (fshard/dist/_agreement.py) against a bare gloo all-reduce of the same 3 numbers.

    flock /tmp/fshard-bench.lock .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/check.py

Each figure is the mean over ``--n`` back-to-back calls on every rank (rank 0 prints); the ranks start together
(a barrier). benchmarks/RESULTS.md, issue #24.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args()
    torch.set_num_threads(1)
    import fshard as fs
    from fshard.dist._collectives import Comm

    mesh = fs.Mesh.from_env()
    buf = torch.zeros(3, dtype=torch.float64)
    comm = Comm(mesh, verify=True)
    for name, fn in (("bare gloo all-reduce of 3 float64", lambda: dist.all_reduce(buf)),
                     ("fshard check (Comm._check)", lambda: comm._check(("all_gather", "x", "float32", 10)))):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.n):
            fn()
        us = (time.perf_counter() - t0) / args.n * 1e6
        if mesh.rank == 0:
            print(f"{name}: {us:.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
