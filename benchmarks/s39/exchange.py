"""gloo's ways to reduce a two-rank step's gradient, each alone: the GPT's gradient (N floats, 27.4M by default;
N=117700000 for the 117M GPT) in 25 MiB buckets, every bucket's transfers in flight together, then waited for in
order. Prints rank 0's median wall and CPU time (all threads of the process) over 5 runs.

- ``all-reduce of each bucket``: what Comm.reduce_each issued at two ranks before session 39 (the sum lands in
  both sections);
- ``exchange by all-to-all``: what it issues now: one all_to_all_single a bucket (the other's section out, the
  other's part of this rank's section into a buffer of its size), then an add;
- ``exchange by isend/irecv``: the same bytes; gloo's send and receive works say they are complete only once
  waited for, so a bucket policy that lands what is done without blocking would land nothing before the end;
- ``reduce to each owner``: one ``reduce`` a section (Comm.reduce_each at three ranks and more);
- ``reduce_scatter_tensor``.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s39/exchange.py
    N=117700000 flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s39/exchange.py
"""
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = int(os.environ.get("N", 27_400_000))
B = 25 * 2**20 // 4


def cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def run(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    full = torch.randn(N)
    buckets = [full[i:i + B] for i in range(0, N, B)]
    got = [torch.empty(b.numel() // 2) for b in buckets]  # (allocated once: the transports, not the allocator)

    def halves(b):
        h = b.numel() // 2
        return b[rank * h:(rank + 1) * h], b[peer * h:(peer + 1) * h]

    def all_reduce():
        for w in [dist.all_reduce(b, async_op=True) for b in buckets]:
            w.wait()

    def exchange_a2a():
        flights = []
        for b, g in zip(buckets, got):
            mine, theirs = halves(b)
            split = [0, 0]
            split[peer] = mine.numel()
            flights.append((dist.all_to_all_single(g, theirs, split, split, async_op=True), mine, g))
        for w, mine, g in flights:
            w.wait()
            mine.add_(g)

    def exchange_p2p():
        flights = []
        for b, g in zip(buckets, got):
            mine, theirs = halves(b)
            flights.append(([dist.isend(theirs, peer), dist.irecv(g, peer)], mine, g))
        for ws, mine, g in flights:
            for w in ws:
                w.wait()
            mine.add_(g)

    def reduce_each():
        ws = []
        for b in buckets:
            h = b.numel() // 2
            ws += [dist.reduce(b[r * h:(r + 1) * h], dst=r, async_op=True) for r in range(2)]
        for w in ws:
            w.wait()

    def reduce_scatter():
        ws = [dist.reduce_scatter_tensor(torch.empty(b.numel() // 2), b[:b.numel() // 2 * 2], async_op=True)
              for b in buckets]
        for w in ws:
            w.wait()

    for name, f in [("all-reduce of each bucket", all_reduce), ("exchange by all-to-all", exchange_a2a),
                    ("exchange by isend/irecv", exchange_p2p), ("reduce to each owner", reduce_each),
                    ("reduce_scatter_tensor", reduce_scatter)]:
        f()
        dist.barrier()
        ts, cs = [], []
        for _ in range(5):
            c0, t0 = cpu(), time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
            cs.append(cpu() - c0)
            dist.barrier()
        if rank == 0:
            print(f"{name:28s} wall {statistics.median(ts) * 1e3:7.1f} ms  cpu {statistics.median(cs) * 1e3:7.1f} ms",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print(f"N = {N:,} floats in {-(-N // B)} buckets of 25 MiB, two ranks (gloo), 1 thread a rank", flush=True)
    mp.spawn(run, args=(29000 + os.getpid() % 1000,), nprocs=2)
