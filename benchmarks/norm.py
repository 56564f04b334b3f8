"""Gradient sum of squares on 58M fp32 elements: fshard.ops.sq_norm vs torch's vector_norm.

Run (2 threads, serialized with other benchmarks on the shared machine):
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/norm.py

Timed, each once per round in turn, medians over rounds (ratios compare medians from this run):
  sq_norm (auto, and every other CPU kernel)      one native pass, float64 accumulation, deterministic
  vector_norm(g, dtype=float64) ** 2, summed      what Grads.with_sq_norm ran before sq_norm
  vector_norm(g) (fp32)                           torch's fp32 norm, for scale
  g.sum() (fp32)                                  a plain read pass: the roof for a read-only reduction
Two layouts: one flat 58M buffer, and 180 GPT-like tensors of the same total (benchmarks/adam.py's "mixed").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fshard.ops as ops  # noqa: E402
from adam import layout  # noqa: E402


def fns_for(ts: list[torch.Tensor]) -> dict:
    fns = {"sq_norm (auto)": lambda: ops.sq_norm(ts)}
    for isa in reversed(ops.cpu_isas()[:-1]):
        fns[f"sq_norm ({isa} kernel)"] = lambda isa=isa: ops.sq_norm(ts, isa=isa)
    fns["torch vector_norm(float64) ** 2"] = lambda: float(
        sum(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in ts))
    fns["torch vector_norm (fp32)"] = lambda: float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in ts])))
    fns["torch g.sum() (fp32 read pass)"] = lambda: float(sum(g.sum() for g in ts))
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=58_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layouts", default="flat,mixed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, n={args.n:,}, rounds={args.rounds}")
    print("fshard.ops:", {k: v for k, v in ops.backend_info().items() if k in ("backend", "cpu_isa")})
    for lay in args.layouts.split(","):
        sizes = [args.n] if lay == "flat" else layout("mixed", args.n)
        gen = torch.Generator().manual_seed(0)
        ts = [torch.randn(s, generator=gen) * 1e-2 for s in sizes]
        fns = fns_for(ts)
        vals = {k: f() for k, f in fns.items()}  # warm-up, and the values agree
        ref = vals["torch vector_norm(float64) ** 2"]
        for k in fns:
            if k.startswith("sq_norm"):
                # Loose: torch's float64 vector_norm is itself off by ~1e-12 at 58M (design/OPS.md).
                assert abs(vals[k] - ref) <= 1e-9 * ref, (k, vals[k], ref)
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ours = med["sq_norm (auto)"]
        print(f"\n### {lay} layout ({len(sizes)} tensors, {sum(sizes):,} fp32 elements)")
        print("| implementation | ms (median) | GB/s (4 B/elem) | time / sq_norm (auto) |\n|---|---|---|---|")
        for k, t in med.items():
            print(f"| {k} | {t:.2f} | {4 * sum(sizes) / t / 1e6:.1f} | {t / ours:.2f}x |")
        del ts, fns


if __name__ == "__main__":
    main()
