"""Which torch.distributed call gathers (and reduce-scatters) fastest on this backend? Measured, not guessed.

fshard's gather_ahead and bucket_reduce pick one implementation per backend (fshard/dist/_collectives.py); this script
is the evidence (design/COLLECTIVES.md). It runs every option in the same processes, interleaved round-robin, and
prints the median time and the ratio to the plain ``*_single`` call::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/collectives.py                 # ws 2, 4..64 MiB
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/collectives.py --world-size 3 --mib 16

Gather options (every rank holds a shard of n/N elements; all end with the full n-element buffer):
  all_gather_single     dist.all_gather_into_tensor (what FSDP2 and fshard's blocking gather use)
  all_gather_list       dist.all_gather into N views of the output
  all_reduce_padded     output filled with -0.0, own shard copied in, dist.all_reduce(SUM). Exact: x + (-0.0) == x
                        for every float x, including +0.0 and -0.0, so the sum of one value and N-1 negative zeros
                        is that value bit for bit, in any summation order.
  broadcast_each        N dist.broadcast calls, one per source rank, into views of the output
Reduce-scatter options (every rank holds a full n-element gradient; each ends with its n/N slice of the sum):
  reduce_scatter_single dist.reduce_scatter_tensor
  reduce_scatter_list   dist.reduce_scatter from N views
  all_reduce_slice      dist.all_reduce of the whole buffer, keep the own slice
  reduce_each           N dist.reduce calls, one per destination rank

``--overlap`` also measures each async option while the rank computes (matmuls on its one thread): how much the
collective slows compute down and how much of it stays exposed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _gather_ops(n, ws, rank, dtype):
    shard = torch.randn(n // ws, dtype=dtype)
    out = torch.empty(n, dtype=dtype)
    views = list(out.chunk(ws))
    neg0 = torch.tensor(-0.0, dtype=dtype)

    def padded(async_op=False):
        out.fill_(neg0)
        views[rank].copy_(shard)
        return dist.all_reduce(out, async_op=async_op)

    def bcast(async_op=False):
        views[rank].copy_(shard)
        works = [dist.broadcast(views[r], src=r, async_op=async_op) for r in range(ws)]
        return _All(works) if async_op else None

    ops = {
        "all_gather_single": lambda async_op=False: dist.all_gather_into_tensor(out, shard, async_op=async_op),
        "all_gather_list": lambda async_op=False: dist.all_gather(views, shard, async_op=async_op),
        "all_reduce_padded": padded,
        "broadcast_each": bcast,
    }

    def check(name):
        ops[name]()
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, shard)
        return torch.equal(out.view(torch.int32 if dtype == torch.float32 else torch.int16),
                           ref.view(torch.int32 if dtype == torch.float32 else torch.int16))
    return ops, check


def _reduce_ops(n, ws, rank, dtype):
    full = torch.randn(n, dtype=dtype)
    work = torch.empty_like(full)
    out = torch.empty(n // ws, dtype=dtype)

    def ar_slice(async_op=False):
        work.copy_(full)
        w = dist.all_reduce(work, async_op=async_op)
        if not async_op:
            out.copy_(work.chunk(ws)[rank])
        return w

    def reduce_each(async_op=False):
        work.copy_(full)
        works = [dist.reduce(c, dst=r, async_op=async_op) for r, c in enumerate(work.chunk(ws))]
        return _All(works) if async_op else None

    ops = {
        "reduce_scatter_single": lambda async_op=False: dist.reduce_scatter_tensor(out, full, async_op=async_op),
        "reduce_scatter_list": lambda async_op=False: dist.reduce_scatter(out, list(full.chunk(ws)),
                                                                          async_op=async_op),
        "all_reduce_slice": ar_slice,
        "reduce_each": reduce_each,
    }
    return ops, None


class _All:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def _compute(seconds_hint: int):
    a = torch.randn(512, 512)
    b = torch.randn(512, 512)

    def run(k):
        for _ in range(k):
            a.mm(b)
    return run


def worker(rank, ws, port, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    dtype = getattr(torch, args.dtype)
    results = {}
    try:
        for mib in args.mib:
            n = (mib * 2**20 // dtype.itemsize) // (ws * 64) * (ws * 64)
            for kind, make in (("gather", _gather_ops), ("reduce_scatter", _reduce_ops)):
                ops, check = make(n, ws, rank, dtype)
                if check is not None:
                    for name in ops:
                        assert check(name), f"{name} is not an exact gather"
                times = {name: [] for name in ops}
                for _ in range(args.warmup):
                    for f in ops.values():
                        f()
                for _ in range(args.reps):
                    for name, f in ops.items():
                        dist.barrier()
                        t0 = time.perf_counter()
                        f()
                        times[name].append(time.perf_counter() - t0)
                results[(kind, mib, "blocking")] = {k: statistics.median(v) for k, v in times.items()}
                if args.overlap:
                    comp = _compute(0)
                    t0 = time.perf_counter()
                    comp(args.compute_iters)
                    alone = time.perf_counter() - t0
                    ov = {}
                    for name, f in ops.items():
                        sl, ex = [], []
                        for _ in range(args.reps):
                            dist.barrier()
                            t0 = time.perf_counter()
                            w = f(async_op=True)
                            comp(args.compute_iters)
                            t1 = time.perf_counter()
                            w.wait()
                            t2 = time.perf_counter()
                            sl.append(t1 - t0)
                            ex.append(t2 - t1)
                        ov[name] = (statistics.median(sl), statistics.median(ex))
                    results[(kind, mib, "overlap")] = {"compute_alone": alone, **ov}
    finally:
        dist.destroy_process_group()
    q.put((rank, results))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mib", type=int, nargs="+", default=[4, 16, 64], help="full buffer sizes, MiB")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--compute-iters", type=int, default=60, help="512x512 matmuls run while an async op flies")
    args = p.parse_args()
    from _dist import _free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world_size, port, args, q)) for r in range(args.world_size)]
    for pr in procs:
        pr.start()
    res = dict(q.get() for _ in procs)
    for pr in procs:
        pr.join()
    print(f"# gloo, world size {args.world_size}, {args.dtype}, 1 thread per rank, median of {args.reps}; "
          f"torch {torch.__version__}")
    for key in res[0]:
        kind, mib, mode = key
        if mode == "blocking":
            # slowest rank per op
            t = {name: max(res[r][key][name] for r in res) for name in res[0][key]}
            base = t["all_gather_single" if kind == "gather" else "reduce_scatter_single"]
            print(f"\n{kind} {mib} MiB (full buffer), blocking:")
            for name, s in t.items():
                print(f"  {name:24s} {s * 1e3:8.2f} ms  {mib * 2**20 / s / 1e9:6.2f} GB/s (full buffer)  "
                      f"x{s / base:5.2f} of the *_single call")
        else:
            alone = max(res[r][key]["compute_alone"] for r in res)
            print(f"  overlap: compute alone {alone * 1e3:.1f} ms; with the op in flight (compute ms / exposed ms):")
            for name in res[0][key]:
                if name == "compute_alone":
                    continue
                sl = max(res[r][key][name][0] for r in res)
                ex = max(res[r][key][name][1] for r in res)
                print(f"    {name:24s} {sl * 1e3:8.1f} / {ex * 1e3:7.1f}")


if __name__ == "__main__":
    main()
