"""The CUDA AdamW kernel (fshard.ops.adamw_ on CUDA tensors) against torch, on 1B fp32 params (issue #23).

Run on a GPU, with the Python whose torch has CUDA (fshard.ops builds its CPU+CUDA kernels on first use, which
needs a CUDA toolkit: CUDA_HOME, or nvcc on PATH; the table comes last, every figure also in --out):
    python benchmarks/adam_cuda.py --out /tmp/adam_cuda.json
Profile one launch of the update kernel (after a normal run, so the build is cached):
    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:adamw --launch-skip 1 --launch-count 1 \\
        python benchmarks/adam_cuda.py --once --numel 100000000
A smoke test of the same code paths on the CPU (perf_counter instead of CUDA events; no figures worth keeping):
    .venv/bin/python benchmarks/adam_cuda.py --device cpu --numel 200000 --reps 3

Layouts (benchmarks/adam.py's layout()): "large" is 4 tensors, "mixed" 180 GPT-like ones. Workloads:
  bare   fp32 grads, no clip, no copy: 28 B/element (p, m, v read + written, g read). Ours
         (check_finite=False) against torch._fused_adamw_ (the kernel torch.optim.AdamW(fused=True) calls; the
         base of the ratio), torch.optim.AdamW(fused=True).step() and AdamW(foreach=True).step() (the
         _multi_tensor_adam path: _foreach_lerp_, _foreach_mul_, _foreach_addcmul_, _foreach_sqrt, ...), and
         apex FusedAdam.step() when apex imports. The optimizers' state is our m and v (pre-filled state dicts)
         and their params share our params' storage, so every implementation updates the SAME tensors.
  mixed  bf16 grads, a clip coefficient (grad_scale 0.5), the non-finite check, a bf16 copy of the new params:
         ours is one adamw_ call; the base is fshard.ops._reference.adamw_reference_ (the spec: cast, scale,
         isfinite + host sync, torch._fused_adamw_, _foreach_copy_); "torch best" is the fewest torch passes
         (cast into a preallocated fp32 buffer, _amp_foreach_non_finite_check_and_unscale_, fused AdamW with
         found_inf, no host sync, copy). GB/s count the minimal 28 B/element (fp32 p, m, v r/w, bf16 g, bf16 copy).
The roof is a device-to-device copy (dst.copy_(src), --copy-numel fp32 elements, bytes read + written), timed in
the same rounds. Every round times each implementation once, with CUDA events after a synchronize, in a rotating
order; figures are medians over --reps rounds. A correctness check runs first on random inputs: ours against
torch (one step from identical state), bitwise counts and the max relative difference. Targets: bare ours >= 90%
of the copy bandwidth and torch fused / ours >= 1.0; mixed reference / ours >= 1.5.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import fshard.ops as ops  # noqa: E402
from fshard.ops._reference import adamw_reference_  # noqa: E402

_spec = importlib.util.spec_from_file_location("_fshard_bench_adam", ROOT / "benchmarks" / "adam.py")
_adam = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_adam)
layout, HP = _adam.layout, _adam.HP
STEP, COEF, BPE = 10, 0.5, 28  # step count (held fixed), clip coefficient, minimal bytes per element


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(f, dev) -> float:
    if dev.type != "cuda":
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    f()
    b.record()
    torch.cuda.synchronize(dev)
    return a.elapsed_time(b) / 1e3


def bench(fns: dict, reps: int, dev, warmup: int = 2) -> dict[str, float]:
    for f in fns.values():
        for _ in range(warmup):
            f()
    sync(dev)
    names, times = list(fns), {k: [] for k in fns}
    for r in range(reps):  # round robin, the starting implementation rotating from round to round
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(timed(fns[k], dev))
    return {k: statistics.median(v) for k, v in times.items()}


def make_state(sizes, dev, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    rn = lambda s, scale: torch.randn(s, generator=gen, device=dev).mul_(scale)  # noqa: E731
    P, G, M = [rn(s, 1.0) for s in sizes], [rn(s, 1e-2) for s in sizes], [rn(s, 1e-3) for s in sizes]
    V = [torch.rand(s, generator=gen, device=dev).mul_(1e-4).add_(1e-8) for s in sizes]  # v > 0, about g*g
    Gb = [g.bfloat16() for g in G]
    C = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in sizes]
    return P, G, M, V, Gb, C


def steps_on(dev, k):
    return [torch.tensor(float(STEP), device=dev) for _ in range(k)]


def ours(P, G, M, V, **kw):
    def f():
        assert not ops.adamw_(P, G, M, V, step=STEP, **kw, **HP)
    return f


def compare(ours_ts, ref_ts) -> dict:
    """Elements that differ in bits; the largest relative difference per element (large where a value cancels to
    near zero, so it overstates rounding there); the largest absolute difference over the largest |value|."""
    diff = sum(int((a.view(torch.int32) != b.view(torch.int32)).sum()) for a, b in zip(ours_ts, ref_ts))
    rel = max(float(((a - b).abs() / b.abs().clamp_min(1e-30)).max()) for a, b in zip(ours_ts, ref_ts))
    scale = max(float(b.abs().max()) for b in ref_ts if b.numel())
    absd = max(float((a - b).abs().max()) for a, b in zip(ours_ts, ref_ts) if a.numel())
    return {"differ": diff, "max_rel": rel, "max_abs/scale": absd / max(scale, 1e-30)}


def correctness(P, G, M, V, Gb, C) -> dict:
    """One step of ours and of torch from identical state; the state is left stepped (fine for timing)."""
    P2, M2, V2 = [p.clone() for p in P], [m.clone() for m in M], [v.clone() for v in V]
    C2 = [torch.empty_like(c) for c in C]
    n, out = sum(p.numel() for p in P), {}
    assert not ops.adamw_(P, G, M, V, step=STEP, check_finite=False, **HP)
    torch._fused_adamw_(P2, G, M2, V2, [], steps_on(P[0].device, len(P)), amsgrad=False, maximize=False, **HP)
    out["bare vs torch._fused_adamw_"] = {k: compare(*ab) for k, ab in
                                          (("p", (P, P2)), ("m", (M, M2)), ("v", (V, V2)))}
    for dst, src in ((P2, P), (M2, M), (V2, V)):
        torch._foreach_copy_(dst, src)
    assert not ops.adamw_(P, Gb, M, V, step=STEP, grad_scale=COEF, param_copies=C, check_finite=True, **HP)
    assert not adamw_reference_(P2, Gb, M2, V2, step=STEP, grad_scale=COEF, param_copies=C2, check_finite=True, **HP)
    res = {k: compare(*ab) for k, ab in (("p", (P, P2)), ("m", (M, M2)), ("v", (V, V2)))}
    res["copy != p.to(bf16)"] = sum(int((c.view(torch.int16) != p.to(torch.bfloat16).view(torch.int16)).sum())
                                    for c, p in zip(C, P))
    res["copy != reference copy"] = sum(int((c.view(torch.int16) != c2.view(torch.int16)).sum())
                                        for c, c2 in zip(C, C2))
    out["mixed vs adamw_reference_"] = res
    print(f"correctness on {n:,} random elements, one step (differ = elements not bitwise equal):")
    for k, r in out.items():
        print(f"  {k}: " + ", ".join(f"{t} {v}" if isinstance(v, int) else
                                     f"{t} differ {v['differ']:,} max_rel {v['max_rel']:.2e} max_abs/scale {v['max_abs/scale']:.2e}"
                                     for t, v in r.items()))
    return out


def torch_opt(P, G, M, V, dev, **kw):
    """torch.optim.AdamW over params sharing P's storage, with .grad = G and its state pre-filled with M and V."""
    params = [torch.nn.Parameter(p) for p in P]  # no copy: Parameter(t) shares t's storage
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **kw)
    for p, g, m, v in zip(params, G, M, V):
        p.grad = g
        step_dev = dev if kw.get("fused") else "cpu"  # torch keeps step on the CPU for foreach, not capturable
        opt.state[p] = {"step": torch.tensor(float(STEP), device=step_dev), "exp_avg": m, "exp_avg_sq": v}
    return opt.step


