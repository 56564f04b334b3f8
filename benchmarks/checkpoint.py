"""Checkpoints: a step while fs.save(..., blocking=False) runs against a step without, and the peak RSS of saving and
loading a state whose moments are in an NVMeStore, against training's.

Run (2 ranks over gloo on this machine, serialized with other benchmarks):
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/checkpoint.py --world-size 2

Async: the example GPT (``--layers`` blocks of dim 512; 6 by default: 27.4M parameters, a 329 MB checkpoint with
the moments) with gather_ahead, bucket_reduce, clipping and bf16, batch 8 per rank, ``--threads`` torch threads per
rank. Each round runs ``--steps`` steps without a save, then starts an async save and runs steps until it is done
on every rank (an all-reduce of a flag after each step), then a blocking save. Step times are medians over all
rounds (rank 0's; every step synchronizes the ranks), steps during a save only while it ran. The peer is the same
step without a save, in the same processes.

Memory: one unit of 4096 x 4096 (16.8M parameters, 134 MB of moments) trained 2 steps with the moments in an
NVMeStore (4 MiB chunks); VmHWM (peak RSS) reset before training, before the save and before the load.
``--offload``: the async part with the moments in an NVMeStore too (the save reads them under
store.session_lock, taking turns with the step's streamed update).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]


def _async(rounds: int, steps: int, layers: int, threads: int, directory: str, offload: bool):
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches

    torch.set_num_threads(threads)
    mesh = fs.Mesh.from_env()
    cfg = GPTConfig(n_layers=layers)
    torch.manual_seed(0)
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=1e-4))
    batches = synthetic_batches(cfg, 8, 10_000, rank=mesh.rank, world_size=mesh.world_size)
    plain, during, async_s, blocking_s, steps_per_save = [], [], [], [], []
    extra = [fs.offload_state(fs.NVMeStore(os.path.join(directory, f"store{mesh.rank}")))] if offload else []
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(25), fs.clip_by_global_norm(1.0),
                    fs.mixed_precision(torch.bfloat16), *extra) as step:
        for _ in range(3):
            state, _ = step(state, next(batches))
        for r in range(rounds):
            for _ in range(steps):
                t0 = time.perf_counter()
                state, _ = step(state, next(batches))
                plain.append(time.perf_counter() - t0)
            path = os.path.join(directory, f"async{r % 2}")
            t_save = time.perf_counter()
            handle = fs.save(path, state, blocking=False)
            n, running = 0, True
            while running:  # until the save is done on every rank (the ranks must run the same steps)
                t0 = time.perf_counter()
                state, _ = step(state, next(batches))
                during.append(time.perf_counter() - t0)
                n += 1
                flag = torch.tensor([0.0 if handle.done() else 1.0])
                torch.distributed.all_reduce(flag)
                running = bool(flag.item())
            handle.wait()
            async_s.append(time.perf_counter() - t_save)
            steps_per_save.append(n)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fs.save(os.path.join(directory, "blocking"), state)
            blocking_s.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in Path(directory, "blocking").iterdir())
    return {"params": sum(p.numel() for p in GPT(cfg).parameters()), "bytes": size,
            "plain": statistics.median(plain), "during": statistics.median(during),
            "async_s": statistics.median(async_s), "blocking_s": statistics.median(blocking_s),
            "steps_per_save": statistics.median(steps_per_save), "n_plain": len(plain), "n_during": len(during)}


def _memory(directory: str):
    import fshard as fs
    from _memory import reset_peak as _reset_peak, status as _status

    torch.set_num_threads(1)
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 8))
    state = fs.init(model, mesh, fs.adamw(lr=1e-3), units=["0", "1"])
    off = fs.offload_state(fs.NVMeStore(os.path.join(directory, f"store{mesh.rank}")), chunk_mb=4)
    x, y = torch.randn(4, 4096), torch.randn(4, 8)
    out = {}
    with fs.compose(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), off) as step:
        out["before training"] = _reset_peak()
        for _ in range(2):
            state, _ = step(state, (x, y))
        out["training peak"] = _status("VmHWM:")
        out["before save"] = _reset_peak()
        t0 = time.perf_counter()
        fs.save(os.path.join(directory, "offloaded"), state)
        out["save s"] = time.perf_counter() - t0
        out["save peak"] = _status("VmHWM:")
        out["before load"] = _reset_peak()
        t0 = time.perf_counter()
        loaded = fs.load(os.path.join(directory, "offloaded"), like=state)
        out["load s"] = time.perf_counter() - t0
        out["load peak"] = _status("VmHWM:")
        del loaded
    out["moments"] = sum(2 * s.exp_avg.nbytes for s in state.opt_state.values())
    out["params"] = sum(p.nbytes for p in state.params.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--offload", action="store_true", help="the async part with offload_state(NVMeStore) too")
    args = ap.parse_args()
    from _dist import run_ranks
    n = args.world_size
    with tempfile.TemporaryDirectory(prefix="fshard-ckpt-bench-") as d:
        a = run_ranks(_async, n, args.rounds, args.steps, args.layers, args.threads, d, args.offload,
                      timeout_s=1800)[0]
    print(f"world size {n}, {os.cpu_count()} cores, {args.threads} torch thread(s) per rank, GPT {args.layers} layers "
          f"({a['params'] / 1e6:.1f}M parameters, a {a['bytes'] / 1e6:.0f} MB checkpoint), "
          f"{'moments in an NVMeStore, ' if args.offload else ''}"
          f"{args.rounds} rounds")
    print(f"  step without a save       {a['plain'] * 1e3:8.1f} ms  (median of {a['n_plain']})")
    print(f"  step while a save runs    {a['during'] * 1e3:8.1f} ms  (median of {a['n_during']})  "
          f"{a['during'] / a['plain']:.3f}x")
    print(f"  async save, start to done {a['async_s']:8.2f} s   ({a['steps_per_save']:.0f} steps ran meanwhile)")
    print(f"  blocking save             {a['blocking_s']:8.2f} s")
    with tempfile.TemporaryDirectory(prefix="fshard-ckpt-mem-") as d:
        mem = run_ranks(_memory, n, d, timeout_s=900)
    mb = lambda b: f"{b / 2**20:8.1f} MiB"  # noqa: E731
    for r, m in enumerate(mem):
        print(f"  rank {r}: moments {mb(m['moments'])} (in the store), params {mb(m['params'])}")
        print(f"    training peak {mb(m['training peak'])}; save peak {mb(m['save peak'])} "
              f"(+{mb(m['save peak'] - m['before save'])} over before, {m['save s']:.2f} s); load peak "
              f"{mb(m['load peak'])} (+{mb(m['load peak'] - m['before load'])}, {m['load s']:.2f} s)")
        print(f"    bound: training peak + 2 chunks + 64 MiB = {mb(m['training peak'] + (16 + 64) * 2**20)}: "
              f"save {'within' if m['save peak'] <= m['training peak'] + 80 * 2**20 else 'OVER'}, load "
              f"{'within' if m['load peak'] <= m['training peak'] + 80 * 2**20 else 'OVER'}")


if __name__ == "__main__":
    main()
