"""fs.adamw: AdamW over flat shards, with the arithmetic of torch.optim.AdamW: one implementation of the optimizer
protocol (``_protocol.py``). It declares two rows, ``exp_avg`` and ``exp_avg_sq`` (in the parameters' dtype, as
torch keeps them), and saves its counts as torch's ``step``; its state node, ``AdamWState``, names them as fields.
``update`` is ``plan`` (which runs of the shard move, at which step count) followed by ``apply`` on each run; an
update policy that streams the rows in pieces (``fs.offload_state``) calls those two itself. It works on the trainable prefix of a unit's shard; a
parameter with no gradient this step is skipped exactly as torch.optim.AdamW skips a parameter whose .grad is None:
no weight decay, no moment update and no step count.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..state._flat import UnitLayout
from ..state._train_state import register_node
from ._protocol import Row

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
class AdamW:
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
    """

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    impl: str = "auto"
    weight_decay_mask: Callable | None = None
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    # the protocol's declarations (_protocol.Optimizer): the rows, the checkpoint key of the counts, and the type
    # of one unit's state, which state.replace checks opt_state's entries against (fshard/state/_check.py)
    rows: ClassVar[tuple[Row, ...]] = (Row("exp_avg"), Row("exp_avg_sq"))
    count_key: ClassVar[str | None] = "step"
    state_type: ClassVar[type] = AdamWState

    def __post_init__(self):
        if self.impl not in _IMPLS:
            raise ArgumentError(f"fs.adamw(impl={self.impl!r}) is not one of {_IMPLS}.")
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2 and all(map(_number, self.betas))):
            raise ArgumentTypeError(f"fs.adamw(betas={self.betas!r}): betas must be two numbers, e.g. (0.9, 0.95).")
        if not 0.0 <= self.betas[0] < 1.0 or not 0.0 <= self.betas[1] < 1.0:
            raise ArgumentError(f"fs.adamw(betas={self.betas}): each beta must be in [0, 1).")
        if not callable(self.lr) and not _number(self.lr):
            raise ArgumentTypeError(f"fs.adamw(lr={self.lr!r}): lr must be a number or a schedule lr(count) -> "
                                    "float, e.g. fs.schedules.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000).")
        for what, v in (("eps", self.eps), ("weight_decay", self.weight_decay)) + (
                (("lr", self.lr),) if not callable(self.lr) else ()):
            if not _number(v) or not math.isfinite(v) or v < 0:  # nan would pass a plain v < 0 and ruin training
                raise ArgumentError(f"fs.adamw({what}={v!r}): lr, eps and weight_decay must be finite numbers >= 0.")
        if self.weight_decay_mask is not None and not callable(self.weight_decay_mask):
            raise ArgumentTypeError(f"fs.adamw(weight_decay_mask={self.weight_decay_mask!r}) must be a callable "
                                    "mask(name, param) -> bool, e.g. lambda name, p: p.ndim >= 2.")

    def lr_at(self, count: int) -> float:
        """The learning rate of the update that follows ``count`` applied updates."""
        if not callable(self.lr):
            return float(self.lr)
        lr = self.lr(count)
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
            raise ArgumentError(f"fs.adamw: the learning-rate schedule {self.lr!r} returned {lr!r} for count "
                                f"{count}; a schedule must return a finite number >= 0.")
        return float(lr)

    def fingerprint(self, count: int) -> tuple:
        """What every rank must agree on for the update that follows ``count`` updates: the hyperparameters (the
        schedule's value at ``count``, not the schedule object, whose repr differs between processes), the
        implementation, and the parameters that decay. The step's rank check compares it (fshard/dist/_agreement.py)."""
        return (self.lr_at(count), *self._static_fingerprint)

    @functools.cached_property
    def _static_fingerprint(self) -> tuple:
        """The part that never changes, made once (the decaying names as their count and a hash, not sorted and
        hashed at every step)."""
        decay = None if self.decay is None else (len(self.decay), zlib.crc32(repr(sorted(self.decay)).encode()))
        return tuple(self.betas), self.eps, self.weight_decay, self.impl, decay

    def bind(self, model: torch.nn.Module) -> "AdamW":
        """This optimizer with ``weight_decay_mask`` evaluated on ``model``'s parameters (``fs.init`` calls it)."""
        if self.weight_decay_mask is None:
            return self
        decay = []
        for name, p in model.named_parameters():
            on = self.weight_decay_mask(name, p)
            if not isinstance(on, bool):
                raise ArgumentTypeError(f"fs.adamw: weight_decay_mask({name!r}, param) returned {on!r}; it must "
                                        "return True (decay this parameter) or False.")
            if on:
                decay.append(name)
        return dataclasses.replace(self, decay=frozenset(decay))

    def decays(self, layout: UnitLayout) -> list[float]:
        """The weight decay of each trainable slot of ``layout``."""
        return [self.weight_decay if self.decay is None or s.name in self.decay else 0.0 for s in layout.trainable]

    def param_groups(self, layouts, updates: int) -> list[dict]:
        """torch.optim.AdamW's ``param_groups`` over the trainable parameters of ``layouts`` at ``updates`` applied
        updates (a schedule's rate there): one group per weight decay, every trainable name in one (a checkpoint's
        ``optim.param_groups``, as ``get_optimizer_state_dict`` writes them)."""
        groups: dict = {}
        for u in layouts:
            for wd, s in zip(self.decays(u), u.trainable):
                groups.setdefault(wd, []).append(s.name)
        lr = self.lr if not callable(self.lr) else self.lr_at(updates)
        return [{"lr": lr, "betas": self.betas, "eps": self.eps, "weight_decay": wd, "amsgrad": False,
                 "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "decoupled_weight_decay": True, "params": names} for wd, names in groups.items()]

    def init(self, layout: UnitLayout, rank: int, shard: torch.Tensor) -> AdamWState | None:
        n = layout.opt_numel(rank)
        if not layout.trainable:
            return None
        zeros = lambda: torch.zeros(n, dtype=shard.dtype, device=shard.device)  # noqa: E731
        return AdamWState(torch.zeros(len(layout.trainable), dtype=torch.int64), zeros(), zeros())

    def update(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor,
               state: AdamWState, active: list[bool], donate: bool, grad_scale: float = 1.0, updates: int = 0,
               copy: torch.Tensor | None = None) -> tuple[torch.Tensor, AdamWState, torch.Tensor | None]:
        """One step on ``param`` (this rank's shard). ``active[i]``: trainable slot i got a gradient on some rank.
        The gradient is multiplied by ``grad_scale`` first (clipping), inside the kernel where it can be.
        ``updates``: the updates applied so far (``state.step``), for a learning-rate schedule. ``copy``: a
        low-precision copy of ``param`` (``TrainState.copies``), kept equal to the cast of the new parameter in the
        same pass. Returns the new parameter, state and copy (the given ones where nothing changed)."""
        count, segments = self.plan(layout, rank, state.count, active, updates)
        if not segments:
            return param, AdamWState(count, state.exp_avg, state.exp_avg_sq), copy
        if not donate:  # purity: the input state stays valid, so the update writes into copies
            param, m, v = param.clone(), state.exp_avg.clone(), state.exp_avg_sq.clone()
            copy = None if copy is None else copy.clone()
        else:
            m, v = state.exp_avg, state.exp_avg_sq
        for lo, hi, step, lr, wd in segments:
            self.apply(param[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], step, grad_scale, lr=lr, weight_decay=wd,
                       copy=None if copy is None else copy[lo:hi])
        return param, AdamWState(count, m, v), copy

    def plan(self, layout: UnitLayout, rank: int, count: torch.Tensor, active: list[bool],
             updates: int = 0) -> tuple[torch.Tensor, list[tuple[int, int, int, float, float]]]:
        """The new per-parameter step counts, and the ``(lo, hi, step, lr, weight_decay)`` runs of this rank's shard
        that one update touches: the ranges of the parameters that got a gradient, adjacent ones with the same count
        and decay merged (a decay mask splits runs, not passes: each run is one kernel call). ``updates``: the
        updates applied so far (``state.step``), which a learning-rate schedule reads."""
        count = count + torch.tensor(active, dtype=torch.int64)
        lr = self.lr_at(updates)
        runs = _segments(layout.trainable_ranges(rank), active, count.tolist(), self.decays(layout))
        return count, [(lo, hi, c, lr, wd) for lo, hi, c, wd in runs]

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """The implementation that runs for state of ``dtype`` on ``device`` ("auto": native for fp32 where it is
        built, else fused)."""
        return _resolve(self.impl, torch.device(device), dtype)

    def apply(self, p, g, m, v, step: int, grad_scale: float = 1.0, *, lr: float | None = None,
              weight_decay: float | None = None, copy: torch.Tensor | None = None) -> None:
        """One AdamW step, in place, on one run: parameter ``p``, gradient ``g`` (times ``grad_scale``), moments
        ``m`` and ``v``, all of the same length; ``step`` is the run's new step count. ``lr`` and ``weight_decay``
        (a run's, from ``lr_at`` and ``plan``) default to the optimizer's own (``lr`` must then be a float).
        ``copy``: a bf16/fp16 tensor of the same length that receives the new ``p``, rounded to nearest as
        ``p.to(copy.dtype)`` rounds (the native kernel writes it in its pass; the others cast after it)."""
        (b1, b2), eps = self.betas, self.eps
        if lr is None and callable(self.lr):
            raise ArgumentError("AdamW.apply: this optimizer's lr is a schedule; pass the run's lr (from plan(), "
                                "which reads the schedule at the state's step count).")
        lr = float(self.lr) if lr is None else lr
        wd = self.weight_decay if weight_decay is None else weight_decay
        impl = _resolve(self.impl, p.device, p.dtype)
        if grad_scale != 1.0 and impl != "native":
            g = g * grad_scale  # what clip_grad_norm_ does to .grad; the native kernel fuses it
        if impl == "fused":
            st = torch.tensor(float(step), device=p.device)
            torch._fused_adamw_([p], [g], [m], [v], [], [st], lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                                eps=eps, amsgrad=False, maximize=False)
        elif impl == "native":
            from .. import ops
            # check_finite=False: like torch, a non-finite gradient propagates; skipping a step on every rank
            # consistently is a transform's job (it needs a collective), not the kernel's.
            fused = copy is not None and copy.dtype in (torch.bfloat16, torch.float16)  # the kernel's copy dtypes
            ops.adamw_([p], [g], [m], [v], step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                       grad_scale=grad_scale, param_copies=[copy] if fused else None, check_finite=False)
            if fused:
                return
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
        if copy is not None:
            copy.copy_(p)


def _resolve(impl: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    if impl != "auto":
        return impl
    from .. import ops
    if dtype != torch.float32:  # the native kernel keeps fp32 state; torch's fused one takes bf16/fp16 state too
        return "fused"
    if ops.native_available() and (device.type == "cpu" or ops.backend_info()["cuda"]):
        return "native"
    return "fused"  # no native build (no compiler): torch's fused kernel, still one pass; ops says why once


def _segments(ranges, active, counts, decays) -> list[tuple[int, int, int, float]]:
    """Merge adjacent active slots with the same step count and weight decay into (lo, hi, step, wd) runs."""
    out: list[list] = []
    for (lo, hi), on, c, wd in zip(ranges, active, counts, decays):
        if not on or hi <= lo:
            continue
        if out and out[-1][1] == lo and out[-1][2] == c and out[-1][3] == wd:
            out[-1][1] = hi
        else:
            out.append([lo, hi, c, wd])
    return [tuple(s) for s in out]


def adamw(lr: float | Callable[[int], float] = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, impl: str = "auto", weight_decay_mask: Callable | None = None) -> AdamW:
    """AdamW with the same math (and defaults) as ``torch.optim.AdamW``; ``lr`` may be a schedule and
    ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay (see ``AdamW``)."""
    return AdamW(lr, tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps, weight_decay, impl,
                 weight_decay_mask)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
