"""Each rank's own step metrics, step by step, and the fresh pages the whole machine faulted in over each step (issue
#42, session 48): where a two-rank step waits (``time/gather_exposed``, ``time/reduce_exposed``) and how much new
memory it maps (``/proc/vmstat``'s ``thp_fault_alloc``: huge pages, 2 MiB each; ``pgfault``: every fault, 4 KiB ones
included; both ranks' and anything else running, so run it alone).

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s48/metrics.py --model 117m \\
        --configs fshard+ahead+buckets+donate
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s48/metrics.py --model 117m --configs ddp  # faults only

``STEPS`` steps (default 6), the first two not printed; one config; the rest of the arguments are step.py's."""
import os
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

KEYS = ["time/step", "time/check", "time/gather", "time/gather_exposed", "time/reduce", "time/reduce_exposed",
        "time/compute", "time/update", "time/control"]


def _vmstat() -> tuple[int, int]:
    with open("/proc/vmstat") as f:
        d = dict(line.split() for line in f)
    return int(d.get("thp_fault_alloc", 0)), int(d["pgfault"])


def rank_setup(rank: int, port: int, argv: list):
    """One of two ranks on this machine (gloo, one thread), and step.py's arguments and model config."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    args = stepbench.parse_args(argv)
    return args, stepbench._model_config(args)


def main(rank, port, argv):
    args, cfg = rank_setup(rank, port, argv)
    n = int(os.environ.get("STEPS", "6"))
    batches = list(synthetic_batches(cfg, args.batch_size, n, args.seed, rank, 2))
    r = stepbench._builder(args.configs)(stepbench.Ctx(args, cfg, rank, 2))
    rows = []
    for i in range(n):
        dist.barrier()
        v0, t = _vmstat(), time.perf_counter()
        _, m = r.step(batches[i])
        wall = time.perf_counter() - t
        dist.barrier()
        v1 = _vmstat()
        rows.append((wall, v1[0] - v0[0], v1[1] - v0[1], [m.get(k, float("nan")) for k in KEYS]))
    for who in range(2):
        if rank == who:
            print(f"[{args.configs} rank {rank}] wall s | huge pages | faults | " + " | ".join(k[5:] for k in KEYS))
            for wall, thp, pgf, v in rows[2:]:
                print(f"  {wall:.3f} | {thp} | {pgf} | " + " | ".join(f"{x:.3f}" for x in v))
        dist.barrier()
    r.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(stepbench._free_port(), sys.argv[1:]), nprocs=2)
