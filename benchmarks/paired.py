"""Paired step timing (issue #42's small margins): benchmarks/step.py's configs built side by side in ONE set of
processes and stepped in turn, one step each, so that each step of a config has a partner step of the reference
config taken a second before it or after it, under the same machine state.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/paired.py --world-size 1 --configs torch,fshard+donate
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/paired.py --configs ddp,fshard+ahead+buckets --pairs 40
    .venv/bin/python benchmarks/paired.py --tiny --world-size 1 --configs torch,fshard --pairs 6 --warmup 1  # smoke

step.py's rounds compare medians of blocks of steps taken minutes apart: on this shared 2-core machine the blocks'
medians move by 5-20% between rounds, more than the 3% a one-rank target allows. Here the first config is the
reference; every pair is (its step, the config's step), the order within a pair alternating from pair to pair, and
the figures are over the pairs:

- ``median ratio``: the median of config / reference over the pairs, with a 95% bootstrap interval (resampling
  the pairs, seeded); ``ratio of medians``: step.py's figure, for comparison;
- ``slower in``: in how many pairs the config's step took longer, and the one-sided sign test's p of so many (or
  more) if each side were equally likely to be slower: a test that asks nothing of the noise's distribution;
- ``page faults a step``: the median of the rank with the most minor faults (pages the allocator mapped in afresh).
  All configs share one heap per rank, so a config's faults (and the CPU they cost) depend on the others in the
  process: at 117M, fshard's ranged from 79k to 138k a step with the same code (benchmarks/RESULTS.md, "Session
  42"); for a config's own figure run it alone, or use step.py's rounds (a process per config);
- ``CPU s a step (system)``: the median of the CPU seconds the ranks' processes spent in the step, every thread
  and every rank summed, and of those the system (kernel) seconds: gloo's TCP copies are system time. On a machine
  with as many cores as ranks, work that overlaps in time still takes cores from the step.

A step's time is the slowest rank's (an all-reduce of the ranks' times after each step). Every config sees the same
batches in the same order, so their losses are printed side by side. Options not listed under ``--help`` here
are step.py's (``--world-size``, ``--configs``, ``--warmup``: untimed steps per config, ``--threads``, ``--model``,
``--tiny``, ``--batch-size``, ``--json``); ``--steps``, ``--rounds``, ``--in-process`` and ``--baseline`` do not
apply (all configs live in one process per rank, so their RSS figures are not printed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as stepbench  # noqa: E402  (registers the configs; its sys.path has examples/)
from gpt import synthetic_batches  # noqa: E402


def sign_test(k: int, n: int) -> float:
    """P(at least ``k`` of ``n`` fair coin flips)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def bootstrap_median(xs: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median of ``xs`` resampled with replacement."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def worker(rank: int, world_size: int, args, pairs: int, port: int | None = None) -> None:
    if port is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    names = stepbench._config_names(args)
    cfg = stepbench._model_config(args)
    ctx = stepbench.Ctx(args, cfg, rank, world_size)
    n = args.warmup + pairs
    batches = list(synthetic_batches(cfg, args.batch_size, n, args.seed, rank, world_size))
    runners = {name: stepbench._builder(name)(ctx) for name in names}  # all alive at once
    times = {name: [] for name in names}
    losses = {name: [] for name in names}
    faults = {name: [] for name in names}  # minor page faults a step (fresh pages the allocator maps in)
    cpus = {name: [] for name in names}  # (CPU s, of which system s) a step, summed over the ranks
    for i in range(n):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            dist.barrier()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            loss, _ = runners[name].step(batches[i])
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            dt = torch.tensor([t1 - t0, r1.ru_minflt - r0.ru_minflt])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time, the most page faults
            # CPU seconds of the whole process (every thread: gloo's, whose TCP copies are system time), all ranks
            cpu = torch.tensor([r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, r1.ru_stime - r0.ru_stime],
                               dtype=torch.float64)
            dist.all_reduce(cpu)
            if i >= args.warmup:
                times[name].append(float(dt[0]))
                faults[name].append(int(dt[1]))
                cpus[name].append((float(cpu[0]), float(cpu[1])))
            if not runners[name].loss_is_global:  # a torch peer's loss is its rank's: the mean over ranks, as fshard's
                loss_t = torch.tensor([loss], dtype=torch.float64)
                dist.all_reduce(loss_t)
                loss = float(loss_t) / world_size
            losses[name].append(loss)
    for r in runners.values():
        r.close()
    if rank == 0:
        report(args, names, times, losses, faults, cpus, pairs, world_size)
    dist.destroy_process_group()


def report(args, names, times, losses, faults, cpus, pairs, world_size) -> None:
    ref = names[0]
    print(f"[paired.py] git {stepbench._git_head()}, torch {torch.__version__}, world size {world_size}, "
          f"{args.threads} thread(s) a rank, {pairs} pairs after {args.warmup} warm-up steps, model "
          f"{stepbench._model_name(args, stepbench._model_config(args))}; reference {ref}; {os.getloadavg()[0]:.2f} "
          "load (1 min) at the end", flush=True)
    print("\n| config | median s | ratio of medians | median ratio | 95% interval | slower in | p | page faults a step "
          "| CPU s a step (system) | last loss |\n|---|---|---|---|---|---|---|---|---|---|")
    result = {}
    for name in names:
        med = statistics.median(times[name])
        ratios = [a / b for a, b in zip(times[name], times[ref])]
        lo, hi = bootstrap_median(ratios)
        slower = sum(r > 1 for r in ratios)
        p = sign_test(slower, len(ratios))
        print(f"| {name} | {med:.4f} | {med / statistics.median(times[ref]):.3f}x | {statistics.median(ratios):.3f}x "
              f"| {lo:.3f}-{hi:.3f} | {slower}/{len(ratios)} | {p:.2g} | {statistics.median(faults[name]):.0f} | "
              f"{statistics.median(c for c, _ in cpus[name]):.3f} ({statistics.median(s for _, s in cpus[name]):.3f}) "
              f"| {losses[name][-1]:.6f} |", flush=True)
        result[name] = dict(median_s=med, times=times[name], ratios=ratios, median_ratio=statistics.median(ratios),
                            interval=[lo, hi], slower=slower, sign_test_p=p, losses=losses[name],
                            faults=faults[name], cpu_s=[c for c, _ in cpus[name]],
                            system_s=[s for _, s in cpus[name]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(reference=ref, pairs=pairs, world_size=world_size, configs=result), f, indent=1)


def main(argv=None) -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--pairs", type=int, default=30, help="timed steps of each config, taken in turn")
    own.add_argument("-h", "--help", action="store_true")
    mine, rest = own.parse_known_args(argv)
    if mine.help:
        print(__doc__)
        print("--pairs N: timed steps of each config, taken in turn (default 30)")
        return
    args = stepbench.parse_args(rest)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, mine.pairs)
    else:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(args.world_size, args, mine.pairs, stepbench._free_port()), nprocs=args.world_size,
                 join=True)


if __name__ == "__main__":
    main()
