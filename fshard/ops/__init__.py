"""fshard.ops: native optimizer kernels (the fused AdamW update, and the gradient sum of squares).

``adamw_`` runs the whole AdamW update in one pass over memory: grad scaling (unscale or
clip coefficient), bf16/fp16 grad input, the update of fp32 params and moments, and an
optional bf16/fp16 copy of the new params. A read-only check over the grads runs first;
if any scaled grad is inf/NaN, nothing is modified and ``True`` is returned.

The kernels (``ops/*.cpp``, ``ops/*.cu``) are JIT-built with ninja on first use into a
per-user cache (see ``fshard.ops._build``); ``load()`` builds eagerly. Without a working
compiler, ``adamw_`` falls back to ``adamw_reference_`` (torch ops, several passes): it
warns once and counts the calls in ``metrics()["fallback_calls"]``. Set
``FSHARD_OPS_REQUIRE_NATIVE=1`` to make that an error instead.

``sq_norm`` sums x*x over gradient shards in float64 in one read pass, with the same result bits for
every CPU kernel and thread count; it has the same fallback (``sq_norm_reference``), and tensors on
other devices go to torch.

``norm_continue_`` repeats torch's CPU fp32 2-norm (what ``clip_grad_norm_`` computes per parameter) over the
parts of a parameter that different ranks hold, passing the running state from part to part; it has no fallback
(callers check ``native_available()``).

``adam_``, ``sgd_`` and ``adagrad_`` (``_classic.py``) are torch's single-tensor CPU arithmetic for
torch.optim.Adam/SGD/Adagrad in one pass, bitwise ``torch.optim.X()`` (design/OPS.md, "Single-tensor kernels");
they have no fallback (fs.optim runs torch's ops, the same bits, where the build is missing).

On the CPU the kernel is the best the CPU runs (AVX-512, else AVX2, else scalar); all three give
bit-identical results. ``FSHARD_OPS_CPU_ISA=avx2`` (or ``scalar``) caps it, as
``ATEN_CPU_CAPABILITY`` does for torch, e.g. on CPUs that clock down under 512-bit code; it is read once,
when the kernels load.
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

from ._build import BuildError, cache_root
from ._classic import adagrad_, adam_, sgd_
from ._reference import adamw_reference_, as_list, check_sq_norm_dtypes, sq_norm_reference
from ..errors import ArgumentError

__all__ = ["adamw_", "adam_", "sgd_", "adagrad_", "adamw_reference_", "sq_norm", "sq_norm_reference", "norm_continue_",
           "load", "native_available", "backend_info", "metrics", "cpu_isas", "BuildError", "cache_root"]

_lock = threading.Lock()
_lib = None
_error: BaseException | None = None
_warned = False
_cap = "auto"  # $FSHARD_OPS_CPU_ISA, read once when the kernels load (a running job keeps its kernel)
_metrics = {"native_calls": 0, "fallback_calls": 0, "found_inf": 0, "sq_norm_native_calls": 0,
            "sq_norm_fallback_calls": 0}


def load(verbose: bool = False):
    """Build (once, cached) and return the native extension module; raises BuildError."""
    global _lib, _error, _cap
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None and not verbose:
            raise _error
        from ._build import build

        try:
            lib = build(verbose=verbose)
        except BuildError as e:
            _error = e
            raise
        _cap = _capped_isa(lib)  # a bad value raises here, naming the variable, and nothing is loaded
        _lib = lib
        return _lib


def native_available() -> bool:
    """Whether the native kernels are built and loadable (builds them on first call)."""
    try:
        load()
        return True
    except BuildError:
        return False


def backend_info() -> dict:
    """Which backend adamw_ uses, the CPU kernel isa=None runs, CUDA support, and the build error if any."""
    ok = native_available()
    isa = _cap if ok else None
    return {
        "backend": "native" if ok else "reference",
        "cpu_isa": _lib.cpu_isas()[-1] if isa == "auto" else isa,
        "cuda": bool(_lib.built_with_cuda()) if ok else False,
        "error": None if ok else str(_error),
        "cache": str(cache_root()),
        **metrics(),
    }


def metrics() -> dict:
    """Call counters: native_calls, fallback_calls (torch reference), found_inf (adamw_), and
    sq_norm_native_calls, sq_norm_fallback_calls (sq_norm on CPU tensors without a native build)."""
    return dict(_metrics)


def _native():
    global _warned
    try:
        return load()
    except BuildError as e:
        if os.environ.get("FSHARD_OPS_REQUIRE_NATIVE", "") not in ("", "0"):
            raise
        if not _warned:
            _warned = True
            warnings.warn(f"{e}\nfshard.ops: falling back to the torch references (AdamW: several passes, "
                          "much slower); see fshard.ops.backend_info()", RuntimeWarning, stacklevel=3)
        return None


_ISAS = ("scalar", "avx2", "avx512")


def _capped_isa(lib) -> str:
    """'auto' (the best kernel the CPU runs), or the one $FSHARD_OPS_CPU_ISA caps it to (a cap above the CPU's
    best is no error). Called once, by load(): a change of the variable later does not change a running job."""
    cap = os.environ.get("FSHARD_OPS_CPU_ISA", "")
    if not cap:
        return "auto"
    if cap not in _ISAS:
        raise ArgumentError(f"FSHARD_OPS_CPU_ISA={cap!r} is not a CPU kernel; use one of {', '.join(_ISAS)} "
                            "or unset it")
    runs = list(lib.cpu_isas())
    return cap if cap in runs else runs[-1]


def cpu_isas() -> list[str]:
    """The CPU kernels this CPU runs, lowest first (e.g. ['scalar', 'avx2', 'avx512'])."""
    return list(load().cpu_isas())


def _cap_for(isa: str | None) -> str:
    """The CPU kernel an ``isa`` argument names: None/'auto' is the one ``$FSHARD_OPS_CPU_ISA`` caps to."""
    return _cap if isa in (None, "auto") else isa


def adamw_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float,
           eps: float, weight_decay: float, grad_scale: float = 1.0, param_copies=None,
           adam_w_mode: bool = True, check_finite: bool = True, isa: str | None = None, offsets=None) -> bool:
    """Fused in-place AdamW over lists of tensors (or single tensors / flat-shard slices).

    params, exp_avgs, exp_avg_sqs: fp32, contiguous. grads: fp32, bf16 or fp16, same numel as
    the param. param_copies: optional bf16/fp16 tensors that receive the updated params.
    ``step`` is the already-incremented step count. Per element, with g = grad * grad_scale:
    AdamW mode ``p *= 1 - lr*wd``; Adam-L2 mode ``g += wd*p``; then
    ``m = lerp(m, g, 1-beta1)``, ``v = beta2*v + (1-beta2)*g*g``,
    ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``.

    Returns True, modifying nothing, when check_finite and any g is inf/NaN. The GIL is released
    while the kernel runs. ``check_finite=False`` skips the read-only pre-pass over the grads, for
    callers that already know the grads are finite (e.g. from a finite grad norm). ``isa`` picks
    the CPU kernel: 'avx512', 'avx2', 'scalar', or None/'auto' for the best one the CPU runs, capped
    by ``$FSHARD_OPS_CPU_ISA``. A kernel the CPU cannot run is a ValueError. ``offsets``: one int per grad; then
    params, exp_avgs, exp_avg_sqs (and param_copies) are whole tensors and the update touches elements
    ``[offsets[i], offsets[i] + grads[i].numel())`` of each (a unit's flat tensors and its runs, without a view
    made a run: a one-rank update has a run a parameter).
    """
    p, g = as_list(params, "params"), as_list(grads, "grads", read_only=True)
    m, v = as_list(exp_avgs, "exp_avgs"), as_list(exp_avg_sqs, "exp_avg_sqs")
    c = as_list(param_copies, "param_copies")
    if offsets is not None and len(offsets) != len(g):
        raise ArgumentError(f"fshard.ops.adamw_: offsets has {len(offsets)} entries but grads has {len(g)}; pass one "
                            f"offset per grad or None")
    lib = _native()
    if lib is None and offsets is not None:  # (the reference takes views: the flat elements the kernel would)
        def at(ts, name):
            for i, (t, o, x) in enumerate(zip(ts, offsets, g)):
                if not 0 <= o <= t.numel() - x.numel():
                    raise ArgumentError(f"fshard.ops.adamw_: {name}[{i}] has {t.numel()} elements, too few for "
                                        f"offsets[{i}] = {o} and the {x.numel()} elements of grads[{i}]")
            return [t.view(-1)[o:o + x.numel()] for t, o, x in zip(ts, offsets, g)]
        p, m, v = at(p, "params"), at(m, "exp_avgs"), at(v, "exp_avg_sqs")
        c = at(c, "param_copies") if c else c
    if lib is None:
        _metrics["fallback_calls"] += 1
        found = adamw_reference_(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=weight_decay, grad_scale=grad_scale, param_copies=c,
                                 adam_w_mode=adam_w_mode, check_finite=check_finite)
    else:
        _metrics["native_calls"] += 1
        found = lib.adamw(p, g, m, v, c, int(step), float(lr), float(beta1), float(beta2), float(eps),
                          float(weight_decay), float(grad_scale), bool(adam_w_mode), bool(check_finite),
                          _cap if isa in (None, "auto") else isa, *(() if offsets is None else (list(offsets),)))
    if found:
        _metrics["found_inf"] += 1
    return found


def sq_norm(tensors, *, isa: str | None = None) -> float:
    """The sum over every element of every tensor of x*x, accumulated in float64, as a Python float.

    ``tensors``: a list of tensors, or one tensor; float32, bfloat16 or float16, contiguous (any shape; a 1-D
    slice of a flat shard is fine). Empty lists and tensors count 0.0. Any inf or NaN element makes the result
    inf or NaN; no finite element overflows (the square of the largest fp32 is about 1e77), so a finite result
    proves every element finite. On the CPU it is one read pass at memory speed, and the result is
    bit-identical for every CPU kernel and every ``torch.set_num_threads`` (design/OPS.md, "Sum of squares").
    ``isa`` as for ``adamw_``. Tensors on another device (CUDA) go to torch's
    ``vector_norm(t, dtype=float64) ** 2``, as does everything when the native build is unavailable (with the
    one-time warning; counted in ``metrics()["sq_norm_fallback_calls"]``). The GIL is released while the kernel
    runs.
    """
    ts = as_list(tensors, "tensors", "sq_norm", read_only=True)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in ts):
        return sq_norm_reference(ts)  # CUDA (or a mix): torch's own reduction, no fallback warning
    lib = _native()
    if lib is None:
        _metrics["sq_norm_fallback_calls"] += 1
        return sq_norm_reference(ts)
    check_sq_norm_dtypes(ts)
    _metrics["sq_norm_native_calls"] += 1
    return lib.sq_norm(ts, _cap if isa in (None, "auto") else isa)


def norm_continue_(xs: list, starts: list[int], totals: list[int], states: torch.Tensor) -> None:
    """Continue torch's CPU fp32 2-norm (``linalg.vector_norm``'s kernel, which ``clip_grad_norm_`` runs) over
    parts of parameters: ``xs[k]`` (float32, contiguous, CPU) holds elements ``[starts[k], starts[k] + numel)``
    of a flattened parameter of ``totals[k]`` elements, and ``states[k]`` (a float32 ``[len(xs), 8]`` CPU
    tensor, updated in place) carries the running state in and out: zeros before a parameter's first part; after
    its last part, ``states[k, 0]`` is the norm, bitwise torch's. Parts must be fed in element order; where they
    are cut does not change the bits (ops/torch_norm.cpp says which order torch sums in). Raises BuildError
    without the native build: there is no torch equivalent to fall back to."""
    load().norm_continue_(list(xs), [int(s) for s in starts], [int(t) for t in totals], states)
