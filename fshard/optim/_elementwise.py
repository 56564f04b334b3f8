"""The shared half of fshard's elementwise optimizers (``fs.adamw``, ``fs.optim.sgd``, ``adam``, ``adagrad``,
``rmsprop``, ``lion``, ``from_torch``): everything of the optimizer protocol (``_protocol.py``) but the arithmetic.

An elementwise optimizer updates each element from that element's parameter, gradient and rows alone, so a run of
the flat shard (a parameter, part of one, or neighbours with the same step count and weight decay) can be updated
by itself, and a streamed update (``fs.offload_state``) may cut it into chunks. A subclass is a frozen dataclass
with the fields ``lr`` (a float or a schedule), ``weight_decay`` (where it has one), ``weight_decay_mask`` and
``decay``; it declares its ``rows`` and writes ``update_run`` (one step in place on one run) and ``group_fields``
(the fields of its torch twin's param groups). ``Elementwise`` gives it the rest: the learning rate at a count, the
weight decay of each parameter, the plan (which runs move, at which step count), ``update`` (plan, then ``apply``
on each run), ``apply`` (the gradient scaled, the step, the low-precision copy), the initial state, the param
groups, the fingerprint the ranks compare and ``bind``. examples/custom_optimizer.py writes one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import ClassVar

import torch

from .._pages import state_copy
from ..errors import ArgumentError, ArgumentTypeError
from ..state._flat import UnitLayout
from ..state._slot_grad import grad_parts
from ..state._train_state import FrozenMap
from ._protocol import OptState, Row, apply_runs, counted, initial_rows

_UNSHARED = ("lr", "weight_decay_mask", "decay")  # fields that are not part of the static fingerprint as they are


class Elementwise:
    """The protocol's methods for an elementwise optimizer; a subclass gives ``rows``, ``update_run`` and
    ``group_fields``.

    Class attributes a subclass may set: ``label`` (its public name, for messages: "fs.optim.sgd"), ``count_key``
    (the checkpoint key of its counts: torch's ``"step"``; None where torch keeps none), ``eager_state`` (True where
    the torch twin makes every parameter's state when it is built, as Adagrad does: a checkpoint then lists the
    parameters never updated too).
    """

    label: ClassVar[str] = "optimizer"
    count_key: ClassVar[str | None] = "step"
    eager_state: ClassVar[bool] = False

    # --- what a subclass writes

    rows: tuple[Row, ...] = ()

    def update_run(self, p: torch.Tensor, g: torch.Tensor, rows: tuple, step: int, lr: float, wd: float) -> None:
        """One step in place on one run: ``g`` already scaled, ``step`` the run's count after the update."""
        raise ArgumentTypeError(f"{type(self).__name__} subclasses fs.optim.Elementwise but does not define "
                                "update_run(p, g, rows, step, lr, wd), its step on one run of a shard.")

    def group_fields(self) -> dict:
        """The torch twin's param-group fields other than ``lr`` and ``params``, in its order; a ``weight_decay``
        key (any value) where the twin has one, which each group fills with its own decay."""
        return {}

    # --- checks a subclass's __post_init__ calls

    def _check_common(self) -> None:
        """Checks of ``lr``, ``weight_decay`` and ``weight_decay_mask``; each failure names the argument and the fix."""
        if not callable(self.lr) and not _number(self.lr):
            raise ArgumentTypeError(f"{self.label}(lr={self.lr!r}): lr must be a number or a schedule lr(count) -> "
                                    "float, e.g. fs.schedules.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000).")
        if not callable(self.lr):
            self._check_nonnegative("lr", self.lr)
        self._check_nonnegative("weight_decay", self.weight_decay)
        if self.weight_decay_mask is not None and not callable(self.weight_decay_mask):
            raise ArgumentTypeError(f"{self.label}(weight_decay_mask={self.weight_decay_mask!r}) must be a callable "
                                    "mask(name, param) -> bool, e.g. lambda name, p: p.ndim >= 2.")

    def _check_nonnegative(self, what: str, v) -> None:
        if not _number(v) or not math.isfinite(v) or v < 0:  # nan would pass a plain v < 0 and ruin training
            raise ArgumentError(f"{self.label}({what}={v!r}): {what} must be finite and >= 0 (as lr, eps, "
                                "weight_decay and momentum: finite numbers >= 0).")

    def _check_betas(self, betas) -> None:
        if not (isinstance(betas, tuple) and len(betas) == 2 and all(map(_number, betas))):
            raise ArgumentTypeError(f"{self.label}(betas={betas!r}): betas must be two numbers, e.g. (0.9, 0.95).")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ArgumentError(f"{self.label}(betas={betas}): each beta must be in [0, 1).")

    # --- the protocol

    @property
    def state_type(self) -> type:
        """The type of one unit's state (``OptState``: the rows by name)."""
        return OptState

    def _node(self, count: torch.Tensor, rows) -> object:
        """One unit's state holding ``count`` and ``rows`` (in the declared order)."""
        return OptState(count, FrozenMap(dict(zip((r.name for r in self.rows), rows, strict=True))))

    def lr_at(self, count: int) -> float:
        """The learning rate of the update that follows ``count`` applied updates."""
        if not callable(self.lr):
            return float(self.lr)
        lr = self.lr(count)
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
            raise ArgumentError(f"{self.label}: the learning-rate schedule {self.lr!r} returned {lr!r} for count "
                                f"{count}; a schedule must return a finite number >= 0.")
        return float(lr)

    def fingerprint(self, count: int) -> tuple:
        """What every rank must agree on for the update that follows ``count`` updates: the hyperparameters (the
        schedule's value at ``count``, not the schedule object, whose repr differs between processes) and the
        parameters that decay. The step's rank check compares it (fshard/dist/_agreement.py)."""
        return (self.lr_at(count), *self._static_fingerprint)

    @functools.cached_property
    def _static_fingerprint(self) -> tuple:
        """The part that never changes, made once (the decaying names as their count and a hash, not sorted and
        hashed at every step)."""
        decay = None if self.decay is None else (len(self.decay), zlib.crc32(repr(sorted(self.decay)).encode()))
        fields = tuple((f.name, _plain(getattr(self, f.name))) for f in dataclasses.fields(self)
                       if f.name not in _UNSHARED and f.compare)
        return type(self).__name__, fields, decay

    def bind(self, model: torch.nn.Module):
        """This optimizer with ``weight_decay_mask`` evaluated on ``model``'s parameters (``fs.init`` calls it)."""
        if self.weight_decay_mask is None:
            return self
        decay = []
        for name, p in model.named_parameters():
            on = self.weight_decay_mask(name, p)
            if not isinstance(on, bool):
                raise ArgumentTypeError(f"{self.label}: weight_decay_mask({name!r}, param) returned {on!r}; it must "
                                        "return True (decay this parameter) or False.")
            if on:
                decay.append(name)
        return dataclasses.replace(self, decay=frozenset(decay))

    def decays(self, layout: UnitLayout) -> list[float]:
        """The weight decay of each trainable slot of ``layout``."""
        wd = getattr(self, "weight_decay", 0.0)
        return [wd if self.decay is None or s.name in self.decay else 0.0 for s in layout.trainable]

    def param_groups(self, layouts, updates: int) -> list[dict]:
        """The torch twin's ``param_groups`` over the trainable parameters of ``layouts`` at ``updates`` applied
        updates (a schedule's rate there): one group per weight decay, every trainable name in one (a checkpoint's
        ``optim.param_groups``, as ``get_optimizer_state_dict`` writes them)."""
        groups: dict = {}
        for u in layouts:
            for wd, s in zip(self.decays(u), u.trainable):
                groups.setdefault(wd, []).append(s.name)
        lr = self.lr if not callable(self.lr) else self.lr_at(updates)
        return [{"lr": lr, **{k: (wd if k == "weight_decay" else v) for k, v in self.group_fields().items()},
                 "params": names} for wd, names in groups.items()]

    def init(self, layout: UnitLayout, rank: int, shard: torch.Tensor):
        """Zero counts and each row at its initial value, or None for a unit with no trainable parameter."""
        if not layout.trainable:
            return None
        count = torch.zeros(len(layout.trainable), dtype=torch.int64)
        return self._node(count, initial_rows(self, layout, rank, shard.dtype, shard.device))

    def plan(self, layout: UnitLayout, rank: int, count: torch.Tensor, active: list[bool],
             updates: int = 0) -> tuple[torch.Tensor, list[tuple[int, int, int, float, float]]]:
        """The new per-parameter step counts, and the ``(lo, hi, step, lr, weight_decay)`` runs of this rank's shard
        that one update touches: the ranges of the parameters that got a gradient, adjacent ones with the same count
        and decay merged (a decay mask splits runs, not passes: each run is one kernel call). ``updates``: the
        updates applied so far (``state.step``), which a learning-rate schedule reads."""
        count = counted(count, active)
        lr = self.lr_at(updates)
        runs = segments(layout.trainable_ranges(rank), active, count.tolist(), self.decays(layout))
        return count, [(lo, hi, c, lr, wd) for lo, hi, c, wd in runs]

    def update(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, state, active,
               donate: bool, grad_scale: float = 1.0, updates: int = 0, copy: torch.Tensor | None = None):
        """One step on ``param`` (this rank's shard): ``plan``, then ``apply`` on each run (``apply_spans``: at once,
        where the optimizer takes runs together). ``active[i]``: trainable
        slot i got a gradient on some rank; the others are skipped as torch skips a parameter whose .grad is None
        (no decay, no row update, no count). The gradient is multiplied by ``grad_scale`` first (clipping).
        ``copy``: a low-precision copy of ``param`` (``TrainState.copies``), kept equal to the cast of the new
        parameter. ``donate=False`` writes into copies, leaving the inputs intact. Returns the new parameter, state
        and copy (the given ones where nothing changed)."""
        return self.update_all(rank, [(layout, param, grad, state, active, copy)], donate, grad_scale, updates)[0]

    def update_all(self, rank: int, units: list, donate: bool, grad_scale: float = 1.0, updates: int = 0) -> list:
        """``update`` of several units, ``units`` a list of ``(layout, param, grad, state, active, copy)``: every
        unit's plan first, then every run's pass back to back (one ``apply_spans``), then the new states; returns
        ``update``'s result for each unit, in order. The same arithmetic as one ``update`` a unit, without the
        Python between one unit's pass and the next: after a pass over megabytes the caches are cold, and the plan
        and the new state that ran there cost about 0.5 ms a unit, 10-12% of an SGD update of the 27.4M GPT
        (benchmarks/RESULTS.md, "Session 31"). ``DeviceUpdate`` calls it for the units of a step."""
        out, spans = [], []
        for layout, param, grad, state, active, copy in units:
            count, plan = self.plan(layout, rank, state.count, active, updates)
            rows = state.rows
            if plan and not donate:  # purity: the input state stays valid, so the update writes into copies
                param, rows = state_copy(param), tuple(state_copy(r) for r in rows)
                copy = None if copy is None else state_copy(copy)
            spans += [(param, g, rows, step, grad_scale, lr, wd, copy, a)
                      for lo, hi, step, lr, wd in plan for a, b, g in grad_parts(grad, lo, hi)]
            out.append((param, state.with_rows(count, rows), copy))
        if spans:
            self.apply_spans(spans)
        return out

    def apply_spans(self, spans) -> None:
        """``apply_runs`` on runs given as ``(p, g, rows, step, grad_scale, lr, weight_decay, copy, a)``: ``p``,
        each row and ``copy`` a unit's whole flat tensors, the run their elements ``[a, a + g.numel())`` (``g`` its
        own). Here each run's views are made; an optimizer whose kernel takes offsets makes none (fs.adamw)."""
        apply_runs(self, [(_run(p, a, a + g.numel()), g, tuple(_run(r, a, a + g.numel()) for r in rows), step,
                           scale, lr, wd, None if c is None else _run(c, a, a + g.numel()))
                          for p, g, rows, step, scale, lr, wd, c, a in spans])

    def apply(self, p, g, *rows_step_scale, lr: float | None = None, weight_decay: float | None = None,
              copy: torch.Tensor | None = None) -> None:
        """One step, in place, on one run: ``apply(p, g, *rows, step, grad_scale, lr=, weight_decay=, copy=)`` with
        the rows in the declared order and ``step`` the run's count after the update. ``lr`` and ``weight_decay``
        (a run's, from ``plan``) default to the optimizer's own (``lr`` must then be a float). ``copy``: a
        low-precision tensor of the same length that receives the new ``p`` (``p.to(copy.dtype)``'s rounding)."""
        n = len(self.rows)
        if len(rows_step_scale) not in (n + 1, n + 2):
            raise ArgumentError(f"{self.label}.apply(p, g, *rows, step, grad_scale=1.0): it keeps {n} row(s) "
                                f"{tuple(r.name for r in self.rows)}; got {len(rows_step_scale)} positional "
                                "arguments after g.")
        rows, step = rows_step_scale[:n], rows_step_scale[n]
        scale = rows_step_scale[n + 1] if len(rows_step_scale) == n + 2 else 1.0
        if lr is None and callable(self.lr):
            raise ArgumentError(f"{self.label}.apply: this optimizer's lr is a schedule; pass the run's lr (from "
                                "plan(), which reads the schedule at the state's step count).")
        lr = float(self.lr) if lr is None else lr
        wd = getattr(self, "weight_decay", 0.0) if weight_decay is None else weight_decay
        for p, g, rows, copy in pieces(p, g, rows, copy, self.piece(p)):
            if scale != 1.0:
                g = g * scale  # what clip_grad_norm_ does to .grad
            self.update_run(p, g, rows, int(step), lr, wd)
            if copy is not None:
                copy.copy_(p)

    def piece(self, p: torch.Tensor) -> int:
        """The elements of a run that one ``update_run`` takes (0: the whole run): ``torch_ops_piece`` where the
        implementation that runs is torch's ops ("torch", the default ``resolved_impl``, as a subclass's update
        usually is), whose passes then read each cache-sized piece from memory once rather than once an op; 0 for a
        one-pass kernel ("fused", "native"). A subclass whose update draws random numbers draws them piece by
        piece."""
        return torch_ops_piece(p) if self.resolved_impl(p.device, p.dtype) == "torch" else 0

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """The implementation that runs (the step's ``optim/impl`` metric): torch's single-tensor arithmetic."""
        return "torch"