def apex_opt(P, G, M, V):
    try:
        from apex.optimizers import FusedAdam
        params = [torch.nn.Parameter(p) for p in P]
        opt = FusedAdam(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                        weight_decay=HP["weight_decay"], adam_w_mode=True)
        for p, g, m, v in zip(params, G, M, V):
            p.grad = g
            opt.state[p] = {"exp_avg": m, "exp_avg_sq": v}
        opt.step()  # fails here, not in the timing, when its CUDA extension is missing
        return opt.step
    except Exception as e:
        print(f"apex FusedAdam: skipped ({type(e).__name__}: {str(e)[:120]})")
        return None


def bare_fns(P, G, M, V, dev) -> dict:
    fns = {"ours": ours(P, G, M, V, check_finite=False),
           "ours, check_finite=True": ours(P, G, M, V, check_finite=True)}
    tsteps = steps_on(dev, len(P))
    fns["torch._fused_adamw_"] = lambda: torch._fused_adamw_(P, G, M, V, [], tsteps, amsgrad=False,
                                                               maximize=False, **HP)
    fns["AdamW(fused=True).step"] = torch_opt(P, G, M, V, dev, fused=True)
    fns["AdamW(foreach=True).step"] = torch_opt(P, G, M, V, dev, foreach=True)
    if dev.type == "cuda":
        apex = apex_opt(P, G, M, V)
        if apex is not None:
            fns["apex FusedAdam.step"] = apex
    else:
        print("apex FusedAdam: skipped (CPU run)")
    return fns


