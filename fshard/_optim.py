"""fs.adamw: AdamW over flat shards, with the arithmetic of torch.optim.AdamW.

An optimizer is a small frozen object with ``init`` (make the state of one unit's shard) and ``update`` (apply one
step to a shard, given which parameters got a gradient). ``update`` is ``plan`` (which runs of the shard move, at
which step count) followed by ``apply`` on each run; an update policy that streams the state in pieces
(``fs.offload_state``) calls those two itself. It works on the trainable prefix of a unit's shard; a
parameter with no gradient this step is skipped exactly as torch.optim.AdamW skips a parameter whose .grad is None:
no weight decay, no moment update and no step count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._layout import UnitLayout
from ._state import register_node
from ._errors import ArgumentError

_IMPLS = ("auto", "torch", "fused", "native")


@register_node
@dataclass(frozen=True)
class AdamWState:
    """AdamW state of one unit's shard. ``count[i]`` is the step count of the unit's i-th trainable parameter
    (torch keeps one per parameter too); the moments cover the trainable prefix of this rank's shard."""

    count: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@dataclass(frozen=True)
class AdamW:
    """AdamW with torch.optim.AdamW's arithmetic.

    ``impl``: "torch" replays torch's per-tensor (for-loop) kernel sequence, so it is bitwise equal to
    ``torch.optim.AdamW()`` on CPU; "fused" calls ``torch._fused_adamw_``, bitwise equal to
    ``torch.optim.AdamW(fused=True)``; "native" calls fshard.ops (one fused pass, SIMD/CUDA); "auto" picks
    native for fp32 state where it is built, else fused.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    impl: str = "auto"

    def __post_init__(self):
        if self.impl not in _IMPLS:
            raise ArgumentError(f"fs.adamw(impl={self.impl!r}) is not one of {_IMPLS}.")
        if not 0.0 <= self.betas[0] < 1.0 or not 0.0 <= self.betas[1] < 1.0:
            raise ArgumentError(f"fs.adamw(betas={self.betas}): each beta must be in [0, 1).")
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ArgumentError(f"fs.adamw: lr, eps and weight_decay must be >= 0, got {self}.")

    def init(self, layout: UnitLayout, rank: int, shard: torch.Tensor) -> AdamWState | None:
        n = layout.opt_numel(rank)
        if not layout.trainable:
            return None
        zeros = lambda: torch.zeros(n, dtype=shard.dtype, device=shard.device)  # noqa: E731
        return AdamWState(torch.zeros(len(layout.trainable), dtype=torch.int64), zeros(), zeros())

    def update(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor,
               state: AdamWState, active: list[bool], donate: bool,
               grad_scale: float = 1.0) -> tuple[torch.Tensor, AdamWState]:
        """One step on ``param`` (this rank's shard). ``active[i]``: trainable slot i got a gradient on some rank.
        The gradient is multiplied by ``grad_scale`` first (clipping), inside the kernel where it can be."""
        count, segments = self.plan(layout, rank, state.count, active)
        if not segments:
            return param, AdamWState(count, state.exp_avg, state.exp_avg_sq)
        if not donate:  # purity: the input state stays valid, so the update writes into copies
            param, m, v = param.clone(), state.exp_avg.clone(), state.exp_avg_sq.clone()
        else:
            m, v = state.exp_avg, state.exp_avg_sq
        for lo, hi, step in segments:
            self.apply(param[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], step, grad_scale)
        return param, AdamWState(count, m, v)

    def plan(self, layout: UnitLayout, rank: int, count: torch.Tensor,
             active: list[bool]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The new per-parameter step counts, and the ``(lo, hi, step)`` runs of this rank's shard that one update
        touches: the ranges of the parameters that got a gradient, adjacent ones with the same count merged."""
        count = count + torch.tensor(active, dtype=torch.int64)
        return count, _segments(layout.trainable_ranges(rank), active, count.tolist())

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """The implementation that runs for state of ``dtype`` on ``device`` ("auto": native for fp32 where it is
        built, else fused)."""
        return _resolve(self.impl, torch.device(device), dtype)

    def apply(self, p, g, m, v, step: int, grad_scale: float = 1.0) -> None:
        """One AdamW step, in place, on one run: parameter ``p``, gradient ``g`` (times ``grad_scale``), moments
        ``m`` and ``v``, all of the same length; ``step`` is the run's new step count."""
        lr, (b1, b2), eps, wd = self.lr, self.betas, self.eps, self.weight_decay
        impl = _resolve(self.impl, p.device, p.dtype)
        if grad_scale != 1.0 and impl != "native":
            g = g * grad_scale  # what clip_grad_norm_ does to .grad; the native kernel fuses it
        if impl == "fused":
            st = torch.tensor(float(step), device=p.device)
            torch._fused_adamw_([p], [g], [m], [v], [], [st], lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                                eps=eps, amsgrad=False, maximize=False)
        elif impl == "native":
            from . import ops
            # check_finite=False: like torch, a non-finite gradient propagates; skipping a step on every rank
            # consistently is a transform's job (it needs a collective), not the kernel's.
            ops.adamw_([p], [g], [m], [v], step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                       grad_scale=grad_scale, check_finite=False)
        else:  # torch.optim.adam._single_tensor_adam, decoupled weight decay, step as a Python float
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            step = float(step)
            bias_correction1 = 1 - b1**step
            bias_correction2 = 1 - b2**step
            step_size = lr / bias_correction1
            denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)


def _resolve(impl: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    if impl != "auto":
        return impl
    from . import ops
    if dtype != torch.float32:  # the native kernel keeps fp32 state; torch's fused one takes bf16/fp16 state too
        return "fused"
    if ops.native_available() and (device.type == "cpu" or ops.backend_info()["cuda"]):
        return "native"
    return "fused"  # no native build (no compiler): torch's fused kernel, still one pass; ops says why once


def _segments(ranges, active, counts) -> list[tuple[int, int, int]]:
    """Merge adjacent active slots with the same step count into (lo, hi, step) runs of the shard."""
    out: list[list[int]] = []
    for (lo, hi), on, c in zip(ranges, active, counts):
        if not on or hi <= lo:
            continue
        if out and out[-1][1] == lo and out[-1][2] == c:
            out[-1][1] = hi
        else:
            out.append([lo, hi, c])
    return [tuple(s) for s in out]


def adamw(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, impl: str = "auto") -> AdamW:
    """AdamW with the same math (and defaults) as ``torch.optim.AdamW``."""
    return AdamW(lr, tuple(betas), eps, weight_decay, impl)
