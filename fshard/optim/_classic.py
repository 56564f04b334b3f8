"""``fs.optim.sgd``, ``fs.optim.adagrad`` and ``fs.optim.rmsprop``: torch.optim.SGD, Adagrad and RMSprop over flat
shards, each the arithmetic of torch's single-tensor implementation (``torch.optim.sgd._single_tensor_sgd`` etc.,
what torch runs on the CPU by default) kernel for kernel, so bitwise equal to it there (``impl="torch"``); SGD
and Adagrad also run it in one pass with fshard.ops' native single-tensor kernel (``impl="native"``); their default
is torch's fused kernel on the CPU (within 1e-6, design/OPS.md "Single-tensor kernels" says why). Their rows are torch's
state keys, present only where the hyperparameters call for them (SGD's ``momentum_buffer`` only with momentum,
RMSprop's ``momentum_buffer`` and ``grad_avg`` only with momentum and ``centered``); the elementwise base
(``_elementwise.py``) does the rest.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ArgumentError
from ._elementwise import (Elementwise, check_single_tensor_impl, fused_takes, kernel_groups, native_fits,
                           resolve_single_tensor)
from ._protocol import Row

_Lr = float | Callable[[int], float]


@dataclass(frozen=True)
class SGD(Elementwise):
    """torch.optim.SGD: L2 weight decay into the gradient, momentum with dampening, Nesterov, maximize. torch keeps
    no step count for it (``count_key`` None); its first update of a parameter starts the momentum buffer as a copy
    of the gradient, which the per-parameter count tells (a count restored from a checkpoint is 1 where the
    checkpoint holds the buffer: all SGD reads of it)."""

    lr: _Lr = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    weight_decay_mask: Callable | None = None
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    impl: str = "auto"
    label: ClassVar[str] = "fs.optim.sgd"
    count_key: ClassVar[str | None] = None

    def __post_init__(self):
        check_single_tensor_impl(self)
        self._check_common()
        self._check_nonnegative("momentum", self.momentum)
        if not isinstance(self.dampening, (int, float)) or isinstance(self.dampening, bool):
            raise ArgumentError(f"fs.optim.sgd(dampening={self.dampening!r}) must be a number.")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ArgumentError("fs.optim.sgd(nesterov=True) needs momentum > 0 and dampening=0 (as torch.optim.SGD).")

    @property
    def rows(self) -> tuple[Row, ...]:
        return (Row("momentum_buffer"),) if self.momentum != 0 else ()

    def group_fields(self) -> dict:
        return {"momentum": self.momentum, "dampening": self.dampening, "weight_decay": None,
                "nesterov": self.nesterov, "maximize": self.maximize, "foreach": None, "differentiable": False,
                "fused": None}

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        return resolve_single_tensor(self, device, dtype)

    apply = Elementwise.apply  # (defined here, beside apply_runs: optim._protocol.apply_runs's rule)

    def apply_runs(self, runs) -> None:
        """``apply`` on each run, the runs torch's fused kernel takes (impl "fused") in one call per step count,
        rate and decay (``kernel_groups``), as torch.optim.SGD(fused=True) takes a model's parameters."""
        for (step, lr, wd, *_), rs in kernel_groups(self, runs, fused_takes(self)).items():
            torch._fused_sgd_([r[0] for r in rs], [r[1] for r in rs], [r[2][0] for r in rs] if self.rows else [],
                              weight_decay=wd, momentum=self.momentum, lr=lr, dampening=self.dampening,
                              nesterov=self.nesterov, maximize=self.maximize, is_first_step=step == 1)

    def update_run(self, p, g, rows, step, lr, wd):  # torch.optim.sgd._single_tensor_sgd
        impl = self.resolved_impl(p.device, p.dtype)
        if native_fits(self, impl, p, g, *rows):
            from .. import ops
            ops.sgd_(p, g, *rows, first=step == 1, lr=lr, momentum=self.momentum, dampening=self.dampening,
                     weight_decay=wd, nesterov=self.nesterov, maximize=self.maximize)
            return
        if impl == "fused":  # torch.optim.SGD(fused=True)'s kernel: one pass over the run
            # (it takes one dtype; torch's ops promote a bf16 gradient alike)
            g = g if g.dtype == p.dtype else g.to(p.dtype)
            torch._fused_sgd_([p], [g], list(rows), weight_decay=wd, momentum=self.momentum, lr=lr,
                              dampening=self.dampening, nesterov=self.nesterov, maximize=self.maximize,
                              is_first_step=step == 1)
            return
        grad = g if not self.maximize else -g
        if wd != 0:
            grad = grad.add(p, alpha=wd)
        if self.momentum != 0:
            (buf,) = rows
            if step == 1:  # torch: no buffer yet, so it becomes a copy of the gradient
                buf.copy_(grad)
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        p.add_(grad, alpha=-lr)


