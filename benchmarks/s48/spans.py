"""Rank 0's timeline spans at the start and the end of a step (issue #42, session 48): what runs before forward's
compute can begin (the first gathers: their launches into fresh buffers, then their data) and what is left after
backward's compute (the last buckets' reduces). Two ranks, gather_ahead(2) + bucket_reduce(25), donate=True, the
spans of ``fs.compose(..., timeline=True)`` of step ``STEPS`` (default 5), those that begin in the first ``HEAD``
seconds (0.45) or end in the last ``TAIL`` (0.6).

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s48/spans.py --model 117m
    UNITS=head flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s48/spans.py --model 117m

``UNITS=head`` makes the output layer a unit of its own, ``UNITS=halves`` each block's attention and MLP (step.py's
``units_of``). The rest of the arguments are step.py's (the model, the batch)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/ (step)
sys.path.insert(0, HERE)  # metrics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import step as stepbench  # noqa: E402
from gpt import synthetic_batches  # noqa: E402
from metrics import rank_setup  # noqa: E402  (benchmarks/s48/metrics.py)


UNITS = {"": {}, "head": dict(head=True), "halves": dict(parts=("attn", "mlp"))}


def main(rank, port, argv):
    args, cfg = rank_setup(rank, port, argv)
    n, head, tail = int(os.environ.get("STEPS", "5")), float(os.environ.get("HEAD", "0.45")), \
        float(os.environ.get("TAIL", "0.6"))
    batches = list(synthetic_batches(cfg, args.batch_size, n, args.seed, rank, 2))
    ctx = stepbench.Ctx(args, cfg, rank, 2)
    r = stepbench.fshard_runner(ctx, *stepbench._ahead_buckets(), donate=True, timeline=True,
                                init_kwargs=stepbench.units_of(ctx, **UNITS[os.environ.get("UNITS", "")]))
    for i in range(n):
        _, m = r.step(batches[i])
    if rank == 0:
        print(f"step {n}: {m['time/step'] * 1e3:.1f} ms; spans (lane, label, start ms, end ms):")
        for lane, label, a, b in sorted(m["trace/timeline"], key=lambda s: s[2]):
            if a < head or b > m["time/step"] - tail:
                print(f"  {lane:8s} {label:24s} {a * 1e3:8.1f} {b * 1e3:8.1f}")
    r.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(stepbench._free_port(), sys.argv[1:]), nprocs=2)
