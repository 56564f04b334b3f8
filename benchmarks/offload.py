"""Offloaded optimizer state: step time and RSS with the moments in memory, in a CPUStore, or on NVMe (uring, aio).

World size 1, a GPT of about 100M parameters (dim 768, 12 layers, vocab 16384, seq 128), fp32, batch 2, one
thread; every config in a fresh process, round-robin over rounds, the same weights and batches::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/offload.py --dir /var/tmp/fshard-offload
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/offload.py --tiny --steps 3     # a quick check

Per config it prints the median step time, the median update time (after backward), how many units were updated
during backward and the worker's time on them (``offload_state(overlap_backward=True)``, the default; "-after"
configs turn it off), the time the step waited on the store after backward (``time/io_wait``: I/O that neither
backward nor the update's compute hid), I/O bytes per step, and the process RSS after the steps (VmRSS, with freed
memory handed back by malloc_trim) and its peak (VmHWM).
The hidden fraction of I/O is 1 - io_wait / io_time, where io_time is the same stream of reads and write-backs
timed on its own (``--io-only`` pass: no compute), measured in the same process right after the steps.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

CONFIGS = ("none", "cpu", "nvme-uring", "nvme-aio")
# also: nvme-uring-buffered, nvme-aio-buffered (through the page cache); a "-after" suffix (nvme-uring-after, ...)
# turns overlap_backward off (every unit updated after backward, the pipeline before it existed), "-overlap"
# (cpu-overlap) turns it on; without either, offload_state's default (on for NVMe, off for CPUStore); an "@N" suffix
# (nvme-uring@0) sets offload_state(worker_nice=N), else its default


def _rss() -> tuple[int, int]:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = int(line.split()[1]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def run_config(name: str, args, out_q) -> None:
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    torch.set_num_threads(args.threads)
    cfg = GPTConfig.tiny() if args.tiny else GPTConfig(vocab=16384, dim=768, n_layers=12, n_heads=12, seq=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    store, ts = None, ()
    kind, _, nice = name.partition("@")
    if kind.startswith("cpu"):
        store = fs.CPUStore()
    elif kind.startswith("nvme"):  # nvme-uring, nvme-aio; "-buffered": through the page cache (no O_DIRECT)
        store = fs.NVMeStore(tempfile.mkdtemp(dir=args.dir), backend=kind.split("-")[1],
                             direct="-buffered" not in kind)
    if store is not None:
        ts = (fs.offload_state(store, chunk_mb=args.chunk_mb, depth=args.depth,
                               overlap_backward={"after": False, "overlap": True}.get(kind.split("-")[-1]),
                               **({"worker_nice": int(nice)} if nice else {})),)
    units = [f"blocks.{i}" for i in range(cfg.n_layers)] + ["lm_head"] if args.head_unit else None
    state = fs.init(model, fs.Mesh.local(), fs.adamw(lr=1e-4), units=units)
    del model
    step = fs.compose(loss_fn, *ts, donate=args.donate)
    batches = list(synthetic_batches(cfg, args.batch_size, args.warmup + args.steps, seed=1))
    times, updates, waits, io, losses, early = [], [], [], [], [], []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        state, m = step(state, b)
        dt = time.perf_counter() - t0
        losses.append(m["loss"])
        if i >= args.warmup:
            times.append(dt)
            updates.append(m["time/update"])
            waits.append(m.get("time/io_wait", 0.0))
            early.append((m.get("update/overlapped_units", 0), m.get("time/overlapped_update", 0.0)))
            io.append(m.get("io/read_bytes", 0) + m.get("io/write_bytes", 0))
    _trim()
    rss, hwm = _rss()
    io_only = None
    if store is not None:  # the same reads and write-backs, with no compute: the I/O time to hide
        keys = [k for s in state.opt_state.values() if s is not None and isinstance(s.exp_avg, fs.state.Stored)
                for k in s.exp_avg.items.item_keys()]
        io_times = []
        for _ in range(2):
            t0 = time.perf_counter()
            _io_pass(store, keys, args.depth)
            io_times.append(time.perf_counter() - t0)
        io_only = min(io_times)
    probe = _overlap_probe(store, keys, cfg, batches[-1], args) if store is not None and args.overlap_probe else None
    out_q.put(dict(name=name, params=n_params, step_s=times, update_s=updates, io_wait_s=waits, io_bytes=io,
                   early=early,
                   rss=rss, hwm=hwm, io_only_s=io_only, losses=losses, probe=probe,
                   resident=int(getattr(store, "resident_bytes", 0)) if store is not None else 0))
    if store is not None:
        del state
        store.close()


def _io_pass(store, keys, depth: int) -> None:
    """The step's reads and write-backs without the compute. Each item goes back under its own key, unchanged:
    the store's steady state (the previous version's slot is reused), as in a step with donate. Writing under new
    keys instead would create a file and an engine per item (65 ms each on aio) and time that."""
    with store.stream(keys, depth=depth, writeback=True) as s:
        for item in s:
            s.writeback(item)


def _overlap_probe(store, keys, cfg, batch, args) -> dict:
    """What overlapping the optimizer I/O with the backward pass could buy on this machine: the step's stream of
    reads and write-backs run in a thread while a plain torch forward+backward of the same model runs, against
    each of them alone (median of 3)."""
    import threading
    from gpt import GPT, loss_fn

    torch.manual_seed(0)
    model = GPT(cfg)

    def io() -> float:
        t0 = time.perf_counter()
        _io_pass(store, keys, args.depth)
        return time.perf_counter() - t0

    def fwd_bwd() -> float:
        t0 = time.perf_counter()
        loss_fn(model, batch).backward()
        return time.perf_counter() - t0

    fwd_bwd()  # warm-up
    rows = []
    for _ in range(3):
        io_alone, fb_alone = io(), fwd_bwd()
        got: list = []
        th = threading.Thread(target=lambda: got.append(io()))
        t0 = time.perf_counter()
        th.start()
        fb_both = fwd_bwd()
        th.join()
        rows.append((io_alone, fb_alone, fb_both, got[0], time.perf_counter() - t0))
    keys_ = ("io_alone", "fwd_bwd_alone", "fwd_bwd_with_io", "io_with_fwd_bwd", "together")
    return {k: statistics.median(r[i] for r in rows) for i, k in enumerate(keys_)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where NVMeStore puts its files")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-mb", type=float, default=8)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--donate", action="store_true", help="compose with donate=True (in-place update)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--head-unit", action="store_true",
                   help="lm_head as a unit of its own (else in the root, whose gradient is final only at the end)")
    p.add_argument("--overlap-probe", action="store_true",
                   help="also time the stored configs' I/O running concurrently with a forward+backward")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    names = args.configs.split(",")
    res: dict[str, list] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for n in names:
            q = ctx.Queue()
            proc = ctx.Process(target=run_config, args=(n, args, q))
            proc.start()
            r = q.get()
            proc.join()
            res[n].append(r)
            print(f"[offload.py] round {rnd} {n}: median {statistics.median(r['step_s']):.3f} s/step, "
                  f"rss {r['rss'] / 2**30:.2f} GiB", flush=True)
    print(f"\n=== offloaded AdamW state, world size 1, {res[names[0]][0]['params'] / 1e6:.1f}M params, "
          f"batch {args.batch_size}, {args.threads} threads, chunk {args.chunk_mb} MiB, depth {args.depth}, "
          f"donate={args.donate}, lm_head unit={args.head_unit}, torch {torch.__version__} ===")
    print(f"{'config':18s} {'step s':>8s} {'update s':>9s} {'early':>6s} {'early s':>8s} {'io wait s':>10s} "
          f"{'io-only s':>10s} {'hidden':>7s} {'GB/step':>8s} {'RSS GiB':>8s} {'peak GiB':>9s}")
    med = {}
    for n in names:
        rs = res[n]
        step = statistics.median([t for r in rs for t in r["step_s"]])
        upd = statistics.median([t for r in rs for t in r["update_s"]])
        wait = statistics.median([t for r in rs for t in r["io_wait_s"]])
        gb = statistics.median([b for r in rs for b in r["io_bytes"]]) / 1e9
        io_only = statistics.median([r["io_only_s"] for r in rs]) if rs[0]["io_only_s"] else None
        hidden = "" if not io_only else f"{max(0.0, 1 - wait / io_only) * 100:5.1f}%"
        rss, hwm = max(r["rss"] for r in rs) / 2**30, max(r["hwm"] for r in rs) / 2**30
        med[n] = step
        units = statistics.median([e[0] for r in rs for e in r["early"]])
        early_s = statistics.median([e[1] for r in rs for e in r["early"]])
        print(f"{n:18s} {step:8.3f} {upd:9.3f} {units:6.0f} {early_s:8.3f} {wait:10.3f} {(io_only or 0):10.3f} "
              f"{hidden:>7s} {gb:8.3f} {rss:8.2f} {hwm:9.2f}")
    losses = {n: res[n][0]["losses"] for n in names}
    same = all(losses[n] == losses[names[0]] for n in names)
    print(f"\nlosses identical across configs (round 0): {same}")
    pairs = [("nvme-uring", "cpu"), ("nvme-aio", "cpu"), ("cpu", "none"), ("nvme-uring", "none"),
             ("nvme-uring-after", "cpu"), ("nvme-aio-after", "cpu"), ("nvme-uring", "nvme-uring-after"),
             ("nvme-aio", "nvme-aio-after"), ("cpu-overlap", "cpu")]
    for a, b in pairs:
        if a in med and b in med:
            print(f"  {a} / {b} = {med[a] / med[b]:.3f}")
    for n in names:
        probes = [r["probe"] for r in res[n] if r.get("probe")]
        if probes:
            pm = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
            serial = pm["io_alone"] + pm["fwd_bwd_alone"]
            print(f"  overlap probe {n}: I/O alone {pm['io_alone']:.3f} s, forward+backward alone "
                  f"{pm['fwd_bwd_alone']:.3f} s (serial {serial:.3f}); together {pm['together']:.3f} s "
                  f"(forward+backward {pm['fwd_bwd_with_io']:.3f}, I/O {pm['io_with_fwd_bwd']:.3f}): saves "
                  f"{serial - pm['together']:.3f} s of the {pm['io_alone']:.3f} s of I/O")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