@dataclass(frozen=True)
class Adagrad(Elementwise):
    """torch.optim.Adagrad: the row ``sum`` starts at ``initial_accumulator_value``, and torch makes every
    parameter's state when it is built (``eager_state``: a checkpoint lists the parameters never updated, at step 0)."""

    lr: _Lr = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    maximize: bool = False
    weight_decay_mask: Callable | None = None
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    impl: str = "auto"
    label: ClassVar[str] = "fs.optim.adagrad"
    eager_state: ClassVar[bool] = True

    def __post_init__(self):
        check_single_tensor_impl(self)
        self._check_common()
        for what in ("lr_decay", "eps", "initial_accumulator_value"):
            self._check_nonnegative(what, getattr(self, what))

    @property
    def rows(self) -> tuple[Row, ...]:
        return (Row("sum", init=float(self.initial_accumulator_value)),)

    def group_fields(self) -> dict:
        return {"lr_decay": self.lr_decay, "eps": self.eps, "weight_decay": None,
                "initial_accumulator_value": self.initial_accumulator_value, "foreach": None,
                "maximize": self.maximize, "differentiable": False, "fused": None}

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        return resolve_single_tensor(self, device, dtype)

    apply = Elementwise.apply  # (defined here, beside apply_runs: optim._protocol.apply_runs's rule)

    def apply_runs(self, runs) -> None:
        """``apply`` on each run, the runs torch's fused kernel takes (impl "fused") in one call per step count,
        rate and decay (``kernel_groups``), as torch.optim.Adagrad(fused=True) takes a model's parameters."""
        for (step, lr, wd, *_), rs in kernel_groups(self, runs, fused_takes(self)).items():
            steps = [torch.tensor(float(step)) for _ in rs]  # (its step: the count after this one)
            torch._fused_adagrad_([r[0] for r in rs], [r[1] for r in rs], [r[2][0] for r in rs], steps, lr=lr,
                                  lr_decay=self.lr_decay, weight_decay=wd, eps=self.eps, maximize=self.maximize)

    def update_run(self, p, g, rows, step, lr, wd):  # torch.optim.adagrad._single_tensor_adagrad (dense)
        (state_sum,) = rows
        impl = self.resolved_impl(p.device, p.dtype)
        if native_fits(self, impl, p, g, state_sum):
            from .. import ops
            ops.adagrad_(p, g, state_sum, step=float(step), lr=lr, lr_decay=self.lr_decay, weight_decay=wd,
                         eps=self.eps, maximize=self.maximize)
            return
        if impl == "fused":  # torch.optim.Adagrad(fused=True)'s kernel (its step: the count after this one)
            # (it takes one dtype; torch's ops promote a bf16 gradient alike)
            g = g if g.dtype == p.dtype else g.to(p.dtype)
            torch._fused_adagrad_([p], [g], [state_sum], [torch.tensor(float(step))], lr=lr, lr_decay=self.lr_decay,
                                  weight_decay=wd, eps=self.eps, maximize=self.maximize)
            return
        grad = g if not self.maximize else -g
        if wd != 0:
            grad = grad.add(p, alpha=wd)
        clr = lr / (1 + (float(step) - 1) * self.lr_decay)
        state_sum.addcmul_(grad, grad, value=1)
        std = state_sum.sqrt().add_(self.eps)
        p.addcdiv_(grad, std, value=-clr)