SINGLE_TENSOR_IMPLS = ("auto", "torch", "fused", "native")


def resolve_single_tensor(opt, device: torch.device, dtype: torch.dtype) -> str:
    """``impl`` of fs.optim.adam, sgd and adagrad as it runs for state of ``dtype`` on ``device``. "auto" is torch's
    fused kernel on the CPU (within 1e-6 of torch's default, and as fast as torch's fastest: benchmarks/RESULTS.md,
    "Optimizers"; the bitwise one-pass kernels, impl="native", measured 0.43-0.48x fused for Adam and Adagrad, whose
    sqrt must be torch's, and 0.84-0.95x for SGD: design/OPS.md "Single-tensor kernels"), torch's single-tensor ops
    anywhere else. "native" runs where the kernel can (fp32 CPU state, the build loaded), else torch's ops: the
    same bits."""
    cpu = torch.device(device).type == "cpu"
    if opt.impl == "native":
        from .. import ops
        return "native" if cpu and dtype == torch.float32 and ops.native_available() else "torch"
    if opt.impl != "auto":
        return opt.impl
    return "fused" if cpu else "torch"


def check_single_tensor_impl(opt) -> None:
    if opt.impl not in SINGLE_TENSOR_IMPLS:
        raise ArgumentError(f"{opt.label}(impl={opt.impl!r}) is not one of {SINGLE_TENSOR_IMPLS}.")


