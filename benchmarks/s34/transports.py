"""gloo's transports for one step's bytes of the 27.4M GPT at two ranks, each alone: DDP's all-reduce of the
gradient in 25 MiB buckets; one gather of the model by broadcasts (7 units, one broadcast per source rank, as
fshard's gloo gathers); the buckets reduced to each section's owner; reduce_scatter_tensor. Prints rank 0's median
wall and CPU time (all threads) over 5 runs.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s34/transports.py
"""
import os, sys, time, resource, torch, torch.distributed as dist, torch.multiprocessing as mp
N = 27_400_000
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF); return u.ru_utime + u.ru_stime
def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    B = 25 * 2**20 // 4
    full = torch.randn(N); shard = torch.randn(N // 2); out = torch.empty(N)
    def ar():
        ws = [dist.all_reduce(full[i:i + B], async_op=True) for i in range(0, N, B)]
        [w.wait() for w in ws]
    U = N // 7  # 7 units
    def bcast_gather():
        ws = []
        for u in range(7):
            buf = out[u * U:(u + 1) * U]
            for r in range(2):
                ws.append(dist.broadcast(buf[r * U // 2:(r + 1) * U // 2], src=r, async_op=True))
        [w.wait() for w in ws]
    def reduce_each():
        ws = []
        for i in range(0, N, B):
            b = full[i:i + B]; h = b.numel() // 2
            for r in range(2):
                ws.append(dist.reduce(b[r * h:(r + 1) * h], dst=r, async_op=True))
        [w.wait() for w in ws]
    def rs():
        ws = []
        for i in range(0, N, B):
            b = full[i:i + B]; h = b.numel() // 2
            ws.append(dist.reduce_scatter_tensor(torch.empty(h), b[:2 * h], async_op=True))
        [w.wait() for w in ws]
    for name, f in [("allreduce 25MB buckets", ar), ("gather by broadcasts x1", bcast_gather), ("reduce per rank (reduce_each)", reduce_each), ("reduce_scatter_tensor", rs)]:
        try:
            f(); dist.barrier()
            ts, cs = [], []
            for _ in range(5):
                c0, t0 = cpu(), time.perf_counter(); f(); t1, c1 = time.perf_counter(), cpu(); ts.append(t1 - t0); cs.append(c1 - c0)
                dist.barrier()
            ts.sort(); cs.sort()
            if rank == 0: print(f"{name:32s} wall {ts[2]*1e3:7.1f} ms  cpu {cs[2]*1e3:7.1f} ms", flush=True)
        except Exception as e:
            if rank == 0: print(name, "failed", str(e)[:100])
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(run, args=(29000 + os.getpid() % 1000,), nprocs=2)
