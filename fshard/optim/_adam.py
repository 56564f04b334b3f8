"""``fs.optim.adam`` (torch.optim.Adam: L2 weight decay added to the gradient, AMSGrad) and ``fs.optim.lion`` (Lion,
Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", as optax.lion defines it, with decoupled weight
decay) over flat shards, on the elementwise base (``_elementwise.py``)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ArgumentTypeError
from ._adamw import adam_moments
from ._elementwise import (Elementwise, check_single_tensor_impl, kernel_groups, native_fits,
                           resolve_single_tensor)
from ._protocol import Row

_Lr = float | Callable[[int], float]


@dataclass(frozen=True)
class Adam(Elementwise):
    """torch.optim.Adam: rows ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), counts saved as
    ``step``; the weight decay is L2 (added to the gradient, so it goes through the moments), unlike
    ``fs.adamw``'s. ``impl``: "auto" (the default) is "fused" on the CPU, else "torch"; "fused" is
    ``torch._fused_adam_``'s arithmetic (``torch.optim.Adam(fused=True)``: one pass, within 1e-6 of
    ``torch.optim.Adam()``), computed by fshard.ops' AdamW kernel in its L2 mode for fp32 state without amsgrad
    (faster on the same run), else by torch's kernel;
    "native" runs fshard.ops' single-tensor kernel (``ops.adam_``: torch's single-tensor arithmetic in one pass,
    bitwise ``torch.optim.Adam()`` on the CPU, but slower than fused: torch's float sqrt is MKL's, design/OPS.md);
    "torch" replays torch's single-tensor kernels (the same bits, several passes)."""

    lr: _Lr = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    impl: str = "auto"
    weight_decay_mask: Callable | None = None
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    label: ClassVar[str] = "fs.optim.adam"

    def __post_init__(self):
        check_single_tensor_impl(self)
        if not isinstance(self.amsgrad, bool):
            raise ArgumentTypeError(f"fs.optim.adam(amsgrad={self.amsgrad!r}) must be True or False.")
        self._check_betas(self.betas)
        self._check_common()
        self._check_nonnegative("eps", self.eps)

    @property
    def rows(self) -> tuple[Row, ...]:
        return (Row("exp_avg"), Row("exp_avg_sq")) + ((Row("max_exp_avg_sq"),) if self.amsgrad else ())

    def group_fields(self) -> dict:
        return {"betas": self.betas, "eps": self.eps, "weight_decay": None, "amsgrad": self.amsgrad,
                "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                "fused": None, "decoupled_weight_decay": False}

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        return resolve_single_tensor(self, device, dtype)

    apply = Elementwise.apply  # (defined here, beside apply_runs: optim._protocol.apply_runs's rule)

    def apply_runs(self, runs) -> None:
        """``apply`` on each run, the runs of the default on the CPU (fshard.ops' AdamW kernel in its Adam mode, as
        ``update_run`` takes them) in one call per step count, rate and decay (``kernel_groups``)."""
        def takes(p, g, rows):
            return (not self.amsgrad and self.resolved_impl(p.device, p.dtype) == "fused"
                    and native_fits(self, "native", p, *rows) and _native_grad(g))
        groups = kernel_groups(self, runs, takes)
        if not groups:
            return
        from .. import ops
        (b1, b2), eps = self.betas, self.eps
        for (step, lr, wd, *_), rs in groups.items():
            ops.adamw_([r[0] for r in rs], [r[1] for r in rs], [r[2][0] for r in rs], [r[2][1] for r in rs],
                       step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, adam_w_mode=False,
                       check_finite=False)

    def update_run(self, p, g, rows, step, lr, wd):
        m, v = rows[:2]
        vmax = rows[2] if self.amsgrad else None
        (b1, b2), eps = self.betas, self.eps
        impl = self.resolved_impl(p.device, p.dtype)
        if native_fits(self, impl, p, g, *rows):
            from .. import ops
            ops.adam_(p, g, m, v, vmax, step=float(step), lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
            return
        if impl == "fused" and vmax is None and native_fits(self, "native", p, m, v) and _native_grad(g):
            # torch._fused_adam_'s arithmetic in fshard.ops' AdamW kernel, its L2 mode (tests/test_ops.py holds it
            # to the fused Adam; faster than torch's kernel on the same run: benchmarks/RESULTS.md, "Session 28")
            from .. import ops
            ops.adamw_([p], [g], [m], [v], step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                       adam_w_mode=False, check_finite=False)
            return
        if impl == "fused":
            # (the fused kernel takes one dtype; torch's ops promote a bf16 gradient alike)
            g = g if g.dtype == p.dtype else g.to(p.dtype)
            st = torch.full((), float(step), device=p.device)  # (a fill: no blocking copy on a GPU)
            torch._fused_adam_([p], [g], [m], [v], [] if vmax is None else [vmax], [st], lr=lr, beta1=b1, beta2=b2,
                               weight_decay=wd, eps=eps, amsgrad=self.amsgrad, maximize=False)
            return
        if wd != 0:  # torch.optim.adam._single_tensor_adam, decoupled_weight_decay=False
            g = g.add(p, alpha=wd)
        adam_moments(p, g, m, v, vmax, float(step), lr, b1, b2, eps)


@dataclass(frozen=True)
class Lion(Elementwise):
    """Lion: ``c = b1 * m + (1 - b1) * g``; ``p <- p * (1 - lr * wd) - lr * sign(c)``; ``m <- b2 * m + (1 - b2) * g``.
    One row, ``exp_avg`` (the name lion-pytorch and optax's ``mu`` give it); no count is saved (Lion reads none)."""

    lr: _Lr = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    weight_decay_mask: Callable | None = None
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    label: ClassVar[str] = "fs.optim.lion"
    count_key: ClassVar[str | None] = None

    def __post_init__(self):
        self._check_betas(self.betas)
        self._check_common()

    @property
    def rows(self) -> tuple[Row, ...]:
        return (Row("exp_avg"),)

    def group_fields(self) -> dict:
        return {"betas": self.betas, "weight_decay": None}

    def update_run(self, p, g, rows, step, lr, wd):
        (m,) = rows
        b1, b2 = self.betas
        update = m.mul(b1).add_(g, alpha=1 - b1).sign_()  # the interpolation c, then its sign
        if wd != 0:
            p.mul_(1 - lr * wd)  # decoupled, as AdamW's
        p.add_(update, alpha=-lr)
        m.mul_(b2).add_(g, alpha=1 - b2)


def _native_grad(g: torch.Tensor) -> bool:
    """A gradient fshard.ops' AdamW kernel reads as it is (fp32, bf16 or fp16, contiguous, on the CPU), where the
    build is loaded."""
    from .. import ops
    return (g.dtype in (torch.float32, torch.bfloat16, torch.float16) and g.device.type == "cpu"
            and g.is_contiguous() and ops.native_available())


def adam(lr: _Lr = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
         amsgrad: bool = False, *, impl: str = "auto", weight_decay_mask: Callable | None = None) -> Adam:
    """torch.optim.Adam's arithmetic and defaults on flat shards (L2 weight decay); ``lr`` may be a schedule and
    ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay."""
    return Adam(lr, tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps, weight_decay, amsgrad, impl,
                weight_decay_mask)


def lion(lr: _Lr = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
         weight_decay_mask: Callable | None = None) -> Lion:
    """Lion (the sign of an interpolated momentum) with decoupled weight decay, as optax.lion defines it; ``lr``
    may be a schedule and ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay."""
    return Lion(lr, tuple(betas) if isinstance(betas, (tuple, list)) else betas, weight_decay, weight_decay_mask)
