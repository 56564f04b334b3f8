"""Where a parameter-offload step's time goes (issue #22): the scale GPT (benchmarks/scale.py's, dim 2048) of L
layers at world size 2, parameters and moments in an NVMeStore (``offload_state(params=True)``), ``STEPS`` steps on
one batch with ``fs.compose(..., timeline=True)``; rank 0 prints each step's seconds, loss, store traffic and the
seconds of each timeline lane, step.plan's prediction against the steps' peak RSS, and the last step's timeline is
drawn (``fs.timeline``). Environment: L (layers, 8), STEPS (3), DEPTH (gather_ahead, 2), REDUCE ("unit":
bucket_reduce(per_unit=True); "blocking"), OVERLAP (1/0: offload_state's overlap_backward; unset: the store's
default), STORE ("nvme" or "cpu"), MMAP (fs.set_mmap_threshold bytes, 1048576; 0: glibc's), PNG, WORK.

    flock /tmp/fshard-bench.lock .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/params_timeline.py
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402
from _memory import reset_peak, status  # noqa: E402
from gpt import GPT, GPTConfig, init_weights, loss_fn, synthetic_batches  # noqa: E402

GIB = 1 << 30


def main() -> None:
    env = os.environ.get
    layers, steps, depth = int(env("L", 8)), int(env("STEPS", 3)), int(env("DEPTH", 2))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=8192, dim=2048, n_layers=layers, n_heads=16, seq=64)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if int(env("MMAP", 1 << 20)):
        fs.set_mmap_threshold(int(env("MMAP", 1 << 20)))
    batches = list(synthetic_batches(cfg, 1, 1, seed=0, rank=rank, world_size=n)) * steps
    work = Path(env("WORK") or tempfile.mkdtemp(prefix="fshard-timeline-", dir="/var/tmp")) / f"store{rank}"
    store = fs.NVMeStore(str(work)) if env("STORE", "nvme") == "nvme" else fs.CPUStore()
    overlap = env("OVERLAP")
    off = fs.offload_state(store, params=True, overlap_backward=None if overlap is None else overlap == "1")
    reduce = (fs.bucket_reduce(per_unit=True),) if env("REDUCE", "unit") == "unit" else ()
    state = fs.init(GPT(cfg, device="meta"), fs.Mesh.from_env(), fs.adamw(lr=1e-5, weight_decay=0.1),
                    init_fn=init_weights, seed=0, offload=off)
    step = fs.compose(loss_fn, fs.gather_ahead(depth), *reduce, fs.mixed_precision(), off, donate=True,
                      timeline=True)
    plan = step.plan(state, batches[0])
    reset_peak()
    for i, b in enumerate(batches):
        t = time.perf_counter()
        state, m = step(state, b)
        dt = time.perf_counter() - t
        lanes: dict = {}
        for lane, _, a, z in m["trace/timeline"]:
            lanes[lane] = lanes.get(lane, 0.0) + (z - a)
        if rank == 0:
            io = (m.get("io/read_bytes", 0) + m.get("io/write_bytes", 0)) / 1e9
            print(f"step {i}: {dt:.2f} s, loss {m['loss']:.3f}, store {io:.2f} GB, io_wait {m['time/io_wait']:.2f} s, "
                  f"reduce exposed {m['time/reduce_exposed']:.2f} s; lane seconds "
                  f"{ {k: round(v, 2) for k, v in sorted(lanes.items())} }", flush=True)
    if rank == 0:
        peak = status("VmHWM:")
        print(f"steps' peak RSS {peak / GIB:.3f} GiB; step.plan before the first step {plan.predicted_rss / GIB:.3f} "
              f"GiB ({100 * (plan.predicted_rss - peak) / peak:+.1f}%)", flush=True)
    fs.timeline(m, env("PNG", "params_timeline.png"), mesh=state.spec.mesh)
    step.close()
    del state
    store.close()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