@dataclass(frozen=True)
class RMSprop(Elementwise):
    """torch.optim.RMSprop: rows ``square_avg``, then ``momentum_buffer`` (momentum > 0) and ``grad_avg``
    (``centered``), as torch names and orders them."""

    lr: _Lr = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False
    weight_decay_mask: Callable | None = None
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    label: ClassVar[str] = "fs.optim.rmsprop"

    def __post_init__(self):
        self._check_common()
        for what in ("alpha", "eps", "momentum"):
            self._check_nonnegative(what, getattr(self, what))

    @property
    def rows(self) -> tuple[Row, ...]:
        return ((Row("square_avg"),) + ((Row("momentum_buffer"),) if self.momentum > 0 else ())
                + ((Row("grad_avg"),) if self.centered else ()))

    def group_fields(self) -> dict:
        return {"momentum": self.momentum, "alpha": self.alpha, "eps": self.eps, "centered": self.centered,
                "weight_decay": None, "capturable": False, "foreach": None, "maximize": self.maximize,
                "differentiable": False}

    def update_run(self, p, g, rows, step, lr, wd):  # torch.optim.rmsprop._single_tensor_rmsprop
        rows = list(rows)
        square_avg = rows.pop(0)
        buf = rows.pop(0) if self.momentum > 0 else None
        grad_avg = rows.pop(0) if self.centered else None
        grad = g if not self.maximize else -g
        if wd != 0:
            grad = grad.add(p, alpha=wd)
        square_avg.mul_(self.alpha).addcmul_(grad, grad, value=1 - self.alpha)
        if grad_avg is not None:
            grad_avg.lerp_(grad if grad.dtype == grad_avg.dtype else grad.to(grad_avg.dtype), 1 - self.alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        avg = avg.add_(self.eps)
        if buf is not None:
            buf.mul_(self.momentum).addcdiv_(grad, avg)
            p.add_(buf, alpha=-lr)
        else:
            p.addcdiv_(grad, avg, value=-lr)


def sgd(lr: _Lr = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, *, maximize: bool = False, weight_decay_mask: Callable | None = None,
        impl: str = "auto") -> SGD:
    """torch.optim.SGD's arithmetic and defaults on flat shards; ``lr`` may be a schedule (``fs.schedules``) and
    ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay. ``impl``: "auto" (the default)
    is "fused" on the CPU (torch's ``fused=True`` kernel, one pass, within 1e-6), else "torch"; "native" fshard.ops'
    single-tensor kernel (``ops.sgd_``: torch's single-tensor arithmetic in one pass, bitwise ``torch.optim.SGD()``
    on the CPU; torch's ops where it cannot run, the same bits); "torch" its single-tensor kernels (the same bits,
    several passes); "fused" as "auto" on the CPU."""
    return SGD(lr, momentum, dampening, weight_decay, nesterov, maximize, weight_decay_mask, impl=impl)


def adagrad(lr: _Lr = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
            eps: float = 1e-10, *, maximize: bool = False, weight_decay_mask: Callable | None = None,
            impl: str = "auto") -> Adagrad:
    """torch.optim.Adagrad's arithmetic and defaults (and argument order) on flat shards; ``lr`` may be a schedule
    and ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay. ``impl`` as for ``sgd``, but
    "auto" (the default) is "fused" on the CPU (``torch.optim.Adagrad(fused=True)``'s kernel, within 1e-6), as for
    ``adam``; "native" and "torch" are bitwise ``torch.optim.Adagrad()``."""
    return Adagrad(lr, lr_decay, weight_decay, eps, initial_accumulator_value, maximize, weight_decay_mask,
                   impl=impl)


def rmsprop(lr: _Lr = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
            centered: bool = False, *, maximize: bool = False, weight_decay_mask: Callable | None = None) -> RMSprop:
    """torch.optim.RMSprop's arithmetic and defaults (and argument order) on flat shards; ``lr`` may be a schedule
    and ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay."""
    return RMSprop(lr, alpha, eps, weight_decay, momentum, centered, maximize, weight_decay_mask)
