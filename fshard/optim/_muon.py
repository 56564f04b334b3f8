"""fs.muon: Muon over flat shards, with the arithmetic of torch.optim.Muon (torch >= 2.9), for 2-D parameters.

Muon keeps one row, ``momentum_buffer`` (torch's name), and no step count (torch's keeps none: ``count_key`` is
None). Its update is not elementwise: Newton-Schulz orthogonalises each whole matrix, whose rows a shard boundary
may cut. So the update is collective (``collective = True``, fshard/optim/_protocol.py) and, per unit:

1. each rank updates the momentum of its shard's elements (elementwise, as torch does on the whole tensor);
2. the matrices of the unit are dealt out to the ranks, balanced by Newton-Schulz FLOPs (``owners``), and one
   all-to-all (``Collectives.exchange``) sends each rank's pieces of each matrix to its owner: only the elements the
   rank holds of the matrix (``pieces``), no padding and no sums, so the owner receives the matrix exactly;
3. each rank orthogonalises only the matrices it owns (1/N of the work), and a second all-to-all sends each piece
   of the results, in bf16 (Newton-Schulz's dtype: exact), back to the rank that holds it;
4. each rank applies weight decay and the orthogonalised update, with torch's shape-adjusted learning rate.

A matrix whole on its owner's shard stays out of both exchanges and is orthogonalised while they are in flight;
``update_phases`` pauses twice, where each exchange is issued (whether or not the unit has one), so that the update
policy runs the next units' work before it waits on this one's (design/OPTIM_GROUPS.md, "Overlap").

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

from .._pages import state_copy, state_empty
from ..errors import ArgumentError, ArgumentTypeError
from ..state._flat import UnitLayout
from ..state._train_state import FrozenMap
from ._protocol import OptState, Row, counted, drive

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


def pieces(layout: UnitLayout, slots: list[int], own: dict[int, int], n: int) -> list:
    """``[q][o]``: the pieces of the matrices (of ``slots``) that rank ``o`` orthogonalises which shard rank ``q``
    holds, each ``(k, a, e)``: elements ``[a, e)`` of the unit, slot k's own (not the padding after it), in slot
    order. Rank q sends ``[q][o]`` to o back to back in this order, and o sends them back in it. Alike on every rank."""
    table = [[[] for _ in range(n)] for _ in range(n)]
    for q in range(n):
        lo, hi = layout.shard_range(q)
        for k in slots:
            s = layout.trainable[k]
            a, e = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < e:
                table[q][own[k]].append((k, a, e))
    return table


def _pack(parts: list, dtype: torch.dtype, device) -> torch.Tensor:
    """``parts`` (``((flat, start), a, e)``: elements ``[a, e)`` of the unit, read from ``flat``, which holds the
    unit's elements from ``start`` on) back to back in one new tensor of ``dtype``."""
    out, pos = torch.empty(sum(e - a for _, a, e in parts), dtype=dtype, device=device), 0
    for (flat, start), a, e in parts:
        out[pos:pos + e - a] = flat[a - start:e - start]
        pos += e - a
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
        buf = state_empty(layout.opt_numel(rank), shard.dtype, shard.device, torch.Tensor.zero_)  # (huge pages)
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
        return drive(self.update_phases(layout, rank, param, grad, state, active, donate, grad_scale, updates, copy,
                                        comm))

    def update_phases(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, state: OptState,
                      active: list[bool], donate: bool, grad_scale: float = 1.0, updates: int = 0,
                      copy: torch.Tensor | None = None, comm=None):
        """``update`` as a generator that pauses twice: once its pieces are on their way to their owners, and once
        the results are on their way back (the update policy meanwhile runs the next units' phases, so that the
        exchanges travel during Newton-Schulz and no rank waits on a unit another rank is still orthogonalising);
        returns ``update``'s result."""
        count = counted(state.count, active)
        rows = state.rows
        if not any(active):
            return param, state.with_rows(count, rows), copy
        if not donate:
            param, rows = state_copy(param), tuple(state_copy(r) for r in rows)
            copy = None if copy is None else state_copy(copy)
        ranges = layout.trainable_ranges(rank)
        yield from self.step_phases(layout, rank, param, grad, rows,
                                    [(k, ranges[k][0]) for k, a in enumerate(active) if a], grad_scale, updates, copy,
                                    comm)
        return param, state.with_rows(count, rows), copy

    def step_slots(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, rows: tuple,
                   mine: list[tuple[int, int]], grad_scale: float = 1.0, updates: int = 0,
                   copy: torch.Tensor | None = None, comm=None) -> None:
        """The step, in place, on the trainable slots ``mine`` (``(k, at)``: slot k, whose momentum starts at
        ``at`` of the row; the same slots on every rank): ``fs.partition`` calls it for Muon's parameters."""
        drive(self.step_phases(layout, rank, param, grad, rows, mine, grad_scale, updates, copy, comm))

    def step_phases(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, rows: tuple,
                    mine: list[tuple[int, int]], grad_scale: float = 1.0, updates: int = 0,
                    copy: torch.Tensor | None = None, comm=None):
        """``step_slots`` as a generator that pauses with each exchange in flight (``update_phases``)."""
        (buf,) = rows
        _need_comm("fs.muon", layout, comm)
        n = 1 if comm is None else comm.mesh.shard_size  # (2-D: its shard group; each replica group alike)
        me, train, ranges = rank % n, layout.trainable, layout.trainable_ranges(rank)
        lo0 = layout.shard_range(rank)[0]
        lr, mom = self.lr_at(updates), self.momentum
        table, local, remote, sizes, spec = self._exchanges(layout, [k for k, _ in mine], n, me)
        tag = f"{layout.name}/muon"
        rows_of = {}  # slot -> its momentum-updated gradient over this rank's range of it, and where that starts
        for k, at in mine:  # 1. the momentum, on this rank's elements
            lo, hi = ranges[k]
            if hi <= lo:
                continue
            g = grad[lo:hi] if grad_scale == 1.0 else grad[lo:hi] * grad_scale
            b = buf[at:at + hi - lo]
            b.lerp_(g, 1 - mom)
            rows_of[k] = (g.lerp(b, mom) if self.nesterov else b, lo0 + lo)
        # 2. each matrix whole on its owner: this rank's pieces of it, and nothing else, in one all-to-all
        send = _pack([(rows_of[k], a, e) for o in range(n) for k, a, e in table[me][o]], param.dtype, param.device)
        recv = torch.empty(sum(r[me] for r in sizes), dtype=param.dtype, device=param.device)
        flight = comm.exchange(recv, send, [r[me] for r in sizes], sizes[me], tag, spec) if remote else None
        yield  # (the update policy may start the next unit's exchange here)
        # 3. Newton-Schulz on the matrices this rank owns (bf16, as torch's: sent back in bf16, exact), first those
        # whole here, while the others' pieces travel
        done = {k: self._orthogonal(_pack([(rows_of[k], a, e)], param.dtype, param.device), train[k])
                for k, a, e in local}
        whole, pos = {}, 0
        if flight is not None:
            flight.wait()
        for q in range(n):
            for k, a, e in table[q][me]:
                s = train[k]
                m = whole.setdefault(k, torch.empty(s.numel, dtype=param.dtype, device=param.device))
                m[a - s.offset:e - s.offset] = recv[pos:pos + e - a]
                pos += e - a
        done.update((k, self._orthogonal(m, train[k])) for k, m in whole.items())
        back = _pack([(done[k], a, e) for q in range(n) for k, a, e in table[q][me]], torch.bfloat16, param.device)
        got = torch.empty(sum(sizes[me]), dtype=torch.bfloat16, device=param.device)
        flight = comm.exchange(got, back, sizes[me], [r[me] for r in sizes], f"{tag}/back", spec) if remote else None
        out = torch.zeros(layout.shard_numel, dtype=param.dtype, device=param.device)
        for k, a, e in local:  # (while each remote piece goes back to the rank that holds it)
            out[a - lo0:e - lo0] = done[k][0]
        wd, held = self.weight_decay, [(k, *ranges[k]) for k, _ in mine if ranges[k][1] > ranges[k][0]]
        for k, lo, hi in held:  # 4. decoupled weight decay (needs no result), then the orthogonalised step
            param[lo:hi].mul_(1 - lr * wd)
        yield  # (the results travel back while the update policy orthogonalises the next unit's matrices)
        if flight is not None:
            flight.wait()
        pos = 0
        for k, a, e in (p for o in range(n) for p in table[me][o]):
            out[a - lo0:e - lo0] = got[pos:pos + e - a]
            pos += e - a
        for k, lo, hi in held:
            param[lo:hi].add_(out[lo:hi], alpha=-self.adjusted_lr(lr, train[k].shape))
            if copy is not None:
                copy[lo:hi].copy_(param[lo:hi])

    def _exchanges(self, layout: UnitLayout, slots: list[int], n: int, me: int) -> tuple:
        """How the matrices of ``slots`` travel over ``n`` shard ranks, seen from shard rank ``me``: ``(table,
        local, remote, sizes, spec)``: the pieces of the matrices that cross ranks (``pieces``, those whole on their
        owner's shard left out), the pieces of ``me``'s own matrices whole on its shard, the slots that cross,
        ``sizes[q][o]`` the elements q sends o, and the table as the text every rank checks."""
        table = pieces(layout, slots, owners(layout, slots, n, self.matrices), n)
        # a matrix whole on its owner's shard stays out of the exchanges (its step overlaps them)
        remote = {k for q in range(n) for o in range(n) if q != o for k, _, _ in table[q][o]}
        local = [(k, a, e) for k, a, e in table[me][me] if k not in remote]
        table = [[[p for p in cell if p[0] in remote] for cell in row] for row in table]
        sizes = [[sum(e - a for _, a, e in table[q][o]) for o in range(n)] for q in range(n)]  # q sends o
        return table, local, remote, sizes, "|".join("+".join(map(str, row)) for row in sizes)

    def exchange_plan(self, layout: UnitLayout, rank: int, active: list[bool], n: int) -> list[list[tuple]]:
        """The exchanges an update of the ``active`` slots over ``n`` shard ranks issues, per phase of
        ``update_phases`` (the code run up to each pause, and after the last): each ``(tag, sizes, dtype,
        out_splits, in_splits)`` as ``Collectives.exchange`` gets them. ``DeviceUpdate`` promises them in the order
        its pipeline issues them: one check for all."""
        slots = [k for k, a in enumerate(active) if a]
        if not slots:
            return [[]]  # (update_phases returns at once)
        me = rank % n
        _, _, remote, sizes, spec = self._exchanges(layout, slots, n, me)
        if n == 1 or not remote:
            return [[], [], []]
        tag, into, out = f"{layout.name}/muon", tuple(r[me] for r in sizes), tuple(sizes[me])
        return [[(tag, spec, layout.dtype, into, out)], [(f"{tag}/back", spec, torch.bfloat16, out, into)], []]

    def exchange_bytes(self, layout: UnitLayout, rank: int, active: list[bool], n: int) -> int:
        """The bytes this rank's exchanges send to the others in an update of the ``active`` slots over ``n`` ranks
        (step.plan's ``comm/update_bytes``): its pieces of the others' matrices in the parameters' dtype, and its
        results for the others' pieces of its own in bf16."""
        if n == 1:
            return 0
        slots = [k for k, a in enumerate(active) if a]
        table, me = pieces(layout, slots, owners(layout, slots, n, self.matrices), n), rank % n
        out = sum(e - a for o in range(n) if o != me for _, a, e in table[me][o])
        return out * layout.dtype.itemsize + 2 * sum(e - a for q in range(n) if q != me for _, a, e in table[q][me])

    def _orthogonal(self, m: torch.Tensor, s) -> tuple[torch.Tensor, int]:
        """Newton-Schulz of the matrix of slot ``s`` (``m``: its elements, a tensor of its own), flat (bf16), and
        where it starts in the unit."""
        return _newton_schulz(m.view(s.shape), self.ns_coefficients, self.ns_steps, self.eps).reshape(-1), s.offset

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
