"""One GPU, world size 1: the cost of fshard's step against plain torch and FSDP2 (issue #23, "step's cost").

A GPT of 1.04B parameters (examples/gpt.py: vocab 32768, dim 2048, 18 layers, 16 heads, seq 1024, untied head),
the same initial weights (``torch.manual_seed(seed); GPT(cfg)`` on the CPU, deep-copied per config) and the same
synthetic batches (``synthetic_batches``, moved to the device once) for every config, bf16 compute:

  plain   the model on the GPU in fp32, ``torch.autocast("cuda", torch.bfloat16)`` forward and backward,
          ``torch.optim.AdamW(fused=True)``
  fshard  ``fs.init(cpu_model, mesh, fs.adamw(...))`` on an NCCL mesh of one rank, ``fs.compose(loss_fn,
          fs.gather_ahead(2), fs.bucket_reduce(25), fs.mixed_precision())`` (bf16 params, fp32 reduce and master)
  fsdp2   ``fully_shard`` on each block and the root, ``MixedPrecisionPolicy(bf16, fp32)``, AdamW(fused=True)
  optional (``--configs``): plain_bf16, the model in bf16, no autocast, AdamW(fused=True) on bf16 parameters;
          fshard_donate, fshard's step with ``donate=True`` (the update in place: no second copy of the state)

Configs run one after another (a 1B model's fp32 Adam state is ~16 GiB each), in the order of ``--configs``, then
the first again ``--rounds`` times, so drift shows. Each run: build, ``--warmup`` untimed steps, ``--steps`` timed
steps (wall time, ``torch.cuda.synchronize()`` before and after each; no ``.item()`` inside beyond what a framework
does itself). Reported: median s/step, tokens/s, approx model TFLOP/s, peak GPU memory of the steps
(``max_memory_allocated``, reset after the build) and of the build, each step's loss, fshard / plain and
fshard / fsdp2 of the medians (target: fshard <= 1.05x plain). ``--trace DIR``: 2 more fshard steps under
``torch.profiler`` -> DIR/fshard_trace.json.gz (< 16 MB, trimmed if needed), DIR/fshard_profile.txt, the kernel
table, host syncs per step, the CUDA streams kernels ran on and how much side-stream work overlapped compute.

On the H100 (one process; the script starts its own NCCL group of one rank)::

    python benchmarks/step_cuda.py --json $OUT/step_cuda.json
    python benchmarks/step_cuda.py --trace $OUT/trace --json $OUT/step_cuda.json
    python benchmarks/step_cuda.py --configs plain,fshard,fsdp2,fshard_donate,plain_bf16 --rounds 2

Here (CPU, gloo, tiny GPT, end-to-end check of the script only)::

    .venv/bin/python benchmarks/step_cuda.py --dry-cpu [--trace /tmp/t]
"""
from __future__ import annotations

import argparse
import copy
import gc
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpt import GPT, GPTConfig, loss_fn, synthetic_batches  # noqa: E402


def loss_fp32(module, batch):
    """examples/gpt.py's loss_fn on fp32 logits (--fp32-loss)."""
    idx, targets = batch
    logits = module(idx).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


