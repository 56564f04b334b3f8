"""The optimizer protocol: what an optimizer declares, and what the rest of fshard asks of it.

An optimizer over flat shards declares the **rows** of its per-parameter state (names and dtypes: AdamW's
``exp_avg`` and ``exp_avg_sq``; SGD with momentum would declare one row, plain SGD none) and the key under which
its per-parameter step counts are saved (torch's ``step``; None where its torch twin keeps none). Every row covers
the trainable prefix of a unit's shard on this rank, element for element, so whoever moves state (the checkpoint,
``fs.offload_state``, the state checks, the step's plan) iterates over the declared rows and never names one.

The state of one unit's shard is a frozen pytree node with a ``count`` (an int64 step count per trainable
parameter of the unit) and the declared rows in their order (``rows``), each a tensor or a leaf held in a store
(``fs.state.Stored``); ``with_rows`` makes the same kind of node with other leaves. AdamW's node is ``AdamWState``,
whose fields name its rows; an optimizer without a node of its own uses ``OptState`` (``s.<row name>`` reads a row).

An update is ``plan`` (which runs of the shard move, with which step count, learning rate and weight decay)
followed by ``apply`` on each run, on flat slices of the same length: the parameter, its gradient and the rows in
the declared order. ``update`` does both for a unit held in memory; a policy that streams rows in pieces
(``fs.offload_state``) calls the two itself.

An optimizer may also define ``update_all(rank, units, donate, grad_scale, updates)``: ``update`` of several
units, ``units`` a list of ``(layout, param, grad, state, active, copy)``, returning ``update``'s result for each
(``Elementwise`` does: every unit's plan, then all their runs in one ``apply_spans``, ``apply_runs`` on their views
or, for ``fs.adamw``, its kernel on offsets into the units' tensors). ``DeviceUpdate`` calls it for
a step's units where it exists and the optimizer is not ``collective``.

Optional declarations extend this for optimizers that are not elementwise or cover only some parameters
(``fs.muon``, ``fs.partition``, ``fs.adafactor``; design/OPTIM_GROUPS.md says why these and not others):

- ``collective = True``: ``update`` needs the step's collectives (Muon's Newton-Schulz needs whole matrices), so the
  update policy passes ``comm=`` (the step's ``fs.protocol.Collectives``) to it; every rank calls ``update`` for the
  same units in the same order, so the collectives inside it match. Such an optimizer has no per-run ``apply`` a
  streaming policy could call (``streamable``): ``fs.offload_state`` updates it a whole unit at a time. It may
  have ``update_phases`` (``update``'s arguments): ``update`` as a generator that pauses with a collective in flight
  (twice for each Muon inside: ``fs.partition`` may hold several), and returns ``update``'s result (``drive`` runs
  one); ``DeviceUpdate`` then moves the units paused before it on by one phase each time it starts one, so their
  collectives travel during the others' work (``fs.muon``, ``fs.partition``). With ``exchange_plan(layout, rank,
  active, n)`` as well (the exchanges of a unit's update, per phase: ``(tag, sizes, dtype, out_splits, in_splits)``
  as ``Collectives.exchange`` gets them; None: cannot say), the update's exchanges are checked across ranks in one
  check instead of one each (``Collectives.promise``), so that the ranks are not brought together at each.
- ``covers(layout, i) -> tuple[bool, ...] | None``: which trainable slots of ``layout`` row ``i`` (of ``rows``)
  holds state for (None, or no method: all of them). A row is then *compact*: the trainable ranges of the slots it
  covers, back to back in slot order (``row_ranges``), so a parameter of a partition holds only its own optimizer's
  rows.
- ``count_key_of(name) -> str | None``: the checkpoint key of parameter ``name``'s count where it differs between
  parameters (a partition: AdamW's ``step`` for its parameters, none for Muon's); default ``count_key``.
- ``extra_entries(layout, state) -> {param name: {key: tensor}}`` and ``zero_extra(state) -> state``: state beside
  the rows that is not elementwise (Adafactor's ``row_var``/``col_var``, whole tensors the same on every rank), saved
  under ``optim.state.<name>.<key>`` as torch's optimizer keys it; a load fills ``zero_extra``'s new tensors.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .. import _pages
from ..state._flat import UnitLayout
from ..state._train_state import FrozenMap, register_node


@dataclass(frozen=True)
class Row:
    """One row of an optimizer's per-parameter state.

    Attributes:
      name: its name, also its key in a checkpoint's ``optim.state.<param>.<name>`` (as torch's optimizer names it).
      dtype: its dtype; None: the unit's parameter dtype (AdamW's moments follow the parameters, as torch's do).
      init: the value every element starts at (Adagrad's ``initial_accumulator_value``; 0 for most rows).
    """

    name: str
    dtype: torch.dtype | None = None
    init: float = 0.0

    def dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """The row's dtype in a unit whose parameters are ``param_dtype``."""
        return param_dtype if self.dtype is None else self.dtype


@runtime_checkable
class UnitOptState(Protocol):
    """The optimizer state of one unit's shard (a frozen pytree node).

    Attributes:
      count: int64 tensor of shape ``(len(layout.trainable),)``, the updates applied to each trainable parameter.
      rows: the declared rows in their order, each a 1-D tensor of ``layout.opt_numel(rank)`` elements or a leaf
        held in a store (``Stored``).
    """

    count: torch.Tensor

    @property
    def rows(self) -> tuple: ...

    def with_rows(self, count: torch.Tensor, rows: Sequence) -> "UnitOptState":
        """The same kind of node holding ``count`` and ``rows`` (in the declared order)."""


@runtime_checkable
class Optimizer(Protocol):
    """An optimizer over flat shards (``fs.adamw`` is one). A frozen object; its fields are its hyperparameters.

    Attributes:
      rows: the per-parameter state rows it keeps, in order (``Row``); the checkpoint, offload, the state checks and
        the plan iterate over them.
      count_key: the checkpoint key of each parameter's step count (``"step"``, as torch's AdamW saves it); None
        where the torch twin keeps no count (the counts are still kept: plans read them).
      state_type: the type of one unit's state (``UnitOptState``), which ``state.replace`` checks entries against.
      eager_state: True where the torch twin makes every parameter's state when it is built (Adagrad's), so a
        checkpoint lists the parameters never updated too; False (torch's usual: state from the first update).
        Optional: an optimizer without it is False.

    Optional too: ``saved_scalars(count, updates, weight_decay) -> {name: 0-dim tensor}``, per-parameter scalars
    the torch twin keeps beside its rows that follow from the count (NAdam's ``mu_product``, through
    ``fs.optim.from_torch``): a checkpoint writes them for each updated parameter, so its keys are the twin's.
    """

    rows: tuple[Row, ...]
    count_key: str | None
    state_type: type

    def init(self, layout: UnitLayout, rank: int, shard: torch.Tensor) -> UnitOptState | None:
        """The initial state of one unit's shard.

        Args:
          layout: the unit's layout.
          rank: this rank.
          shard: this rank's shard of the unit (its dtype and device are the rows' unless a row says otherwise).

        Returns:
          The state (zero counts, the rows' initial values), or None for a unit with no trainable parameter.
        """

    def plan(self, layout: UnitLayout, rank: int, count: torch.Tensor, active: list[bool],
             updates: int = 0) -> tuple[torch.Tensor, list[tuple[int, int, int, float, float]]]:
        """Which runs of the shard one update moves.

        Args:
          layout, rank: the unit and this rank.
          count: the state's per-parameter step counts.
          active: ``active[i]``: trainable parameter i got a gradient (on some rank); the others stay as they are.
          updates: the updates applied so far (``state.step``), which a learning-rate schedule reads.

        Returns:
          The new counts, and the ``(lo, hi, step, lr, weight_decay)`` runs: elements ``[lo, hi)`` of the
          optimizer range move with step count ``step`` (after the update), ``lr`` and ``weight_decay``.
        """

    def apply(self, p: torch.Tensor, g: torch.Tensor, *rows_step_scale: Any, lr: float | None = None,
              weight_decay: float | None = None, copy: torch.Tensor | None = None) -> None:
        """One step, in place, on one run: ``apply(p, g, *rows, step, grad_scale, lr=, weight_decay=, copy=)``.

        Args:
          p: the run's parameters (updated in place).
          g: their gradient, multiplied by ``grad_scale`` first (clipping).
          rows: one slice per declared row, in order (updated in place).
          step: the run's step count after the update (from ``plan``).
          grad_scale: the factor for ``g``.
          lr, weight_decay: the run's (from ``plan``).
          copy: a low-precision tensor of the same length that receives the new ``p`` (``TrainState.copies``).
        """

    def update(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, state: UnitOptState,
               active: list[bool], donate: bool, grad_scale: float = 1.0, updates: int = 0,
               copy: torch.Tensor | None = None) -> tuple[torch.Tensor, UnitOptState, torch.Tensor | None]:
        """``plan`` then ``apply`` on a unit held in memory. Returns the new parameter shard, state and copy;
        ``donate=False`` leaves the inputs intact."""

    def param_groups(self, layouts: Sequence[UnitLayout], updates: int) -> list[dict]:
        """The torch twin's ``param_groups`` over the trainable parameters of ``layouts`` (each group its fields and
        ``"params"``, the parameter names), at ``updates`` applied updates: a checkpoint's ``optim.param_groups``."""

    def fingerprint(self, count: int) -> tuple:
        """What every rank must agree on for the update that follows ``count`` updates (the step's rank check)."""

    def bind(self, model: torch.nn.Module) -> "Optimizer":
        """This optimizer with its per-parameter choices (a weight-decay mask) evaluated on ``model``."""

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        """The implementation that runs on ``device`` for state of ``dtype`` (the step's ``optim/impl`` metric)."""


@register_node
@dataclass(frozen=True)
class OptState:
    """The state of one unit's shard for an optimizer without a node type of its own: the counts, and the rows by
    name in the declared order (a ``FrozenMap``, so a leaf's pytree path names its row)."""

    count: torch.Tensor
    named: FrozenMap

    @property
    def rows(self) -> tuple:
        return tuple(self.named.values())

    def with_rows(self, count: torch.Tensor, rows: Sequence) -> "OptState":
        return OptState(count, FrozenMap(dict(zip(self.named, rows, strict=True))))

    def __getattr__(self, name: str):  # a row by its name (s.momentum_buffer), as AdamWState's fields name its rows
        named = self.__dict__.get("named")
        if named is not None and name in named:
            return named[name]
        raise AttributeError(f"OptState has no row {name!r}; its rows: {tuple(named or ())}.")


def row_names(opt: Optimizer) -> tuple[str, ...]:
    """The names of ``opt``'s rows, in order."""
    return tuple(r.name for r in opt.rows)


def row_ranges(opt: Optimizer, layout: UnitLayout, rank: int, row: int) -> list[tuple[int, int, int, int]]:
    """Where row ``row`` (its index in ``opt.rows``) holds each trainable slot it covers: ``(k, lo, hi, at)`` for
    trainable slot ``k`` whose shard-local range ``[lo, hi)`` sits at ``[at, at + hi - lo)`` of the row (``at ==
    lo`` for a row covering every slot)."""
    covers = getattr(opt, "covers", None)
    mask = covers(layout, row) if covers is not None else None
    out, at = [], 0
    for k, (lo, hi) in enumerate(layout.trainable_ranges(rank)):
        if mask is None or mask[k]:
            out.append((k, lo, hi, at))
            at += max(0, hi - lo)
    return out


def row_numel(opt: Optimizer, layout: UnitLayout, rank: int, row: int) -> int:
    """The elements of row ``row`` (its index in ``opt.rows``) on this rank: ``opt_numel`` unless the row is
    compact (``covers``)."""
    if getattr(opt, "covers", None) is None:
        return layout.opt_numel(rank)
    return sum(max(0, hi - lo) for _, lo, hi, _ in row_ranges(opt, layout, rank, row))


def streamable(opt: Optimizer) -> bool:
    """Whether a policy may stream ``opt``'s rows through ``plan`` and ``apply`` (``fs.offload_state``): every row
    over the whole optimizer range, and no collective inside the update."""
    return not getattr(opt, "collective", False) and getattr(opt, "covers", None) is None


def apply_runs(opt: Optimizer, runs) -> None:
    """``opt.apply`` on each of ``runs``: ``(p, g, rows, step, grad_scale, lr, weight_decay, copy)`` tuples over
    disjoint elements. An optimizer may define ``apply_runs(runs)`` to take them at once (``fs.adamw``'s native
    kernel: one call, so the host update of ``fs.offload_state`` takes the GIL back once for a unit instead of once
    a run, beside a step whose Python thread holds it); the result is the same either way."""
    for c in type(opt).__mro__:  # the class that defines apply must define apply_runs too: a subclass that
        if "apply" in vars(c):     # overrides apply alone (to log, to add noise) has it called for every run
            if "apply_runs" in vars(c):
                return opt.apply_runs(runs)
            break
    for p, g, rows, step, scale, lr, wd, copy in runs:
        opt.apply(p, g, *rows, step, scale, lr=lr, weight_decay=wd, copy=copy)
    return None


def optimizer_of(opt: Optimizer, name: str) -> Optimizer:
    """The optimizer that updates parameter ``name``: ``opt``, or for one that holds several (``fs.partition``'s
    ``optimizer_of``) the one for that parameter; its ``eager_state`` and ``saved_scalars`` are the parameter's."""
    of = getattr(opt, "optimizer_of", None)
    return opt if of is None else of(name)


def count_key_of(opt: Optimizer, name: str) -> str | None:
    """The checkpoint key of parameter ``name``'s step count (``count_key_of`` where declared, else ``count_key``)."""
    of = getattr(opt, "count_key_of", None)
    return opt.count_key if of is None else of(name)


def initial_rows(opt: Optimizer, layout: UnitLayout, rank: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """One tensor per declared row over this rank's optimizer range, or over the slots it covers (a compact row), each
    element at the row's initial value (``Row.init``: zero for most), for a unit of parameter dtype ``dtype``."""
    return [_pages.state_empty(row_numel(opt, layout, rank, i), r.dtype_for(dtype), device,
                               lambda t, v=r.init: t.fill_(v))  # (huge pages: read at every update)
            for i, r in enumerate(opt.rows)]


def counted(count: torch.Tensor, active: Sequence[bool]) -> torch.Tensor:
    """The step counts after an update of the ``active`` slots: ``count`` plus one where active (a new tensor). One
    tensor op where every slot is active, the usual case (an update runs between kernels that leave the caches
    cold, where each op costs tens of microseconds: benchmarks/RESULTS.md, "Optimizers")."""
    return count + 1 if all(active) else count + torch.tensor(active, dtype=torch.int64)


def drive(phases):
    """Run a phased update (a generator: ``update_phases``, ``step_phases``) to its end; returns its result."""
    try:
        while True:
            next(phases)
    except StopIteration as stop:
        return stop.value


def state_bytes(s: UnitOptState) -> int:
    """The bytes of a unit's rows (held in memory or in a store), not counting the counts."""
    return sum(r.nbytes for r in s.rows)