def mixed_fns(P, G, M, V, Gb, C, dev) -> dict:
    fns = {"ours": ours(P, Gb, M, V, grad_scale=COEF, param_copies=C, check_finite=True),
           "ours, check_finite=False": ours(P, Gb, M, V, grad_scale=COEF, param_copies=C, check_finite=False)}
    fns["torch seq (_reference)"] = lambda: adamw_reference_(P, Gb, M, V, step=STEP, grad_scale=COEF,
                                                               param_copies=C, check_finite=True, **HP)
    found, inv, tsteps = torch.zeros(1, device=dev), torch.tensor(COEF, device=dev), steps_on(dev, len(P))

    def torch_best():  # G, the bare workload's fp32 grads, is the preallocated fp32 cast target
        torch._foreach_copy_(G, Gb)
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(G, found, inv)
        torch._fused_adamw_(P, G, M, V, [], tsteps, amsgrad=False, maximize=False, found_inf=found, **HP)
        torch._foreach_copy_(C, P)
    fns["torch best (no host sync)"] = torch_best
    return fns


def run_layout(lay: str, args, dev, rows: list, out: dict) -> None:
    sizes = layout(lay, args.numel)
    n = sum(sizes)
    P, G, M, V, Gb, C = make_state(sizes, dev)
    out[f"{lay}/correctness"] = correctness(P, G, M, V, Gb, C)
    cn = min(args.copy_numel, n) if dev.type == "cpu" else args.copy_numel
    src, dst = torch.randn(cn, device=dev), torch.empty(cn, device=dev)
    roof = {"copy (roof)": lambda: dst.copy_(src)}
    for work, fns, base in (("bare", bare_fns(P, G, M, V, dev), "torch._fused_adamw_"),
                            ("mixed", mixed_fns(P, G, M, V, Gb, C, dev), "torch seq (_reference)")):
        res = bench({**fns, **roof}, args.reps, dev)
        copy_gbs = 8 * cn / res.pop("copy (roof)") / 1e9
        print(f"\n### {lay} layout ({len(sizes)} tensors, {n:,} elements), {work}: copy roof {copy_gbs:.0f} GB/s")
        out[f"{lay}/{work}/copy_gbs"] = copy_gbs
        for k, t in res.items():
            gbs = BPE * n / t / 1e9
            r = {"ms": t * 1e3, "gbs": gbs, "copy_fraction": gbs / copy_gbs, "base_over_this": res[base] / t}
            out[f"{lay}/{work}/{k}"] = r
            rows.append((f"{lay}/{work}", k, r))
            print(f"  {k:<28} {r['ms']:9.3f} ms {gbs:8.1f} GB/s {r['copy_fraction']:6.1%} of copy  "
                  f"{base} / this {r['base_over_this']:.3f}x")
        ratio = res[base] / res["ours"]
        frac = out[f"{lay}/{work}/ours"]["copy_fraction"]
        target = (f"{base} / ours = {ratio:.3f} (target >= 1.0), ours at {frac:.1%} of copy (target >= 90%)"
                  if work == "bare" else f"{base} / ours = {ratio:.3f} (target >= 1.5)")
        out[f"{lay}/{work}/target"] = target
        rows.append((f"{lay}/{work}", "TARGET", target))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1_000_000_000, help="fp32 parameters in all (default 1B)")
    ap.add_argument("--layouts", default="large,mixed", help="comma-separated: large, mixed")
    ap.add_argument("--reps", type=int, default=20, help="timed rounds; medians over them")
    ap.add_argument("--copy-numel", type=int, default=1 << 29, help="fp32 elements per copy buffer (2 GiB)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the code")
    ap.add_argument("--once", action="store_true", help="one warm-up + one launch of ours (bare, large), for ncu")
    ap.add_argument("--out", type=Path, default=None, help="write every figure here as JSON")
    args = ap.parse_args()
    if not set(args.layouts.split(",")) <= {"large", "mixed"}:
        ap.error(f"--layouts {args.layouts!r}: a comma-separated list of large, mixed")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"benchmarks/adam_cuda.py: no CUDA device (torch {torch.__version__}, torch.version.cuda="
              f"{torch.version.cuda}); it measures the CUDA kernel. For a CPU smoke test of the code paths: "
              "--device cpu --numel 200000", file=sys.stderr)
        return 2
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    info = ops.backend_info()
    if dev.type == "cuda" and not info["cuda"]:
        print("benchmarks/adam_cuda.py: fshard.ops was built without CUDA, so adamw_ cannot take CUDA tensors. "
              "It builds the .cu only when torch has CUDA and a toolkit is found (CUDA_HOME, or nvcc on PATH), "
              f"and FSHARD_OPS_NO_CUDA is unset. Build error: {info['error']}", file=sys.stderr)
        return 2
    if args.once:
        P, G, M, V = make_state(layout("large", args.numel), dev)[:4]
        f = ours(P, G, M, V, check_finite=False)
        f()  # warm-up: launch 0 of adamw_kernel
        sync(dev)
        f()  # the profiled launch (ncu --launch-skip 1 --launch-count 1)
        sync(dev)
        print(f"--once: two launches of fshard's adamw_kernel on {sum(p.numel() for p in P):,} elements")
        return 0
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    head = (f"device {name}, torch {torch.__version__} (CUDA {torch.version.cuda}), numel {args.numel:,}, "
            f"reps {args.reps}, fshard.ops {info['backend']} (cuda={info['cuda']}, cpu_isa={info['cpu_isa']})")
    print(head)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        print(f"GPU memory free {free / 2**30:.1f} of {total / 2**30:.1f} GiB; this run needs about "
              f"{args.numel * 42 / 2**30:.0f} GiB at its peak (state 20 B/elem, clones 14, reference temporaries 8)")
    out: dict = {"head": head, "device": name, "torch": torch.__version__, "numel": args.numel, "reps": args.reps}
    rows: list = []
    for lay in args.layouts.split(","):
        run_layout(lay, args, dev, rows, out)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    print(f"\n## Summary: {head}\n| layout/work | implementation | ms | GB/s (28 B/elem) | of copy | base / this |")
    print("|---|---|---|---|---|---|")
    for lw, k, r in rows:
        if k == "TARGET":
            print(f"| {lw} | **{r}** | | | | |")
        else:
            print(f"| {lw} | {k} | {r['ms']:.3f} | {r['gbs']:.1f} | {r['copy_fraction']:.1%} | "
                  f"{r['base_over_this']:.3f}x |")
    for lay in args.layouts.split(","):
        print(f"copy roof ({lay} rounds): bare {out[f'{lay}/bare/copy_gbs']:.0f} GB/s, "
              f"mixed {out[f'{lay}/mixed/copy_gbs']:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
