"""fs.muon: Muon over flat shards, with the arithmetic of torch.optim.Muon (torch >= 2.9), for 2-D parameters.

Muon keeps one row, ``momentum_buffer`` (torch's name), and no step count (torch's keeps none: ``count_key`` is
None). Its update is not elementwise: Newton-Schulz orthogonalises each whole matrix, whose rows a shard boundary
may cut. So the update is collective (``collective = True``, fshard/optim/_protocol.py) and, per unit:

1. each rank updates the momentum of its shard's elements (elementwise, as torch does on the whole tensor);
2. the matrices of the unit are dealt out to the ranks, balanced by Newton-Schulz FLOPs (``owners``), and each
   rank's pieces of a matrix are summed into its owner's buffer (``reduce_each``: every other rank adds zeros, so
   the owner receives the matrix exactly);
3. each rank orthogonalises only the matrices it owns (1/N of the work), writes them into a zero buffer of the
   unit, and a SUM reduce-scatter brings every result back to the shards that hold it (again exact);
4. each rank applies weight decay and the orthogonalised update, with torch's shape-adjusted learning rate.

Newton-Schulz runs in bf16 as torch's ``_zeropower_via_newtonschulz`` does (the same operations, in the same order),
so the result equals torch.optim.Muon's on the same gradients.
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
from ..state._train_state import FrozenMap
from ._protocol import OptState, Row

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim._muon's DEFAULT_A, _B, _C (Keller Jordan's)
_ADJUST = (None, "original", "match_rms_adamw")


def _newton_schulz(grad: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz, operation for operation: the orthogonalised ``grad`` (bf16)."""
    a, b, c = coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def _ns_flops(shape: tuple) -> int:
    """Newton-Schulz's multiply-adds for one matrix per iteration (two m x m x n products and one m^3, m <= n)."""
    m, n = sorted(shape)
    return m * m * (2 * n + m)


@functools.lru_cache(maxsize=16)
def deal(matrices: tuple, world_size: int) -> dict[str, int]:
    """Matrix name -> the rank that orthogonalises it, over all of the model's Muon matrices (``matrices``: (name,
    shape) in model order): largest first to the least loaded rank by Newton-Schulz FLOPs (LPT), ties to the lower
    rank, then model order. The same on every rank (the model and world size are)."""
    load, out = [0] * world_size, {}
    for i in sorted(range(len(matrices)), key=lambda i: (-_ns_flops(matrices[i][1]), i)):
        name, shape = matrices[i]
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[name] = r
        load[r] += _ns_flops(shape)
    return out


def owners(layout: UnitLayout, slots: list[int], world_size: int, matrices: tuple = ()) -> dict[int, int]:
    """Trainable slot -> the rank that orthogonalises it: the model-wide deal over ``matrices`` where it names every
    slot (a bound Muon), else a deal over this unit's slots alone, its ties broken from a start that depends on the
    unit's name (so units of one matrix each do not all land on rank 0). The same on every rank."""
    train = layout.trainable
    table = deal(matrices, world_size) if matrices else {}
    if all(train[k].name in table for k in slots):
        return {k: table[train[k].name] for k in slots}
    load, out = [0] * world_size, {}
    start = zlib.crc32(layout.name.encode()) % world_size
    for k in sorted(slots, key=lambda k: (-_ns_flops(train[k].shape), k)):
        r = min(range(world_size), key=lambda r: (load[r], (r - start) % world_size))
        out[k] = r
        load[r] += _ns_flops(train[k].shape)
    return out


def schedule_lr(who: str, lr, count: int) -> float:
    """``lr`` (a float, or a schedule ``lr(count)``) for the update that follows ``count`` applied updates."""
    if not callable(lr):
        return float(lr)
    v = lr(count)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ArgumentError(f"{who}: the learning-rate schedule {lr!r} returned {v!r} for count {count}; a schedule "
                            "must return a finite number >= 0.")
    return float(v)