CFG_1B = GPTConfig(vocab=32768, dim=2048, n_layers=18, n_heads=16, seq=1024)  # 1,042,767,872 parameters
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_NAMES = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cudaStreamWaitEvent")
TRACE_LIMIT = 15 * 2**20
CONFIGS = ("plain", "fshard", "fsdp2", "plain_bf16", "fshard_donate")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="plain,fshard,fsdp2", help="from " + ", ".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=1, help="extra runs of the first config at the end (drift)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp32-loss", action="store_true",
                   help="every config: cross-entropy on fp32 logits (default: examples/gpt.py's loss_fn as is; "
                        "bf16 logits under fshard/FSDP2 give a bf16 loss, fp32 under autocast)")
    p.add_argument("--trace", default=None, metavar="DIR", help="profile 2 more fshard steps, trace into DIR")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--dry-cpu", action="store_true", help="CPU, gloo, tiny GPT, 1 + 2 steps: checks the script")
    a = p.parse_args(argv)
    if a.dry_cpu:
        a.warmup, a.steps = 1, 2
    return a


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Bench:
    def __init__(self, args):
        self.args, self.cuda = args, not args.dry_cpu
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.cfg = GPTConfig.tiny() if args.dry_cpu else CFG_1B
        self.hp = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        torch.manual_seed(args.seed)
        self.base = GPT(self.cfg)  # on the CPU; every config starts from a deep copy
        self.n_params = self.base.num_params()
        n = args.warmup + args.steps + (2 if args.trace else 0)
        self.batches = [(x.to(self.device), y.to(self.device))
                        for x, y in synthetic_batches(self.cfg, args.batch, n, args.seed)]
        self.profile = None
        self.loss_fn = loss_fp32 if args.fp32_loss else loss_fn

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    # --- the configs: each returns (step(batch) -> (loss, metrics), close(), info) ----------------------------

    def plain(self, bf16_params=False):
        model = copy.deepcopy(self.base).to(self.device, torch.bfloat16 if bf16_params else None)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **self.hp)
        amp = not bf16_params

        def step(batch):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=amp):
                loss = self.loss_fn(model, batch)
            loss.backward()
            opt.step()
            return loss.detach(), {}
        return step, lambda: None, {}

    def plain_bf16(self):
        return self.plain(bf16_params=True)

    def fsdp2(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dm = init_device_mesh(self.device.type, (1,))
        model = copy.deepcopy(self.base).to(self.device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=dm, mp_policy=policy)
        fully_shard(model, mesh=dm, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **self.hp)

        def step(batch):
            opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(model, batch)
            loss.backward()
            opt.step()
            return loss.detach(), {}
        return step, lambda: None, {}

    def fshard_donate(self):
        return self.fshard(donate=True)

    def fshard(self, donate=False):
        import fshard as fs

        mesh = fs.Mesh.from_env()  # reuses the default group this script initialised
        if mesh.device.type != self.device.type:
            mesh = fs.Mesh.from_group(dist.group.WORLD)
        opt = fs.adamw(**self.hp)
        state = fs.init(copy.deepcopy(self.base), mesh, opt)
        fn = fs.compose(self.loss_fn, fs.gather_ahead(2), fs.bucket_reduce(25), fs.mixed_precision(),
                        donate=donate)
        holder = {"state": state}
        del state

        def step(batch):
            holder["state"], metrics = fn(holder["state"], batch)
            return metrics["loss"], metrics

        def close():
            fn.close()
            holder.clear()
        return step, close, {"mesh": repr(mesh), "optim_impl": opt.resolved_impl(mesh.device), "step_fn": repr(fn)}

    # --- one run ------------------------------------------------------------------------------------------------

    def run(self, name):
        a, out = self.args, {"config": name}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        step, close, info = getattr(self, name)()
        out.update(info, build_s=time.perf_counter() - t0)
        if self.cuda:
            out.update(build_peak_bytes=torch.cuda.max_memory_allocated(), state_bytes=torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        losses, times, metrics = [], [], []
        try:
            for i in range(a.warmup + a.steps):
                self.sync()
                t = time.perf_counter()
                loss, m = step(self.batches[i])
                self.sync()
                t = time.perf_counter() - t
                losses.append(loss)
                if i >= a.warmup:
                    times.append(t)
                    metrics.append(m)
            if self.cuda:
                out["peak_bytes"] = torch.cuda.max_memory_allocated()
            if name.startswith("fshard") and a.trace and self.profile is None:
                try:
                    self.profile = profile_steps(self, step, a.trace)
                except Exception as e:  # noqa: BLE001 - the timings stand; say why the profile is missing
                    traceback.print_exc()
                    self.profile = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        finally:
            close()
            del step, close
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
                out["left_allocated_bytes"] = torch.cuda.memory_allocated()
        out["losses"] = [float(x) for x in losses]
        out["times_s"] = times
        out["median_s"] = statistics.median(times)
        out["tokens_per_s"] = a.batch * self.cfg.seq / out["median_s"]
        c = self.cfg
        flops_per_token = 6 * (self.n_params - (c.vocab + c.seq) * c.dim) + 6 * c.n_layers * c.seq * c.dim
        out["model_tflops"] = flops_per_token * out["tokens_per_s"] / 1e12
        keys = sorted({k for m in metrics for k, v in m.items()
                       if isinstance(v, (int, float)) and k.startswith(("time/", "gather/", "reduce/", "mem/peak"))})
        out["fshard_metrics"] = {k: statistics.median(m[k] for m in metrics if k in m) for k in keys}
        if metrics and "optim/impl" in metrics[-1]:
            out["fshard_metrics"]["optim/impl"] = metrics[-1]["optim/impl"]
        return out


# --- profiler ---------------------------------------------------------------------------------------------------


def profile_steps(bench, step, trace_dir):
    from torch.profiler import ProfilerActivity, profile, record_function

    os.makedirs(trace_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    first = bench.args.warmup + bench.args.steps
    bench.sync()
    with profile(activities=acts, record_shapes=False, with_stack=False) as prof:
        for k in range(2):
            with record_function(f"fshard_step_{k}"):
                step(bench.batches[first + k])
        bench.sync()
    sort = "device_time_total" if bench.cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    with open(os.path.join(trace_dir, "fshard_profile.txt"), "w") as f:
        f.write(table)
    evs = prof.events()
    ranges = [(e.time_range.start, e.time_range.end) for e in evs
              if e.name.startswith("fshard_step_") and str(e.device_type).endswith("CPU")]
    syncs = {n: sum(1 for e in evs if e.name == n and any(lo <= e.time_range.start <= hi for lo, hi in ranges))
             / max(1, len(ranges)) for n in SYNC_NAMES}
    raw = os.path.join(trace_dir, "fshard_trace.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        doc = json.load(f)
    os.remove(raw)
    tev = doc.get("traceEvents", [])
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in tev
             if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith("fshard_step_")]
    trace_syncs = {n: sum(1 for e in tev if e.get("ph") == "X" and e.get("name") == n
                          and e.get("cat") in ("cuda_runtime", "cuda_driver")
                          and any(lo <= float(e["ts"]) <= hi for lo, hi in spans)) / max(1, len(spans))
                   for n in SYNC_NAMES}
    res = {"table": table, "syncs_per_step": syncs, "trace_syncs_per_step": trace_syncs,
           "streams": stream_overlap(tev, 2)}
    res["trace"], res["trace_trim"], res["trace_bytes"] = write_trace(doc, raw + ".gz")
    return res


def _union(iv):
    out = []
    for lo, hi in sorted(iv):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _intersect(a, b):  # both unions, sorted and disjoint
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_overlap(events, n_steps):
    """Per CUDA stream: GPU events, busy time (union), top names; the compute stream is the busiest; the time
    other streams' work (NCCL, copies) overlapped it. Times in ms per step."""
    per = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "stream" in e.get("args", {}):
            per.setdefault(e["args"]["stream"], []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                                                            e.get("name", "?")))
    if not per:
        return {"note": "no GPU events in the trace"}
    unions = {s: _union([(lo, hi) for lo, hi, _ in v]) for s, v in per.items()}
    busy = {s: sum(hi - lo for lo, hi in u) for s, u in unions.items()}
    compute = max(busy, key=busy.get)
    res = {"compute_stream": compute, "per_stream": {}}
    for s, v in per.items():
        names = {}
        for lo, hi, nm in v:
            names[nm] = names.get(nm, 0.0) + hi - lo
        top = sorted(names.items(), key=lambda kv: -kv[1])[:4]
        res["per_stream"][str(s)] = {
            "events_per_step": len(v) / n_steps, "busy_ms_per_step": busy[s] / 1e3 / n_steps,
            "overlap_with_compute_ms_per_step": (None if s == compute else
                                                 _intersect(unions[s], unions[compute]) / 1e3 / n_steps),
            "top": [(nm[:70], round(t / 1e3 / n_steps, 3)) for nm, t in top]}
    side = _union([iv for s, u in unions.items() if s != compute for iv in u])
    res["side_busy_ms_per_step"] = sum(hi - lo for lo, hi in side) / 1e3 / n_steps
    res["side_overlap_ms_per_step"] = _intersect(side, unions[compute]) / 1e3 / n_steps
    return res


def write_trace(doc, path):
    """Gzipped chrome trace under TRACE_LIMIT: all events, else without CPU ops, else GPU work, runtime calls and
    annotations only."""
    keep_gpu = set(GPU_CATS) | {"cuda_runtime", "cuda_driver", "user_annotation", "gpu_user_annotation"}
    levels = [("all events", lambda e: True),
              ("no cpu_op/python_function", lambda e: e.get("cat") not in ("cpu_op", "python_function")),
              ("GPU, runtime and annotations only", lambda e: e.get("ph") == "M" or e.get("cat") in keep_gpu)]
    for what, keep in levels:
        data = gzip.compress(json.dumps({**doc, "traceEvents": [e for e in doc.get("traceEvents", []) if keep(e)]})
                             .encode(), 6)
        if len(data) <= TRACE_LIMIT or what == levels[-1][0]:
            with open(path, "wb") as f:
                f.write(data)
            return path, what, len(data)


# --- report -----------------------------------------------------------------------------------------------------


def report(bench, runs, result):
    a = bench.args
    gib = 2**30
    prof = bench.profile
    if prof and "error" in prof:
        print(f"\nprofile FAILED: {prof['error']}")
    elif prof:
        print("\n=== fshard under torch.profiler (2 steps) ===")
        print(prof["table"])
        print("host syncs per step (runtime calls inside the fshard_step_k ranges): "
              + ", ".join(f"{k} {v:g}" for k, v in prof["syncs_per_step"].items()))
        print("  the same from the trace's cuda_runtime events: "
              + ", ".join(f"{k} {v:g}" for k, v in prof["trace_syncs_per_step"].items()))
        st = prof["streams"]
        if "note" in st:
            print(st["note"])
        else:
            print(f"streams (GPU events; compute stream = busiest = {st['compute_stream']}), ms per step:")
            for s, d in st["per_stream"].items():
                ov = d["overlap_with_compute_ms_per_step"]
                print(f"  stream {s}: {d['events_per_step']:.0f} events, busy {d['busy_ms_per_step']:.3f}"
                      + ("" if ov is None else f", overlapping compute {ov:.3f}")
                      + "; top: " + "; ".join(f"{n} {t}" for n, t in d["top"]))
            print(f"  side streams together: busy {st['side_busy_ms_per_step']:.3f} ms/step, of which "
                  f"{st['side_overlap_ms_per_step']:.3f} overlapped compute")
        print(f"trace: {prof['trace']} ({prof['trace_bytes'] / 2**20:.1f} MiB gz, {prof['trace_trim']})")

    ok = [r for r in runs if "median_s" in r]
    print("\n=== losses per step (warm-up steps first) ===")
    ref = next((r["losses"] for r in ok if r["config"] == "plain"), None)
    for r in ok:
        d = "" if ref is None else f"  max|d plain| {max(abs(x - y) for x, y in zip(r['losses'], ref)):.3g}"
        print(f"  {r['config']:13s} " + " ".join(f"{x:.4f}" for x in r["losses"]) + d)
    for r in ok:
        if r.get("fshard_metrics"):
            fm = r["fshard_metrics"]  # all of them in --json
            print(f"{r['config']} metrics (median of timed steps; host clocks): " + ", ".join(
                f"{k} {v:.4g}" for k, v in fm.items() if k.startswith("time/") or k.endswith("/overlap"))
                + f", mem/peak_bytes {fm.get('mem/peak_bytes', 0) / gib:.2f} GiB")
            print(f"fshard: {r.get('step_fn')} on {r.get('mesh')}, adamw impl {r.get('optim_impl')}")
            break
    for r in runs:
        if "error" in r:
            print(f"  {r['config']} FAILED: {r['error']}")

    print(f"\n=== {result['meta']['device']}, torch {torch.__version__}, git {result['meta']['git']}, "
          f"{bench.n_params:,} params, batch {a.batch} x seq {bench.cfg.seq}, {a.warmup} warm-up + {a.steps} timed ===")
    print(f"{'run':16s} {'median s':>9s} {'min s':>8s} {'tok/s':>9s} {'TFLOP/s':>8s} {'peak GiB':>9s} "
          f"{'build GiB':>9s} {'state GiB':>9s} {'left GiB':>8s}")
    for i, r in enumerate(ok):
        mem = (f"{r['peak_bytes'] / gib:9.2f} {r['build_peak_bytes'] / gib:9.2f} {r['state_bytes'] / gib:9.2f} "
               f"{r['left_allocated_bytes'] / gib:8.2f}" if "peak_bytes" in r else "")
        print(f"{r['config'] + '#' + str(i):16s} {r['median_s']:9.4f} {min(r['times_s']):8.4f} "
              f"{r['tokens_per_s']:9.0f} {r['model_tflops']:8.1f} {mem}")
    med = {}
    for r in ok:
        med.setdefault(r["config"], []).extend(r["times_s"])
    med = {k: statistics.median(v) for k, v in med.items()}
    result["median_s"] = med
    firsts = [r["median_s"] for r in ok if r["config"] == ok[0]["config"]] if ok else []
    if len(firsts) > 1:
        print(f"drift of {ok[0]['config']}: run medians " + ", ".join(f"{x:.4f}" for x in firsts)
              + f" (last / first {firsts[-1] / firsts[0]:.3f})")
    for ours in ("fshard", "fshard_donate"):
        for base in ("plain", "fsdp2", "plain_bf16"):
            if ours in med and base in med:
                r = med[ours] / med[base]
                result[f"{ours}_over_{base}"] = r
                print(f"{ours} / {base} = {r:.3f} (medians over all timed steps)"
                      + (f"  target <= 1.05: {'MET' if r <= 1.05 else 'NOT MET'}" if base == "plain" else ""))


def main(argv=None):
    a = parse_args(argv)
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise SystemExit(f"unknown configs {bad}")
    if not a.dry_cpu:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-cpu to check the script on the CPU")
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if a.dry_cpu else "nccl", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{_free_port()}")
    bench = Bench(a)
    dev = torch.cuda.get_device_name(0) if bench.cuda else "CPU (dry run)"
    result = {"meta": {"device": dev, "torch": torch.__version__, "cuda": torch.version.cuda, "git": _git(),
                       "cfg": vars(bench.cfg) if hasattr(bench.cfg, "__dict__") else str(bench.cfg),
                       "params": bench.n_params, "args": vars(a)}}
    if bench.cuda:
        v = torch.cuda.nccl.version()
        result["meta"]["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    print(f"[step_cuda] {dev}, torch {torch.__version__} (cuda {torch.version.cuda}), {bench.cfg}, "
          f"{bench.n_params:,} params, batch {a.batch}, runs {names + names[:1] * a.rounds}", flush=True)
    runs = []
    for name in names + names[:1] * a.rounds:
        try:
            r = bench.run(name)
            peak = f", peak {r['peak_bytes'] / 2**30:.2f} GiB" if "peak_bytes" in r else ""
            print(f"[step_cuda] {name}: median {r['median_s']:.4f} s/step{peak}, losses "
                  + " ".join(f"{x:.4f}" for x in r["losses"]), flush=True)
        except Exception as e:  # noqa: BLE001 - report it, go on with the other configs
            traceback.print_exc()
            r = {"config": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            del e
            gc.collect()
            if bench.cuda:
                torch.cuda.empty_cache()
        runs.append(r)
    result["runs"] = runs
    if bench.profile:
        result["profile"] = {k: v for k, v in bench.profile.items() if k != "table"}
    report(bench, runs, result)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {a.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
