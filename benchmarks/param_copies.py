"""Persistent low-precision parameter copies (``param_copies``) or a cast per gather: both ways, measured.

``fs.mixed_precision`` gathers a unit in bf16 by casting this rank's fp32 master shard before each gather (in
forward, and again when backward re-gathers), as FSDP2 does. The alternative DeepSpeed takes keeps a bf16 copy of
each shard in the state, written by the AdamW kernel in its update pass (``fshard.ops.adamw_(param_copies=...)``),
and gathers from it with no cast. On the 117M GPT of the step-memory issue (world size 2, gloo, 1 thread per rank,
ahead + buckets + bf16 + donate, the benchmark's fastest bf16 config) this measures, in one run:

- the cast way: the step's time, and the time its casts take (the "cast" lane of the step's timeline);
- the copy way's extra work: the AdamW kernel over this rank's shards with and without writing bf16 copies (the
  same sizes, one thread), and the bytes the copies would hold;

so the copy way's step is the cast way's minus its casts plus the kernel's extra write. Run it under the lock::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/param_copies.py
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, GPTConfig, init_weights, loss_fn, synthetic_batches  # noqa: E402


def _kernel_ms(state, copies: bool, repeats: int) -> float:
    """The native AdamW over every trainable shard of this rank (fresh gradients), optionally writing bf16 copies."""
    import fshard.ops as ops
    runs = []
    for name, s in state.opt_state.items():
        if s is None:
            continue
        n = s.exp_avg.numel()
        p, m, v = state.params[name][:n].clone(), s.exp_avg.clone(), s.exp_avg_sq.clone()
        runs.append((p, torch.randn(n), m, v, torch.empty(n, dtype=torch.bfloat16) if copies else None))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for p, g, m, v, c in runs:
            ops.adamw_(p, g, m, v, step=1, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                       param_copies=c, check_finite=False)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import fshard as fs
    cfg = GPTConfig(dim=1024, n_layers=8, n_heads=16)
    mesh = fs.Mesh.from_env()
    state = fs.init(GPT(cfg, device="meta"), mesh, fs.adamw(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1),
                    init_fn=init_weights, seed=0)
    step = fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(25), fs.mixed_precision(torch.bfloat16),
                      donate=True, timeline=True)
    batches = list(synthetic_batches(cfg, 4, args.warmup + args.steps, 0, rank, world))
    step_s, cast_s = [], []
    for i, b in enumerate(batches):
        state, m = step(state, b)
        if i >= args.warmup:
            spans = m["trace/timeline"]
            step_s.append(m["time/step"])
            cast_s.append(sum(t1 - t0 for lane, _, t0, t1 in spans if lane == "cast"))
    copy_bytes = sum(u.shard_numel * 2 for u in state.spec.units)
    k_plain, k_copy = _kernel_ms(state, False, args.repeats), _kernel_ms(state, True, args.repeats)
    row = torch.tensor([statistics.median(step_s) * 1e3, statistics.median(cast_s) * 1e3, k_plain, k_copy,
                        copy_bytes], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    step.close()
    if rank == 0:
        worst = torch.stack(rows).max(0).values.tolist()
        step_ms, cast_ms, plain_ms, copy_ms, nbytes = worst
        extra = copy_ms - plain_ms
        print(f"117M GPT, world size {world}, ahead+buckets+bf16+donate, {args.steps} timed steps (max over ranks "
              f"of each rank's median)")
        print(f"  cast way : step {step_ms:8.1f} ms, of which casts {cast_ms:6.1f} ms ({cast_ms / step_ms:.1%})")
        print(f"  kernel   : {plain_ms:6.1f} ms without copies, {copy_ms:6.1f} ms writing bf16 copies "
              f"(+{extra:.1f} ms)")
        print(f"  copy way : step ~{step_ms - cast_ms + extra:8.1f} ms ({(step_ms - cast_ms + extra) / step_ms:.3f}x "
              f"the cast way), holding {nbytes / 2**20:.0f} MiB more per rank (the bf16 copies)")
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5, help="kernel timings per way (the median is quoted)")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