@dataclass(frozen=True)
class Muon:
    """torch.optim.Muon over flat shards (see the module docstring): momentum, Newton-Schulz orthogonalisation of
    each matrix on one rank, decoupled weight decay, and the update scaled by ``adjust_lr_fn``'s ratio ("original":
    sqrt(max(1, rows/cols)); "match_rms_adamw": 0.2 sqrt(max(rows, cols))). Only 2-D parameters: give the others
    to another optimizer with ``fs.partition``. ``lr`` may be a schedule ``lr(count)`` as in ``fs.adamw``."""

    lr: float | Callable[[int], float] = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    # (name, shape) of the matrices it updates, model order (bind): Newton-Schulz work is dealt over all of them
    matrices: tuple = dataclasses.field(default=(), repr=False)
    rows: ClassVar[tuple[Row, ...]] = (Row("momentum_buffer"),)
    count_key: ClassVar[str | None] = None  # torch's Muon keeps no step
    state_type: ClassVar[type] = OptState
    collective: ClassVar[bool] = True  # Newton-Schulz needs whole matrices (fshard/optim/_protocol.py)

    def __post_init__(self):
        if not callable(self.lr) and (not _number(self.lr) or not math.isfinite(self.lr) or self.lr < 0):
            raise ArgumentError(f"fs.muon(lr={self.lr!r}): lr must be a finite number >= 0 or a schedule "
                                "lr(count) -> float.")
        for what, v in (("weight_decay", self.weight_decay), ("momentum", self.momentum), ("eps", self.eps)):
            if not _number(v) or not math.isfinite(v) or v < 0:
                raise ArgumentError(f"fs.muon({what}={v!r}): weight_decay, momentum and eps must be finite numbers "
                                    ">= 0 (torch.optim.Muon's checks).")
        if not (isinstance(self.ns_coefficients, tuple) and len(self.ns_coefficients) == 3
                and all(map(_number, self.ns_coefficients))):
            raise ArgumentTypeError(f"fs.muon(ns_coefficients={self.ns_coefficients!r}): three numbers (a, b, c), "
                                    f"e.g. {NS_COEFFICIENTS}.")
        if not isinstance(self.ns_steps, int) or isinstance(self.ns_steps, bool) or not 0 <= self.ns_steps < 100:
            raise ArgumentError(f"fs.muon(ns_steps={self.ns_steps!r}): an int in [0, 100), as torch allows.")
        if self.adjust_lr_fn not in _ADJUST:
            raise ArgumentError(f"fs.muon(adjust_lr_fn={self.adjust_lr_fn!r}) is not one of {_ADJUST}.")
        if not isinstance(self.nesterov, bool):
            raise ArgumentTypeError(f"fs.muon(nesterov={self.nesterov!r}) must be True or False.")

    def lr_at(self, count: int) -> float:
        return schedule_lr("fs.muon", self.lr, count)

    def adjusted_lr(self, lr: float, shape: tuple) -> float:
        """torch.optim._muon._adjust_lr: ``lr`` scaled for a matrix of ``shape``."""
        a, b = shape[:2]
        if self.adjust_lr_fn is None or self.adjust_lr_fn == "original":
            return lr * math.sqrt(max(1, a / b))
        return lr * (0.2 * math.sqrt(max(a, b)))

    def fingerprint(self, count: int) -> tuple:
        return (self.lr_at(count), self.weight_decay, self.momentum, self.nesterov, tuple(self.ns_coefficients),
                self.eps, self.ns_steps, self.adjust_lr_fn)

    def check_param(self, name: str, p: torch.Tensor) -> None:
        """Muon takes 2-D parameters only (as torch's refuses the others)."""
        if p.ndim != 2:
            raise ArgumentError(
                f"fs.muon: parameter {name!r} has shape {tuple(p.shape)}; Muon orthogonalises matrices and takes 2-D "
                "parameters only. Give the others to another optimizer: fs.partition({'muon': fs.muon(...), "
                "'adamw': fs.adamw(...)}, lambda name, p: 'muon' if p.ndim == 2 else 'adamw').")

    def bind(self, model: torch.nn.Module) -> "Muon":
        """This optimizer over ``model``'s trainable parameters (``fs.init`` calls it): ``for_params``."""
        return self.for_params([(n, p) for n, p in model.named_parameters() if p.requires_grad])

    def for_params(self, named: list) -> "Muon":
        """This optimizer over the parameters ``named`` ((name, param), model order: ``fs.partition`` gives its
        label's): each checked 2-D, and their shapes kept for dealing the Newton-Schulz work (``deal``)."""
        for name, p in named:
            self.check_param(name, p)
        return dataclasses.replace(self, matrices=tuple((n, tuple(p.shape)) for n, p in named))

    def param_groups(self, layouts, updates: int) -> list[dict]:
        """torch.optim.Muon's one group over the trainable parameters of ``layouts``."""
        names = [s.name for u in layouts for s in u.trainable]
        lr = self.lr if not callable(self.lr) else self.lr_at(updates)
        return [{"lr": lr, "weight_decay": self.weight_decay, "momentum": self.momentum, "nesterov": self.nesterov,
                 "ns_coefficients": tuple(self.ns_coefficients), "eps": self.eps, "ns_steps": self.ns_steps,
                 "adjust_lr_fn": self.adjust_lr_fn, "params": names}] if names else []

    def init(self, layout: UnitLayout, rank: int, shard: torch.Tensor) -> OptState | None:
        if not layout.trainable:
            return None
        for s in layout.trainable:
            self.check_param(s.name, torch.empty(s.shape, device="meta"))
        buf = torch.zeros(layout.opt_numel(rank), dtype=shard.dtype, device=shard.device)
        return OptState(torch.zeros(len(layout.trainable), dtype=torch.int64), FrozenMap({"momentum_buffer": buf}))

    def plan(self, layout, rank, count, active, updates=0):
        raise ArgumentError("fs.muon has no per-run plan: its update orthogonalises whole matrices across ranks "
                            "(update(..., comm=)). A policy that streams runs (fs.offload_state) cannot drive it.")

    def apply(self, *args, **kwargs):
        raise ArgumentError("fs.muon has no per-run apply: its update orthogonalises whole matrices across ranks "
                            "(update(..., comm=)).")

    def update(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, state: OptState,
               active: list[bool], donate: bool, grad_scale: float = 1.0, updates: int = 0,
               copy: torch.Tensor | None = None, comm=None):
        """One Muon step on this rank's shard (see the module docstring); ``comm``: the step's collectives (None
        at world size 1). Returns the new parameter shard, state and copy."""
        count = state.count + torch.tensor(active, dtype=torch.int64)
        rows = state.rows
        if not any(active):
            return param, state.with_rows(count, rows), copy
        if not donate:
            param, rows = param.clone(), tuple(r.clone() for r in rows)
            copy = None if copy is None else copy.clone()
        ranges = layout.trainable_ranges(rank)
        self.step_slots(layout, rank, param, grad, rows, [(k, ranges[k][0]) for k, a in enumerate(active) if a],
                        grad_scale, updates, copy, comm)
        return param, state.with_rows(count, rows), copy

    def step_slots(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, rows: tuple,
                   mine: list[tuple[int, int]], grad_scale: float = 1.0, updates: int = 0,
                   copy: torch.Tensor | None = None, comm=None) -> None:
        """The step, in place, on the trainable slots ``mine`` (``(k, at)``: slot k, whose momentum starts at
        ``at`` of the row; the same slots on every rank): ``fs.partition`` calls it for Muon's parameters."""
        (buf,) = rows
        _need_comm("fs.muon", layout, comm)
        n_ranks = 1 if comm is None else comm.mesh.shard_size  # (2-D: its shard group; each replica group alike)
        train, ranges = layout.trainable, layout.trainable_ranges(rank)
        lo0, hi0 = layout.shard_range(rank)
        lr, mom = self.lr_at(updates), self.momentum
        own = owners(layout, [k for k, _ in mine], n_ranks, self.matrices)
        where, size = {}, [0] * n_ranks  # slot -> its place in its owner's section
        for k, _ in mine:
            where[k] = size[own[k]]
            size[own[k]] += train[k].numel
        sections = [torch.zeros(n, dtype=param.dtype, device=param.device) for n in size]
        for k, at in mine:  # 1. the momentum, on this rank's elements; its update into the owner's section
            lo, hi = ranges[k]
            if hi <= lo:
                continue
            g = grad[lo:hi] if grad_scale == 1.0 else grad[lo:hi] * grad_scale
            b = buf[at:at + hi - lo]
            b.lerp_(g, 1 - mom)
            u = g.lerp(b, mom) if self.nesterov else b
            s = train[k]
            a, e = max(s.offset, lo0), min(s.offset + s.numel, hi0)  # the parameter's own elements here
            if a < e:
                sections[own[k]][where[k] + a - s.offset:where[k] + e - s.offset] = u[a - lo0 - lo:e - lo0 - lo]
        if n_ranks > 1:  # 2. each matrix whole on its owner (the others add zeros: exact)
            comm.reduce_each(sections, f"{layout.name}/muon").wait()
        full = torch.zeros(layout.numel, dtype=param.dtype, device=param.device)
        for k, _ in mine:  # 3. Newton-Schulz on the matrices this rank owns
            s = train[k]
            if own[k] == rank % n_ranks and s.numel:
                m = sections[own[k]][where[k]:where[k] + s.numel].view(s.shape)
                full[s.offset:s.offset + s.numel] = _newton_schulz(m, self.ns_coefficients, self.ns_steps,
                                                                   self.eps).reshape(-1)
        if n_ranks > 1:  # ... and back to the shards (a SUM of one result and zeros)
            out = torch.empty(layout.shard_numel, dtype=param.dtype, device=param.device)
            comm.reduce_scatter(out, full, f"{layout.name}/muon").wait()
        else:
            out = full[lo0:hi0]
        wd = self.weight_decay
        for k, _ in mine:  # 4. decoupled weight decay, then the orthogonalised step
            lo, hi = ranges[k]
            if hi <= lo:
                continue
            p = param[lo:hi]
            p.mul_(1 - lr * wd)
            p.add_(out[lo:hi], alpha=-self.adjusted_lr(lr, train[k].shape))
            if copy is not None:
                copy[lo:hi].copy_(p)

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        return "muon"


def _need_comm(who: str, layout: UnitLayout, comm) -> None:
    """A collective update called without the step's collectives on a sharded unit would update each shard from its
    own pieces alone: refused."""
    if comm is None and layout.world_size > 1:
        raise ArgumentError(f"{who}: unit {layout.name!r} is sharded over {layout.world_size} ranks and its update "
                            "reads whole matrices, so update() needs the step's collectives: pass comm= (the update "
                            "policy does, for an optimizer declaring collective = True).")


def muon(lr: float | Callable[[int], float] = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
         nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
         ns_steps: int = 5, adjust_lr_fn: str | None = None) -> Muon:
    """Muon with the same math (and defaults) as ``torch.optim.Muon``, for 2-D parameters (see ``Muon``)."""
    coeffs = tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list)) else ns_coefficients
    return Muon(lr, weight_decay, momentum, nesterov, coeffs, eps, ns_steps, adjust_lr_fn)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
