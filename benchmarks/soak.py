"""Soak: a long run at world size 2 must not leak memory, file descriptors, threads or store files (issue #24).

A small GPT trains for ``--steps`` steps (default 1000) with gather_ahead(2), bucket_reduce and offload_state on an
NVMe store (moments streamed every step, old versions deleted once no state refers to them), the usual
``state, metrics = step(state, batch)`` loop. Every ``--every`` steps each rank samples its RSS, open file
descriptors (/proc/self/fd), threads (/proc/self/task) and the files in its store directory; at the end rank 0
prints the samples and the drift from step ``--from-step`` to the last: RSS in %, the others as counts. The soak
passes when RSS drifts by less than 1% and fds, threads and store files by zero (exit code 1 otherwise). Not part
of the test suite (a few minutes); run it under the benchmark lock::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/soak.py
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/soak.py --steps 200 --every 20 --from-step 40   # quick
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _sample(step: int, store_dir: Path, loss: float) -> dict:
    gc.collect()  # the finalizers that hand old store versions over for deletion run here as they would anyway
    return {"step": step, "rss": _rss(), "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")), "python_threads": threading.active_count(),
            "store_files": sum(1 for p in store_dir.rglob("*") if p.is_file()), "loss": loss}


def _rank(rank: int, world: int, port: int, args, root: str, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches

    mesh = fs.Mesh.from_env()
    cfg = GPTConfig.tiny(dim=args.dim, n_layers=args.layers, seq=32)
    torch.manual_seed(0)
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1))
    store_dir = Path(root) / f"rank{rank}"
    store = fs.NVMeStore(store_dir)
    samples = []
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(1), fs.offload_state(store, chunk_mb=0.25),
                    donate=args.donate) as step:
        batches = synthetic_batches(cfg, args.batch_size, args.steps, seed=0, rank=rank, world_size=world)
        for i, batch in enumerate(batches, start=1):
            state, metrics = step(state, batch)
            if i % args.every == 0 or i == 1:
                samples.append(_sample(i, store_dir, float(metrics["loss"])))
    del state
    store.close()
    out.put((rank, samples))
    import torch.distributed as dist
    dist.destroy_process_group()


def _drift(samples: list[dict], since: int) -> dict:
    first = next(s for s in samples if s["step"] >= since)
    last = samples[-1]
    return {"from": first["step"], "to": last["step"],
            "rss_pct": 100.0 * (last["rss"] - first["rss"]) / first["rss"],
            **{k: last[k] - first[k] for k in ("fds", "threads", "store_files")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="sample every this many steps")
    p.add_argument("--from-step", type=int, default=100, help="drift is measured from the first sample at or after")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--donate", action="store_true", help="compose with donate=True (update in place)")
    args = p.parse_args()

    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fshard-soak-") as root:
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args, root, out))
                 for r in range(args.world_size)]
        for pr in procs:
            pr.start()
        results = dict(out.get(timeout=3600) for _ in procs)
        for pr in procs:
            pr.join(timeout=60)
    print(f"soak: {args.steps} steps, world size {args.world_size}, GPT tiny dim {args.dim} x {args.layers} layers, "
          f"gather_ahead(2) + bucket_reduce(1) + offload_state(NVMeStore), donate={args.donate}")
    ok = True
    for rank in sorted(results):
        samples = results[rank]
        print(f"\nrank {rank}: {'step':>6} {'RSS MiB':>9} {'fds':>5} {'threads':>8} {'py thr':>7} {'files':>6} {'loss':>8}")
        for s in samples:
            print(f"        {s['step']:>6} {s['rss'] / 2**20:>9.1f} {s['fds']:>5} {s['threads']:>8} "
                  f"{s['python_threads']:>7} {s['store_files']:>6} {s['loss']:>8.4f}")
        d = _drift(samples, args.from_step)
        passed = abs(d["rss_pct"]) < 1.0 and d["fds"] == 0 and d["threads"] == 0 and d["store_files"] == 0
        ok &= passed
        print(f"rank {rank} drift from step {d['from']} to {d['to']}: RSS {d['rss_pct']:+.2f}%, fds {d['fds']:+d}, "
              f"threads {d['threads']:+d}, store files {d['store_files']:+d} -> {'PASS' if passed else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
