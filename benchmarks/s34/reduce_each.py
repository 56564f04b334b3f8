"""Comm.reduce_each's two transports on gloo, as bucket_reduce issues them: the 27.4M GPT's gradient in 25 MiB
buckets, each bucket one tensor per rank section, every section in flight at once; a reduce to each section's owner
against an all-reduce of each section. Prints the median wall and CPU time (all threads) of rank 0 over 5 runs.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s34/reduce_each.py 2 3 4
"""
import os, sys, time, resource, torch, torch.distributed as dist, torch.multiprocessing as mp
N = 27_400_000
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF); return u.ru_utime + u.ru_stime
def run(rank, port, W):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=W)
    B = 25 * 2**20 // 4
    buckets = [[torch.randn(min(B, N - i) // W + (r == 0)) for r in range(W)] for i in range(0, N, B)]
    def by_reduce():
        ws = [dist.reduce(t, dst=r, async_op=True) for secs in buckets for r, t in enumerate(secs)]
        [w.wait() for w in ws]
    def by_allreduce():
        ws = [dist.all_reduce(t, async_op=True) for secs in buckets for r, t in enumerate(secs)]
        [w.wait() for w in ws]
    for name, f in [("reduce per section", by_reduce), ("all_reduce per section", by_allreduce)] * 2:
        f(); dist.barrier()
        ts, cs = [], []
        for _ in range(5):
            c0, t0 = cpu(), time.perf_counter(); f(); t1, c1 = time.perf_counter(), cpu(); ts.append(t1 - t0); cs.append(c1 - c0)
            dist.barrier()
        ts.sort(); cs.sort()
        if rank == 0: print(f"W={W} {name:26s} wall {ts[2]*1e3:7.1f} ms  cpu {cs[2]*1e3:7.1f} ms", flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    for W in map(int, sys.argv[1:]):
        mp.spawn(run, args=(29000 + (os.getpid() + W) % 1000, W), nprocs=W)
