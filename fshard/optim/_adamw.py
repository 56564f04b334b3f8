"""fs.adamw: AdamW over flat shards, with the arithmetic of torch.optim.AdamW: one implementation of the optimizer
protocol (``_protocol.py``) on the elementwise base (``_elementwise.py``: the plan, ``update``, the param groups).
It declares two rows, ``exp_avg`` and ``exp_avg_sq`` (in the parameters' dtype, as torch keeps them; with
``amsgrad`` a third, ``max_exp_avg_sq``), and saves its counts as torch's ``step``; its state node, ``AdamWState``,
names the two as fields (with amsgrad the state is an ``OptState``). ``update`` is ``plan`` (which runs of the shard
move, at which step count) followed by ``apply`` on each run; an update policy that streams the rows in pieces
(``fs.offload_state``) calls those two itself. It works on the trainable prefix of a unit's shard; a parameter with
no gradient this step is skipped exactly as torch.optim.AdamW skips a parameter whose .grad is None: no weight
decay, no moment update and no step count.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..state._train_state import register_node
from ._elementwise import Elementwise, pieces
from ._protocol import OptState, Row

_IMPLS = ("auto", "torch", "fused", "native")


@register_node
@dataclass(frozen=True)
class AdamWState:
    """AdamW state of one unit's shard. ``count[i]`` is the step count of the unit's i-th trainable parameter
    (torch keeps one per parameter too); the moments cover the trainable prefix of this rank's shard. ``rows`` and
    ``with_rows`` are the protocol's view of it (``UnitOptState``): the moments in AdamW's declared order."""

    count: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @property
    def rows(self) -> tuple:
        return self.exp_avg, self.exp_avg_sq

    def with_rows(self, count: torch.Tensor, rows) -> "AdamWState":
        m, v = rows
        return AdamWState(count, m, v)


@dataclass(frozen=True)
class AdamW(Elementwise):
    """AdamW with torch.optim.AdamW's arithmetic.

    ``impl``: "torch" replays torch's per-tensor (for-loop) kernel sequence, so it is bitwise equal to
    ``torch.optim.AdamW()`` on CPU; "fused" calls ``torch._fused_adamw_``, bitwise equal to
    ``torch.optim.AdamW(fused=True)``; "native" calls fshard.ops (one fused pass, SIMD/CUDA); "auto" picks
    native for fp32 state where it is built, else fused.

    ``lr``: a float, or a schedule ``lr(count) -> float`` where ``count`` is the number of updates already
    applied (``state.step``: 0 for the first update, as torch's ``LambdaLR`` counts; a skipped step applies none), so
    a resumed state continues its schedule (``fs.schedules`` has the usual ones).
    ``weight_decay_mask``: ``mask(name, param) -> bool`` decides which parameters decay (canonical names as
    ``model.named_parameters()`` gives them, and the template's parameter), as torch's param groups do;
    ``fs.init`` evaluates it once into ``decay`` (the names that decay; None: all of them).
    ``amsgrad``: torch's AMSGrad variant, a third row ``max_exp_avg_sq`` (the state is then an ``OptState``); the
    native kernel has none, so "auto" runs fused.
    """

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    impl: str = "auto"
    weight_decay_mask: Callable | None = None
    amsgrad: bool = False
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    # the protocol's declarations (_protocol.Optimizer): the rows (below), the checkpoint key of the counts, and the
    # type of one unit's state, which state.replace checks opt_state's entries against (fshard/state/_check.py)
    label: ClassVar[str] = "fs.adamw"
    count_key: ClassVar[str | None] = "step"

    def __post_init__(self):
        if self.impl not in _IMPLS:
            raise ArgumentError(f"fs.adamw(impl={self.impl!r}) is not one of {_IMPLS}.")
        if not isinstance(self.amsgrad, bool):
            raise ArgumentTypeError(f"fs.adamw(amsgrad={self.amsgrad!r}) must be True or False.")
        if self.amsgrad and self.impl == "native":
            raise ArgumentError("fs.adamw(amsgrad=True, impl='native'): the native kernel has no AMSGrad; use "
                                "impl='fused' or 'torch' (or 'auto', which picks fused).")
        self._check_betas(self.betas)
        self._check_common()
        self._check_nonnegative("eps", self.eps)

    @property
    def rows(self) -> tuple[Row, ...]:
        """``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), in the parameters' dtype."""
        return _ROWS + ((Row("max_exp_avg_sq"),) if self.amsgrad else ())

    @property
    def state_type(self) -> type:
        return OptState if self.amsgrad else AdamWState

    def _node(self, count, rows):
        return super()._node(count, rows) if self.amsgrad else AdamWState(count, *rows)

    def group_fields(self) -> dict:
        return {"betas": self.betas, "eps": self.eps, "weight_decay": None, "amsgrad": self.amsgrad,
                "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                "decoupled_weight_decay": True}

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """The implementation that runs for state of ``dtype`` on ``device`` ("auto": native for fp32 where it is
        built, else fused; fused with amsgrad)."""
        return _resolve("fused" if self.amsgrad and self.impl == "auto" else self.impl, torch.device(device), dtype)

    def apply(self, p, g, m, v, *rest, lr: float | None = None, weight_decay: float | None = None,
              copy: torch.Tensor | None = None) -> None:
        """One AdamW step, in place, on one run: ``apply(p, g, m, v, [max_v,] step, grad_scale=1.0, ...)``:
        parameter ``p``, gradient ``g`` (times ``grad_scale``), moments ``m`` and ``v`` (and ``max_v`` with
        amsgrad), all of the same length; ``step`` is the run's new step count. ``lr`` and ``weight_decay`` (a
        run's, from ``lr_at`` and ``plan``) default to the optimizer's own (``lr`` must then be a float).
        ``copy``: a bf16/fp16 tensor of the same length that receives the new ``p``, rounded to nearest as
        ``p.to(copy.dtype)`` rounds (the native kernel writes it in its pass; the others cast after it)."""
        vmax, rest = (rest[0], rest[1:]) if self.amsgrad else (None, rest)
        if len(rest) not in (1, 2):
            raise ArgumentError(f"fs.adamw.apply(p, g, *{tuple(r.name for r in self.rows)}, step, grad_scale=1.0): "
                                f"got {len(rest)} arguments after the rows.")
        step, grad_scale = rest[0], (rest[1] if len(rest) == 2 else 1.0)
        (b1, b2), eps = self.betas, self.eps
        if lr is None and callable(self.lr):
            raise ArgumentError("AdamW.apply: this optimizer's lr is a schedule; pass the run's lr (from plan(), "
                                "which reads the schedule at the state's step count).")
        lr = float(self.lr) if lr is None else lr
        wd = self.weight_decay if weight_decay is None else weight_decay
        impl = self.resolved_impl(p.device, p.dtype)
        if grad_scale != 1.0 and impl == "fused":
            g = g * grad_scale  # what clip_grad_norm_ does to .grad (the native kernel fuses it; "torch": per piece)
        if impl == "fused":
            st = torch.full((), float(step), device=p.device)  # (a fill: no blocking copy on a GPU)
            torch._fused_adamw_([p], [g], [m], [v], [] if vmax is None else [vmax], [st], lr=lr, beta1=b1, beta2=b2,
                                weight_decay=wd, eps=eps, amsgrad=self.amsgrad, maximize=False)
        elif impl == "native":
            from .. import ops
            # check_finite=False: like torch, a non-finite gradient propagates; skipping a step on every rank
            # consistently is a transform's job (it needs a collective), not the kernel's.
            fused = copy is not None and copy.dtype in (torch.bfloat16, torch.float16)  # the kernel's copy dtypes
            ops.adamw_([p], [g], [m], [v], step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                       grad_scale=grad_scale, param_copies=[copy] if fused else None, check_finite=False)
            if fused:
                return
        else:  # torch.optim.adam._single_tensor_adam, decoupled weight decay, step as a Python float; in pieces
            rows = (m, v) if vmax is None else (m, v, vmax)  # (_elementwise.torch_ops_piece)
            for pp, gg, (mm, vv, *mx), _ in pieces(p, g, rows, None, self.piece(p)):
                gg = gg if grad_scale == 1.0 else gg * grad_scale  # (a piece-sized temporary, not a run-sized one)
                pp.mul_(1 - lr * wd)
                adam_moments(pp, gg, mm, vv, mx[0] if mx else None, float(step), lr, b1, b2, eps)
        if copy is not None:
            copy.copy_(p)

    def apply_runs(self, runs) -> None:
        """``apply`` on each of ``runs`` (``(p, g, rows, step, grad_scale, lr, weight_decay, copy)``, disjoint),
        through the native kernel in one call per distinct (step, grad_scale, lr, weight_decay, copy or not): the
        same bits as a call per run (the kernel is elementwise), with one release of the GIL for them all. The
        runs another implementation takes, or with a copy the kernel does not write, go through ``apply``."""
        for p, g, rows, step, scale, lr, wd, copy in self._native(runs, offsets=False):
            self.apply(p, g, *rows, step, scale, lr=lr, weight_decay=wd, copy=copy)

    def apply_spans(self, spans) -> None:
        """``Elementwise.apply_spans`` through the native kernel with each run's offset into its unit's tensors:
        no view made a run (a one-rank update has a run a parameter, 221 for the 1B GPT: about 2.5 us a view, four
        a run; benchmarks/RESULTS.md, session 50). The runs ``apply_runs`` would not give the kernel, and every
        run of a subclass that overrides ``apply`` or ``apply_runs``, go through views as in Elementwise."""
        if type(self).apply is not AdamW.apply or type(self).apply_runs is not AdamW.apply_runs:
            return super().apply_spans(spans)
        rest = self._native(spans, offsets=True)
        if rest:
            super().apply_spans(rest)

    def _native(self, runs, offsets: bool) -> list:
        """The native kernel on the ``runs`` it takes (``apply_runs``' tuples, or with ``offsets`` ``apply_spans``'
        with the offset last), one call per (step, grad_scale, lr, weight_decay, copy or not, device); returns the
        others (AMSGrad, no rate given, a copy the kernel does not write, another implementation)."""
        groups: dict = {}
        rest, impls = [], {}  # impls: (device, dtype) -> the implementation that runs (resolved once, not once a run)
        for run in runs:
            p, step, scale, lr, wd, copy = run[0], *run[3:8]
            impl = impls.get((p.device, p.dtype))
            if impl is None:
                impl = impls[(p.device, p.dtype)] = self.resolved_impl(p.device, p.dtype)
            fused = copy is None or copy.dtype in (torch.bfloat16, torch.float16)
            if self.amsgrad or lr is None or wd is None or not fused or impl != "native":
                rest.append(run)
                continue
            groups.setdefault((step, scale, lr, wd, copy is None, p.device), []).append(run)
        if groups:
            from .. import ops
            (b1, b2), eps = self.betas, self.eps
            for (step, scale, lr, wd, no_copy, _), rs in groups.items():
                ops.adamw_([r[0] for r in rs], [r[1] for r in rs], [r[2][0] for r in rs], [r[2][1] for r in rs],
                           step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, grad_scale=scale,
                           param_copies=None if no_copy else [r[7] for r in rs], check_finite=False,
                           offsets=[r[8] for r in rs] if offsets else None)
        return rest


_ROWS = (Row("exp_avg"), Row("exp_avg_sq"))


def adam_moments(p, g, m, v, vmax, step: float, lr: float, b1: float, b2: float, eps: float) -> None:
    """torch.optim.adam._single_tensor_adam after its weight decay (non-capturable): the moments, AMSGrad's
    maximum where ``vmax`` is a row, and the parameter's step, kernel for kernel (so bitwise equal on CPU)."""
    g = g if g.dtype == m.dtype else g.to(m.dtype)  # (lerp_ takes one dtype; the others promote a bf16 gradient alike)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bias_correction1 = 1 - b1**step
    bias_correction2 = 1 - b2**step
    step_size = lr / bias_correction1
    if vmax is not None:
        torch.maximum(vmax, v, out=vmax)
    # torch's (v.sqrt() / bias_correction2_sqrt).add_(eps), the division in place (the same kernel, one buffer fewer)
    denom = (v if vmax is None else vmax).sqrt().div_(bias_correction2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def _resolve(impl: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    if impl != "auto":
        return impl
    from .. import ops
    if dtype != torch.float32:  # the native kernel keeps fp32 state; torch's fused one takes bf16/fp16 state too
        return "fused"
    if ops.native_available() and (device.type == "cpu" or ops.backend_info()["cuda"]):
        return "native"
    return "fused"  # no native build (no compiler): torch's fused kernel, still one pass; ops says why once


def adamw(lr: float | Callable[[int], float] = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, impl: str = "auto", weight_decay_mask: Callable | None = None,
          amsgrad: bool = False) -> AdamW:
    """AdamW with the same math (and defaults) as ``torch.optim.AdamW``; ``lr`` may be a schedule and
    ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay (see ``AdamW``)."""
    return AdamW(lr, tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps, weight_decay, impl,
                 weight_decay_mask, amsgrad)
