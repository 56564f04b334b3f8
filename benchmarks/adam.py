"""AdamW update on 50M fp32 params: fshard.ops vs torch fused / foreach vs DeepSpeedCPUAdam.

Run (2 threads, serialized with other benchmarks on the shared machine):
    flock /tmp/fshard-bench.lock env PYTHONPATH=.:/tmp/ds .venv/bin/python benchmarks/adam.py

Two layouts: (a) 4 large tensors, (b) 180 mixed-size tensors (a GPT-like block structure).
Two workloads:
  bare   fp32 grads, no clipping, no copy: the plain Adam pass (28 B/element of traffic).
  mixed  bf16 grads, a clip coefficient, the non-finite check and a bf16 copy of the new
         params: ours is one fshard.ops.adamw_ call, torch is its pass sequence.
Every round times each implementation once, in turn; the figures are medians over rounds and
each ratio compares medians from this same run. The roof is an in-place triad (x += a*y,
12 B/element) on the same number of elements, measured in the same rounds.

This machine's DRAM switches between two states on its own (triad about 55 or about 90 GB/s), often
within one run. `--by-state SECONDS` times the bare and mixed-precision updates round by round for
that long, with a triad in every round, groups the rounds by the triad's state and reports, per
state, medians and the median over rounds of each peer's time / ours (a paired ratio):
    flock /tmp/fshard-bench.lock env PYTHONPATH=.:/tmp/ds .venv/bin/python benchmarks/adam.py \
        --by-state 150 --layouts large
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fshard.ops as ops  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def layout(name: str, n: int) -> list[int]:
    if name == "large":
        return [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
    # 15 transformer-like blocks x 12 tensors (qkv, proj, fc1, fc2 weights; biases; norms).
    d = int((n / 180) ** 0.5)
    block = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    sizes = block * 15
    sizes[0] += n - sum(sizes)  # an embedding-like first tensor takes the remainder
    return sizes


def bench(fns: dict, rounds: int, warmup: int = 1) -> dict[str, float]:
    for f in fns.values():
        for _ in range(warmup):
            f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def try_deepspeed():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its cpu_adam build failed
        print(f"DeepSpeed not installed: skipped ({type(e).__name__}: {str(e)[:120]})")
        return None


def bare_fns(sizes, ds_cls) -> dict:
    gen = torch.Generator().manual_seed(0)
    P = [torch.randn(s, generator=gen) for s in sizes]
    G = [torch.randn(s, generator=gen) * 1e-2 for s in sizes]
    M, V = [torch.zeros(s) for s in sizes], [torch.zeros(s) for s in sizes]
    step = [0]

    def ours(check, isa=None):
        def f():
            step[0] += 1
            assert not ops.adamw_(P, G, M, V, step=step[0], check_finite=check, isa=isa, **HP)
        return f

    def torch_opt(**kw):
        params = [torch.nn.Parameter(t.clone()) for t in P]
        for p, g in zip(params, G):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                weight_decay=HP["weight_decay"], **kw)
        return opt.step

    fns = {"ours (bare, check_finite=False)": ours(False), "ours (with non-finite check)": ours(True)}
    if ops.backend_info()["cpu_isa"] == "avx512":  # what the wider kernel buys, in the same run
        fns["ours (bare, AVX2 kernel)"] = ours(False, "avx2")
    fns.update({"torch AdamW fused=True": torch_opt(fused=True), "torch AdamW foreach=True": torch_opt(foreach=True)})
    if ds_cls is not None:
        params = [torch.nn.Parameter(t.clone()) for t in P]
        for p, g in zip(params, G):
            p.grad = g
        fns["DeepSpeedCPUAdam"] = ds_cls(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                         eps=HP["eps"], weight_decay=HP["weight_decay"], adamw_mode=True).step
    return fns


def mixed_fns(sizes) -> dict:
    gen = torch.Generator().manual_seed(1)
    P = [torch.randn(s, generator=gen) for s in sizes]
    G = [(torch.randn(s, generator=gen) * 1e-2).bfloat16() for s in sizes]
    M, V = [torch.zeros(s) for s in sizes], [torch.zeros(s) for s in sizes]
    C = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    coef = 0.5  # clip coefficient, computed beforehand from the grad norm by either side
    step = [0]

    def ours(isa=None):
        def f():
            step[0] += 1
            assert not ops.adamw_(P, G, M, V, step=step[0], grad_scale=coef, param_copies=C, isa=isa, **HP)
        return f

    TP, TM, TV = [t.clone() for t in P], [torch.zeros(s) for s in sizes], [torch.zeros(s) for s in sizes]
    tstep = [torch.tensor(0.0) for _ in sizes]
    found = torch.zeros(1)
    inv = torch.tensor(coef)
    G32 = [torch.empty(s) for s in sizes]  # preallocated, so torch pays no allocation or page faults

    def torch_best():
        # Fewest torch passes: cast (fused AdamW needs fp32 grads), one pass that scales and checks,
        # the fused update (skipped on found_inf without a host sync), the bf16 copy.
        torch._foreach_copy_(G32, G)  # bf16 -> fp32
        g32 = G32
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(g32, found, inv)
        torch._foreach_add_(tstep, 1)
        torch._fused_adamw_(TP, g32, TM, TV, [], tstep, amsgrad=False, maximize=False, found_inf=found, **HP)
        torch._foreach_copy_(C, TP)

    def torch_literal():
        # The textbook sequence: clip scale, non-finite check, fused AdamW, copy to bf16.
        torch._foreach_copy_(G32, G)
        g32 = G32
        torch._foreach_mul_(g32, coef)
        bad = torch.stack([torch.logical_not(torch.isfinite(g)).any() for g in g32]).any()
        if not bool(bad):
            torch._foreach_add_(tstep, 1)
            torch._fused_adamw_(TP, g32, TM, TV, [], tstep, amsgrad=False, maximize=False, **HP)
        torch._foreach_copy_(C, TP)

    fns = {"ours (one call)": ours()}
    if ops.backend_info()["cpu_isa"] == "avx512":
        fns["ours (one call, AVX2 kernel)"] = ours("avx2")
    return {**fns, "torch: cast, check+scale, fused, copy": torch_best,
            "torch: cast, scale, isfinite, fused, copy": torch_literal}


def triad(n: int):
    x, y = torch.zeros(n), torch.ones(n)
    return lambda: x.add_(y, alpha=1e-3)


FAST_GBS, SLOW_GBS = 75.0, 65.0  # triad bands of the two memory states; rounds in between are dropped


def by_state(lay: str, sizes: list[int], ds_cls, seconds: float) -> dict:
    n = sum(sizes)
    fns = {k: f for k, f in bare_fns(sizes, ds_cls).items() if "foreach" not in k}
    mixed = mixed_fns(sizes)
    fns.update({"mixed: ours (one call)": mixed["ours (one call)"],
                "mixed: torch: cast, check+scale, fused, copy": mixed["torch: cast, check+scale, fused, copy"]})
    roof = triad(n)
    for f in [*fns.values(), roof]:
        f()
    rows, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        row = {}
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            row[k] = time.perf_counter() - t0
        t0 = time.perf_counter()
        roof()
        row["triad GB/s"] = 12 * n / (time.perf_counter() - t0) / 1e9
        rows.append(row)
    out = {}
    for state, keep in (("fast", lambda r: r["triad GB/s"] > FAST_GBS), ("slow", lambda r: r["triad GB/s"] < SLOW_GBS)):
        rs = [r for r in rows if keep(r)]
        print(f"\n### {lay} layout, {state} memory state: {len(rs)} of {len(rows)} rounds")
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in rows[0]}
        print(f"triad {med['triad GB/s']:.1f} GB/s\n| implementation | ms (median) | peer / ours, median over rounds |\n|---|---|---|")
        for k in fns:
            ours = "mixed: ours (one call)" if k.startswith("mixed") else "ours (bare, check_finite=False)"
            ratio = statistics.median(r[k] / r[ours] for r in rs)
            print(f"| {k} | {med[k] * 1e3:.2f} | {ratio:.3f}x |")
            out[f"{lay}/{state}/{k}"] = {"ms": med[k] * 1e3, "peer_over_ours": ratio}
        out[f"{lay}/{state}/rounds"] = len(rs)
        out[f"{lay}/{state}/triad_gbs"] = med["triad GB/s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=50_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layouts", default="large,mixed")
    ap.add_argument("--json", type=Path, default=None, help="also write the medians here")
    ap.add_argument("--by-state", type=float, default=0, metavar="SECONDS",
                    help="time round by round for this long per layout, grouped by the memory state")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, n={args.n:,}, rounds={args.rounds}")
    print("fshard.ops:", {k: v for k, v in ops.backend_info().items() if k in ("backend", "cpu_isa", "cuda")})
    ds_cls = try_deepspeed()
    out = {}
    if args.by_state:
        for lay in args.layouts.split(","):
            out.update(by_state(lay, layout(lay, args.n), ds_cls, args.by_state))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return
    for lay in args.layouts.split(","):
        sizes = layout(lay, args.n)
        n = sum(sizes)
        for work, fns in (("bare", bare_fns(sizes, ds_cls)), ("mixed", mixed_fns(sizes))):
            roof = triad(n)
            res = bench({**fns, "roof: in-place triad": roof}, args.rounds)
            roof_gbs = 12 * n / res.pop("roof: in-place triad") / 1e9
            bpe = 28  # minimal bytes/element: fp32 p,m,v read+write + 4 B fp32 grad, or 2+2 B bf16 grad+copy
            base_name = "torch AdamW fused=True" if work == "bare" else "torch: cast, check+scale, fused, copy"
            print(f"\n### {lay} layout ({len(sizes)} tensors, {n:,} elements), {work} update; "
                  f"roof (triad) {roof_gbs:.1f} GB/s")
            print("| implementation | ms | Gelem/s | GB/s (28 B/elem) | roof fraction | speed-up vs " +
                  base_name + " |\n|---|---|---|---|---|---|")
            for k, t in res.items():
                gbs = bpe * n / t / 1e9
                print(f"| {k} | {t * 1e3:.1f} | {n / t / 1e9:.2f} | {gbs:.1f} | {gbs / roof_gbs:.2f} | "
                      f"{res[base_name] / t:.2f}x |")
                out[f"{lay}/{work}/{k}"] = t * 1e3
            ours = res["ours (bare, check_finite=False)" if work == "bare" else "ours (one call)"]
            peers = [k for k in res if not k.startswith("ours") and k != base_name]
            print("speed-up of ours over each peer: " +
                  ", ".join(f"{k} {res[k] / ours:.2f}x" for k in [base_name] + peers))
            out[f"{lay}/{work}/roof_gbs"] = roof_gbs
            del fns, roof
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