# elements of a run that an update written as torch ops takes at a time on the CPU: its tensors' pieces (4 or 5 of
# them, fp32: 4-5 MiB) stay in the last-level cache between the update's passes (benchmarks/RESULTS.md, "Session 28:
# updates in pieces"), and its temporaries stay under glibc's mmap threshold (32 MiB: a larger one is mapped and
# faulted in afresh at every update)
PIECE = 1 << 18


def torch_ops_piece(p: torch.Tensor) -> int:
    """``Elementwise.piece`` of an update written as several torch ops: each op passes over the whole run, so a run
    in cache-sized pieces reads memory once where it read it once an op. On the CPU only (on CUDA each piece would be
    a kernel launch per op). fp32 state only (``pieces``): the same bits either way."""
    return PIECE if p.device.type == "cpu" else 0


def pieces(p: torch.Tensor, g: torch.Tensor, rows: tuple, copy, piece: int):
    """``(p, g, rows, copy)`` of one run as ``piece``-element pieces (views), or as it is where ``piece`` is not
    positive, the run is no longer, it is not flat with rows as long as itself (an ``apply`` called on other
    tensors), or its parameter or a row is not fp32. An fp32 element's arithmetic is the same wherever a run is cut,
    so the pieces give the whole run's bits; torch's bf16 and fp16 kernels round an element in their scalar tail
    differently from their vector body, so there a cut would move bits."""
    n = p.shape[0] if p.dim() == 1 else 0
    if (piece <= 0 or n <= piece or g.shape != p.shape or p.dtype != torch.float32
            or any(r.shape != p.shape or r.dtype != torch.float32 for r in rows)):
        return ((p, g, rows, copy),)
    return tuple((p[lo:lo + piece], g[lo:lo + piece], tuple(r[lo:lo + piece] for r in rows),
                  None if copy is None else copy[lo:lo + piece]) for lo in range(0, n, piece))


