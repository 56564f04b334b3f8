"""fs.adafactor: Adafactor over flat shards, with the arithmetic of torch.optim.Adafactor.

torch's Adafactor keeps, per parameter, a ``step``, and either factored second-moment statistics (``row_var`` of
shape ``(..., R, 1)`` and ``col_var`` of shape ``(..., 1, C)``, for a parameter of 2 or more dims) or an elementwise
``variance`` (0-dim and 1-dim parameters). Its step reads whole-parameter quantities: the parameter's norm, the
gradient's squared means along each row and column, and the norm of the update. A shard boundary may cut any of
them, so the update is collective (``collective = True``, fshard/optim/_protocol.py), and per unit:

1. each rank sums, over its own elements, each active parameter's squares and each factored gradient's squares per
   row and per column; one all-reduce makes the sums whole (a vector of R + C per matrix, not the matrix);
2. every rank updates the factored statistics alike (they are small and replicated: ``AdafactorState.factors``, R +
   C per matrix), the elementwise ``variance`` of its own elements (a compact row over the unfactored parameters:
   ``covers``), applies weight decay and forms its elements of the update;
3. a second all-reduce sums the update's squares per parameter, for torch's clipping by ``d``; then the step.

The sums differ from torch's whole-tensor norms only in summation order (about 1e-7 relative). Checkpoints hold
torch's keys: ``step``, and ``row_var``/``col_var`` (whole tensors, the same on every rank, written once) or
``variance`` (boxes of the shards) per parameter (``extra_entries``). ``step_slots`` runs the step on some slots,
given the counts and factors: ``update`` calls it for all, ``fs.partition`` for its label's.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .._pages import state_copy, state_empty
from ..errors import ArgumentError, ArgumentTypeError
from ..state._flat import UnitLayout
from ..state._train_state import FrozenMap, register_node
from ._muon import _need_comm, schedule_lr
from ._protocol import Row, counted


@register_node
@dataclass(frozen=True)
class AdafactorState:
    """Adafactor state of one unit's shard: the counts, ``variance`` (the unfactored parameters' elements on this
    rank, back to back: a compact row), and ``factors[name]``: ``{"row_var", "col_var"}`` of each factored trainable
    parameter, whole and the same on every rank."""

    count: torch.Tensor
    variance: torch.Tensor
    factors: FrozenMap

    @property
    def rows(self) -> tuple:
        return (self.variance,)

    def with_rows(self, count: torch.Tensor, rows: Sequence) -> "AdafactorState":
        (v,) = rows
        return AdafactorState(count, v, self.factors)


def _factored(shape) -> bool:
    return len(shape) > 1


@dataclass(frozen=True)
class Adafactor:
    """torch.optim.Adafactor over flat shards (see the module docstring); ``lr`` may be a schedule ``lr(count)``."""

    lr: float | Callable[[int], float] = 1e-2
    beta2_decay: float = -0.8
    eps: tuple = (None, 1e-3)
    d: float = 1.0
    weight_decay: float = 0.0
    rows: ClassVar[tuple[Row, ...]] = (Row("variance"),)
    count_key: ClassVar[str | None] = "step"
    state_type: ClassVar[type] = AdafactorState
    collective: ClassVar[bool] = True  # whole-parameter norms and row/column means (fshard/optim/_protocol.py)

    def __post_init__(self):
        def bad(what, v, need):
            raise ArgumentError(f"fs.adafactor({what}={v!r}): {need} (torch.optim.Adafactor's checks).")
        if not callable(self.lr) and (not _number(self.lr) or not math.isfinite(self.lr) or self.lr < 0):
            bad("lr", self.lr, "a finite number >= 0 or a schedule lr(count) -> float")
        if not _number(self.beta2_decay) or self.beta2_decay > 0:
            bad("beta2_decay", self.beta2_decay, "a number <= 0")
        if not (isinstance(self.eps, tuple) and len(self.eps) == 2 and (self.eps[0] is None or _number(self.eps[0]))
                and _number(self.eps[1])):
            raise ArgumentTypeError(f"fs.adafactor(eps={self.eps!r}): a pair (eps1 or None, eps2), e.g. (None, 1e-3).")
        if (self.eps[0] is not None and self.eps[0] < 0) or self.eps[1] < 0:
            bad("eps", self.eps, "each eps must be >= 0")
        if not _number(self.d) or self.d < 1:
            bad("d", self.d, "a number >= 1")
        if not _number(self.weight_decay) or not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            bad("weight_decay", self.weight_decay, "a finite number >= 0")

    def lr_at(self, count: int) -> float:
        return schedule_lr("fs.adafactor", self.lr, count)

    def fingerprint(self, count: int) -> tuple:
        return self.lr_at(count), self.beta2_decay, self.eps, self.d, self.weight_decay

    def bind(self, model: torch.nn.Module) -> "Adafactor":
        return self

    def covers(self, layout: UnitLayout, i: int) -> tuple[bool, ...]:
        """``variance`` holds the unfactored (0-dim and 1-dim) parameters only."""
        return tuple(not _factored(s.shape) for s in layout.trainable)

    def param_groups(self, layouts, updates: int) -> list[dict]:
        names = [s.name for u in layouts for s in u.trainable]
        lr = self.lr if not callable(self.lr) else self.lr_at(updates)
        return [{"lr": lr, "beta2_decay": self.beta2_decay, "eps": self.eps, "d": self.d,
                 "weight_decay": self.weight_decay, "foreach": None, "maximize": False,
                 "params": names}] if names else []

    def init(self, layout: UnitLayout, rank: int, shard: torch.Tensor) -> AdafactorState | None:
        if not layout.trainable:
            return None
        ranges, mask = layout.trainable_ranges(rank), self.covers(layout, 0)
        n = sum(max(0, hi - lo) for (lo, hi), on in zip(ranges, mask) if on)
        z = dict(dtype=shard.dtype, device=shard.device)
        factors = {s.name: FrozenMap({"row_var": torch.zeros(*s.shape[:-1], 1, **z),
                                      "col_var": torch.zeros(*s.shape[:-2], 1, s.shape[-1], **z)})
                   for s in layout.trainable if _factored(s.shape)}
        return AdafactorState(torch.zeros(len(layout.trainable), dtype=torch.int64),
                              state_empty(n, shard.dtype, shard.device, torch.Tensor.zero_),
                              FrozenMap(factors))

    def extra_entries(self, layout: UnitLayout, state: AdafactorState) -> dict:
        """Parameter name -> its checkpoint entries beside the rows (fshard/optim/_protocol.py): the factors."""
        return {name: dict(f) for name, f in state.factors.items()}

    def zero_extra(self, state: AdafactorState) -> AdafactorState:
        """``state`` with new zero factors, for a load to fill (the input's stay as they are)."""
        return dataclasses.replace(state, factors=FrozenMap(
            {n: FrozenMap({k: torch.zeros_like(t) for k, t in f.items()}) for n, f in state.factors.items()}))

    def plan(self, layout, rank, count, active, updates=0):
        raise ArgumentError("fs.adafactor has no per-run plan: its update reads whole-parameter norms across ranks "
                            "(update(..., comm=)). A policy that streams runs (fs.offload_state) cannot drive it.")

    def apply(self, *args, **kwargs):
        raise ArgumentError("fs.adafactor has no per-run apply: its update reads whole-parameter norms across ranks.")

    def update(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, state: AdafactorState,
               active: list[bool], donate: bool, grad_scale: float = 1.0, updates: int = 0,
               copy: torch.Tensor | None = None, comm=None):
        """One Adafactor step on this rank's shard (see the module docstring); ``comm``: the step's collectives
        (None at world size 1). Returns the new parameter shard, state and copy."""
        count = counted(state.count, active)
        if not any(active):
            return param, AdafactorState(count, state.variance, state.factors), copy
        variance, factors = state.variance, state.factors
        if not donate:
            param, variance = state_copy(param), state_copy(variance)
            copy = None if copy is None else state_copy(copy)
            factors = {n: FrozenMap({key: t.clone() for key, t in f.items()}) for n, f in factors.items()}
        at, pos = [], 0  # (slot, where its elements start in ``variance``) of the active slots
        for k, ((lo, hi), s, a) in enumerate(zip(layout.trainable_ranges(rank), layout.trainable, active)):
            if a:
                at.append((k, pos))
            if not _factored(s.shape):
                pos += max(0, hi - lo)
        self.step_slots(layout, rank, param, grad, (variance,), at, grad_scale, updates, copy, comm, count=count,
                        extra=factors)
        return param, AdafactorState(count, variance, FrozenMap(factors)), copy

    def step_slots(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, rows: tuple,
                   mine: list[tuple[int, int]], grad_scale: float = 1.0, updates: int = 0,
                   copy: torch.Tensor | None = None, comm=None, count=None, extra=None) -> None:
        """The step, in place, on the trainable slots ``mine`` (``(k, at)``: slot k, whose ``variance`` starts at
        ``at`` of the row if it is unfactored; the same slots on every rank), with ``count`` the new step counts and
        ``extra[name]`` each factored slot's ``row_var``/``col_var``: ``fs.partition`` calls it for its parameters."""
        (variance,) = rows
        factors = extra
        _need_comm("fs.adafactor", layout, comm)
        train = layout.trainable
        lo0, hi0 = layout.shard_range(rank)
        eps1 = torch.finfo(param.dtype).eps if self.eps[0] is None else self.eps[0]
        eps2, lr, wd = self.eps[1], self.lr_at(updates), self.weight_decay
        at = dict(mine)
        ks = [k for k, _ in mine]
        local = {}  # slot -> (its elements here as a view of param, their gradient, the first one's offset in the
        #                     parameter, and in the shard)
        for k in ks:
            s = train[k]
            a, e = max(s.offset, lo0), min(s.offset + s.numel, hi0)
            if a < e:
                g = grad[a - lo0:e - lo0]
                local[k] = (param[a - lo0:e - lo0], g if grad_scale == 1.0 else g * grad_scale, a - s.offset,
                            a - lo0)
        # 1. one all-reduce: each parameter's sum of squares, and each factored gradient's per row and per column
        sizes = [1 + (_rows(train[k].shape) + _cols(train[k].shape) if _factored(train[k].shape) else 0) for k in ks]
        # Sums of squares accumulate in fp32 at least (torch's norms do; bf16 partial sums drift: review, session
        # 23), and each norm is rounded to the parameter's dtype as torch's is before it is used.
        acc = torch.promote_types(param.dtype, torch.float32)
        sums = torch.zeros(sum(sizes), dtype=acc, device=param.device)
        for k, part in zip(ks, sums.split(sizes)):
            if k not in local:
                continue
            p, g, o0, _ = local[k]
            part[0] = p.to(acc).square().sum()
            if _factored(train[k].shape):
                shape, nr = train[k].shape, _rows(train[k].shape)
                r0, sq = _whole_rows(g.to(acc).square(), o0, shape[-1])  # as rows of the matrix, zeros where the shard cuts one
                part[1 + r0:1 + r0 + sq.shape[0]] += sq.sum(dim=1)
                for b, lo, hi in _matrices(r0, sq.shape[0], shape[-2]):  # each matrix's column sums (3-D: several)
                    part[1 + nr + b * shape[-1]:1 + nr + (b + 1) * shape[-1]] += sq[lo:hi].sum(dim=0)
        if comm is not None and comm.mesh.shard_size > 1:  # (2-D: over the shard group, each shard once)
            comm.all_reduce(sums, f"{layout.name}/adafactor", over="shard")
        # 2. the statistics (alike on every rank), weight decay, and this rank's elements of the update
        updates_sq = torch.zeros(len(ks), dtype=acc, device=param.device)
        out, alphas = {}, []
        for i, (k, part) in enumerate(zip(ks, sums.split(sizes))):
            s = train[k]
            step = float(count[k])
            beta_t = step ** self.beta2_decay
            rho = min(lr, 1 / (step ** 0.5))
            alphas.append(max(eps2, _norm(part[0], param.dtype) / (s.numel ** 0.5)) * rho)
            if wd != 0 and k in local:
                local[k][0].mul_(1 - lr * wd)
            if _factored(s.shape):
                f = factors[s.name]
                nr, c = _rows(s.shape), s.shape[-1]
                rv, cv = f["row_var"].view(-1), f["col_var"].view(-1)
                # torch: norm(grad, dim=-1) ** 2 / C, in the gradient's dtype
                rv.lerp_(part[1:1 + nr].sqrt().to(rv.dtype).square_().div_(c), beta_t)
                cv.lerp_(part[1 + nr:].sqrt().to(cv.dtype).square_().div_(s.shape[-2]), beta_t)
                if k not in local:
                    continue
                _, g, o0, _ = local[k]
                mean = f["row_var"].mean(dim=-2, keepdim=True).clamp_(min=eps1).view(-1)
                r0, n = _row_span(o0, g.numel(), c)  # the rows this rank holds elements of
                est = torch.empty(n, c, dtype=param.dtype, device=param.device)
                for b, lo, hi in _matrices(r0, n, s.shape[-2]):  # torch: row_var @ col_var / mean(row_var)
                    torch.mul(rv[r0 + lo:r0 + hi, None], cv[None, b * c:(b + 1) * c], out=est[lo:hi])
                    est[lo:hi].div_(mean[b])
                est = est.view(-1)[o0 - r0 * c:o0 - r0 * c + g.numel()]
            else:
                if k not in local:
                    continue
                _, g, _, _ = local[k]
                v = variance[at[k]:at[k] + g.numel()]
                v.lerp_(g * g, beta_t)
                est = v.clone()
            u = est.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
            out[k] = u
            updates_sq[i] = u.to(acc).square().sum()
        if comm is not None and comm.mesh.shard_size > 1:  # 3. the update's norm per parameter, then the step
            comm.all_reduce(updates_sq, f"{layout.name}/adafactor-update", over="shard")
        for i, k in enumerate(ks):
            if k not in out:
                continue
            denom = max(1.0, _norm(updates_sq[i], param.dtype) / ((train[k].numel ** 0.5) * self.d))
            p, _, _, lo = local[k]
            p.add_(out[k], alpha=-alphas[i] / denom)
            if copy is not None:
                copy[lo:lo + p.numel()].copy_(p)

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        return "adafactor"


def _norm(sq: torch.Tensor, dtype: torch.dtype) -> float:
    """The 2-norm from an accumulated sum of squares, rounded to ``dtype`` as torch's ``norm`` of a tensor of that
    dtype returns it."""
    return sq.sqrt().to(dtype).item()


def _whole_rows(x: torch.Tensor, o0: int, c: int) -> tuple[int, torch.Tensor]:
    """``x``, the elements ``[o0, o0 + len)`` of a matrix of ``c`` columns (flat, row-major), as whole rows: the first
    row's index and an ``(n, c)`` view, zeros where the shard cuts a row (no copy when it cuts none)."""
    r0, n = _row_span(o0, x.numel(), c)
    if o0 == r0 * c and x.numel() == n * c:
        return r0, x.view(n, c)
    rows = x.new_zeros(n * c)
    rows[o0 - r0 * c:o0 - r0 * c + x.numel()] = x
    return r0, rows.view(n, c)


def _row_span(o0: int, numel: int, c: int) -> tuple[int, int]:
    """The first row and the number of rows that elements ``[o0, o0 + numel)`` of a ``c``-column matrix touch."""
    return o0 // c, -(-(o0 + numel) // c) - o0 // c


def _matrices(r0: int, n: int, r: int) -> list[tuple[int, int, int]]:
    """Rows ``[r0, r0 + n)`` of a parameter whose matrices have ``r`` rows each, by matrix: ``(b, lo, hi)``, rows
    ``[lo, hi)`` (counted from r0) of matrix b."""
    return [(b, max(r0, b * r) - r0, min(r0 + n, (b + 1) * r) - r0) for b in range(r0 // r, (r0 + n - 1) // r + 1)]


def _rows(shape) -> int:
    return math.prod(shape[:-1])


def _cols(shape) -> int:
    return math.prod(shape[:-2]) * shape[-1]


def adafactor(lr: float | Callable[[int], float] = 1e-2, beta2_decay: float = -0.8, eps: tuple = (None, 1e-3),
              d: float = 1.0, weight_decay: float = 0.0) -> Adafactor:
    """Adafactor with the same math (and defaults) as ``torch.optim.Adafactor`` (see ``Adafactor``)."""
    return Adafactor(lr, beta2_decay, tuple(eps) if isinstance(eps, (tuple, list)) else eps, d, weight_decay)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
