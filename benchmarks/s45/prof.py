"""Where one step's time goes at two ranks (issue #42, session 45): per rank, the step's wall time, the process's
CPU time over it (every thread: gloo's included), and torch.profiler's self CPU time of the ops, with the largest.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s45/prof.py --model 117m --configs ddp
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s45/prof.py --model 117m --configs fshard+ahead+buckets+donate

Three warm-up steps, then one profiled; the rest of the arguments are benchmarks/step.py's."""
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/ (step)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import step as stepbench  # noqa: E402
from gpt import synthetic_batches  # noqa: E402


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main(rank, port, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    args = stepbench.parse_args(argv)
    cfg = stepbench._model_config(args)
    batches = list(synthetic_batches(cfg, args.batch_size, 6, args.seed, rank, 2))
    r = stepbench._builder(args.configs)(stepbench.Ctx(args, cfg, rank, 2))
    for i in range(3):
        r.step(batches[i])
    dist.barrier()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        c0, t = _cpu(), time.perf_counter()
        r.step(batches[3])
        t, cpu = time.perf_counter() - t, _cpu() - c0
    dist.barrier()
    ka = prof.key_averages()
    rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:14]
    tot = sum(e.self_cpu_time_total for e in ka) / 1e6
    mm = sum(e.self_cpu_time_total for e in ka if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6
    out = [f"[{args.configs} rank {rank}] step {t:.3f} s, process CPU {cpu:.3f} s, ops' self CPU {tot:.3f} s, "
           f"mm+addmm+bmm {mm:.3f} s"]
    out += [f"   {e.key[:50]:50s} {e.self_cpu_time_total/1e6:8.3f} s  {e.count:6d} calls" for e in rows]
    for who in range(2):  # rank 0's table, then rank 1's
        if rank == who:
            print("\n".join(out), flush=True)
        dist.barrier()
    r.close()  # (the step function and its state, before the group goes)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(stepbench._free_port(), sys.argv[1:]), nprocs=2)