def _run(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flat ``t``: ``t`` itself where that is all of it (no view made: between kernels
    that leave the caches cold each tensor op costs tens of microseconds, benchmarks/RESULTS.md "Optimizers")."""
    return t if lo == 0 and hi == t.shape[0] else t[lo:hi]


def kernel_groups(opt, runs, takes) -> dict:
    """For an ``apply_runs`` whose one-pass kernel takes lists of tensors (torch's fused SGD and Adagrad, fshard.ops'
    AdamW in Adam's mode): the runs ``takes(p, g, rows)`` accepts, grouped by what one call of the kernel shares
    (step, lr, weight decay, device, dtypes), each run one tensor of the lists, as torch's fused optimizers take a
    model's parameters; the kernel is elementwise and each run starts where it did, so the bits are a call per
    run's. Every other run (a scaled gradient, a copy to write, no rate given, one the kernel does not take) goes
    through ``apply`` here."""
    groups: dict = {}
    for run in runs:
        p, g, rows, step, scale, lr, wd, copy = run
        if lr is None or wd is None or scale != 1.0 or copy is not None or not takes(p, g, rows):
            opt.apply(p, g, *rows, step, scale, lr=lr, weight_decay=wd, copy=copy)
            continue
        groups.setdefault((int(step), lr, wd, p.device, p.dtype, g.dtype), []).append(run)
    return groups


def fused_takes(opt):
    """``kernel_groups``' ``takes`` for torch's fused CPU kernels (SGD's, Adagrad's): the runs where ``opt``'s impl
    resolves to "fused" and the gradient is in the parameter's dtype (those kernels take one dtype)."""
    return lambda p, g, rows: opt.resolved_impl(p.device, p.dtype) == "fused" and g.dtype == p.dtype


def native_fits(opt, impl: str, *tensors) -> bool:
    """Whether this run goes to the native kernel: ``impl`` "native" and every tensor fp32, contiguous, on the CPU;
    a run that does not fit (a bf16 gradient, say) runs torch's ops, with the same bits."""
    return impl == "native" and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def segments(ranges, active, counts, decays) -> list[tuple[int, int, int, float]]:
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


def _plain(v):
    """A field as the rank check compares it: a type by its qualified name (its repr is the same everywhere)."""
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    return v


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
