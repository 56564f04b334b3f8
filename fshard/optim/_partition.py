"""fs.partition: several optimizers over disjoint groups of parameters, in one state (optax's ``multi_transform``).

``label_fn(name, param) -> label`` puts each trainable parameter in one group; ``fs.init`` evaluates it once
(``bind``, which also binds each optimizer: over its own parameters where it has ``for_params``, as
``fs.muon``). The state of a unit's shard (``PartitionState``) holds, per label, that optimizer's rows over only the
parameters of the label (compact rows: ``covers``, fshard/optim/_protocol.py), so a Muon matrix has a momentum
buffer and no AdamW moments, and an embedding AdamW moments and no momentum buffer. The step counts are one per
trainable parameter, as for any optimizer; each is saved under its own optimizer's key (``count_key_of``).

An update runs each label's optimizer on its parameters: an elementwise one through its ``plan`` (given only its
parameters as active) and ``apply`` on each run, the run's rows found at their compact place; one with a
``step_slots`` (``fs.muon``, ``fs.adafactor``) on its slots at once, with the step's collectives (and, for one
with state beside its rows, the counts and that state: ``PartitionState.extra``). The result equals the torch twins,
one torch optimizer per group, stepped one after the other on the same gradients.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .._pages import state_copy, state_empty
from ..errors import ArgumentError, ArgumentTypeError
from ..state._flat import UnitLayout
from ..state._train_state import FrozenMap, register_node
from ._protocol import Row, apply_runs, counted, drive


@register_node
@dataclass(frozen=True)
class PartitionState:
    """The state of one unit's shard under ``fs.partition``: the step counts (one per trainable parameter); per
    label, its optimizer's rows by name over the label's parameters only (``parts[label][row]``); and per label the
    state its optimizer keeps beside the rows, by parameter (``extra[label][name][key]``: Adafactor's factors)."""

    count: torch.Tensor
    parts: FrozenMap
    extra: FrozenMap

    @property
    def rows(self) -> tuple:
        return tuple(t for part in self.parts.values() for t in part.values())

    def with_rows(self, count: torch.Tensor, rows: Sequence) -> "PartitionState":
        rows, parts = list(rows), {}
        for label, part in self.parts.items():
            parts[label] = FrozenMap(dict(zip(part, rows[:len(part)], strict=True)))
            rows = rows[len(part):]
        if rows:
            raise ArgumentError(f"PartitionState.with_rows: {len(rows)} rows more than the partition declares.")
        return PartitionState(count, FrozenMap(parts), self.extra)


@dataclass(frozen=True)
class Partition:
    """Optimizers over disjoint parameter groups (see the module docstring). ``optimizers``: ``(label, optimizer)``
    pairs; ``labels``: ``(name, label)`` of each trainable parameter once bound (``fs.init``)."""

    optimizers: tuple
    label_fn: Callable
    labels: tuple | None = dataclasses.field(default=None, repr=False)
    count_key: ClassVar[str | None] = None  # per parameter: count_key_of
    state_type: ClassVar[type] = PartitionState

    @property
    def rows(self) -> tuple[Row, ...]:
        return tuple(r for _, o in self.optimizers for r in o.rows)

    @property
    def collective(self) -> bool:
        return any(getattr(o, "collective", False) for _, o in self.optimizers)

    @functools.cached_property
    def _label_of(self) -> dict:
        if self.labels is None:
            raise ArgumentError("fs.partition: this optimizer is not bound to a model yet; fs.init(model, mesh, "
                                "fs.partition(...)) evaluates label_fn on the model's parameters.")
        return dict(self.labels)

    def _row_label(self, i: int) -> str:
        for label, o in self.optimizers:
            if i < len(o.rows):
                return label
            i -= len(o.rows)
        raise ArgumentError(f"fs.partition declares {len(self.rows)} rows; there is no row {i}.")

    def _mask(self, layout: UnitLayout, label: str) -> list[bool]:
        of = self._label_of
        return [of[s.name] == label for s in layout.trainable]

    def _row_mask(self, layout: UnitLayout, label: str) -> list[bool]:
        """The slots the label's rows cover: its parameters, of those its optimizer's rows cover (``covers``: one
        pattern for all its rows, checked by ``partition``)."""
        mask, o = self._mask(layout, label), dict(self.optimizers)[label]
        if hasattr(o, "covers"):
            mask = [m and c for m, c in zip(mask, o.covers(layout, 0))]
        return mask

    def covers(self, layout: UnitLayout, i: int) -> tuple[bool, ...]:
        """Row ``i`` (in ``rows``' order) covers the parameters of its optimizer's label (those its rows cover)."""
        return tuple(self._row_mask(layout, self._row_label(i)))

    def extra_entries(self, layout: UnitLayout, state: PartitionState) -> dict:
        """Parameter name -> its checkpoint entries beside the rows (its label's optimizer's ``extra_entries``)."""
        return {name: dict(f) for part in state.extra.values() for name, f in part.items()}

    def zero_extra(self, state: PartitionState) -> PartitionState:
        """``state`` with new zero tensors beside the rows, for a load to fill."""
        return dataclasses.replace(state, extra=FrozenMap({label: FrozenMap(
            {n: FrozenMap({k: torch.zeros_like(t) for k, t in f.items()}) for n, f in part.items()})
            for label, part in state.extra.items()}))

    def optimizer_of(self, name: str):
        """The optimizer that updates parameter ``name`` (its label's): what a checkpoint asks per parameter."""
        return dict(self.optimizers)[self._label_of[name]]

    def count_key_of(self, name: str) -> str | None:
        return self.optimizer_of(name).count_key

    def fingerprint(self, count: int) -> tuple:
        labels = (len(self.labels), zlib.crc32(repr(self.labels).encode())) if self.labels else None
        return tuple((label, o.fingerprint(count)) for label, o in self.optimizers) + (labels,)

    def bind(self, model: torch.nn.Module) -> "Partition":
        """Each trainable parameter's label (``label_fn``), checked against the optimizers (and by the optimizer's
        ``check_param`` where it has one: Muon's 2-D check), and each optimizer bound to ``model``."""
        subs, labels = dict(self.optimizers), []
        named: dict = {label: [] for label in subs}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            label = self.label_fn(name, p)
            if not isinstance(label, str) or label not in subs:
                raise ArgumentError(f"fs.partition: label_fn({name!r}, param) returned {label!r}, which names no "
                                    f"optimizer; the labels are {sorted(subs)}.")
            named[label].append((name, p))
            labels.append((name, label))
        # an optimizer that takes its own parameters (for_params: Muon's 2-D check and deal) gets its label's
        bound = tuple((label, o.for_params(named[label]) if hasattr(o, "for_params") else o.bind(model))
                      for label, o in self.optimizers)
        return dataclasses.replace(self, optimizers=bound, labels=tuple(labels))

    def param_groups(self, layouts, updates: int) -> list[dict]:
        """The torch twins' ``param_groups``, each optimizer's over its own parameters, in label order."""
        out = []
        for label, o in self.optimizers:
            mine = [dataclasses.replace(u, slots=tuple(s for s, on in zip(u.trainable, self._mask(u, label)) if on))
                    for u in layouts]
            out += [g for g in o.param_groups(mine, updates) if g["params"]]
        return out

    def init(self, layout: UnitLayout, rank: int, shard: torch.Tensor) -> PartitionState | None:
        if not layout.trainable:
            return None
        ranges, parts, extra = layout.trainable_ranges(rank), {}, {}
        for label, o in self.optimizers:
            n = sum(max(0, hi - lo) for (lo, hi), on in zip(ranges, self._row_mask(layout, label)) if on)
            parts[label] = FrozenMap({r.name: state_empty(n, r.dtype_for(shard.dtype), shard.device,
                                                          lambda t, v=r.init: t.fill_(v))
                                      for r in o.rows})  # (at each row's initial value: Adagrad's is not 0)
            mine = {s.name for s, on in zip(layout.trainable, self._mask(layout, label)) if on}
            own = o.extra_entries(layout, o.init(layout, rank, shard)) if hasattr(o, "extra_entries") else {}
            extra[label] = FrozenMap({name: FrozenMap(e) for name, e in own.items() if name in mine})
        return PartitionState(torch.zeros(len(layout.trainable), dtype=torch.int64), FrozenMap(parts),
                              FrozenMap(extra))

    def plan(self, layout, rank, count, active, updates=0):
        raise ArgumentError("fs.partition has no plan of its own: its rows cover only their own optimizer's "
                            "parameters, so a policy that streams whole rows (fs.offload_state) cannot drive it.")

    def apply(self, *args, **kwargs):
        raise ArgumentError("fs.partition has no apply of its own: update() runs each optimizer on its parameters.")

    def update(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor, state: PartitionState,
               active: list[bool], donate: bool, grad_scale: float = 1.0, updates: int = 0,
               copy: torch.Tensor | None = None, comm=None):
        """Each optimizer's step on its own parameters (see the module docstring); ``comm``: the step's collectives,
        passed to an optimizer that needs them. Returns the new parameter shard, state and copy."""
        return drive(self.update_phases(layout, rank, param, grad, state, active, donate, grad_scale, updates, copy,
                                        comm))

    def update_phases(self, layout: UnitLayout, rank: int, param: torch.Tensor, grad: torch.Tensor,
                      state: PartitionState, active: list[bool], donate: bool, grad_scale: float = 1.0,
                      updates: int = 0, copy: torch.Tensor | None = None, comm=None):
        """``update`` as a generator that pauses where a member's ``step_phases`` does (``fs.muon``'s two
        exchanges in flight: the update policy runs the other units' phases there); returns ``update``'s result."""
        count = counted(state.count, active)
        if not any(active):
            return param, state.with_rows(count, state.rows), copy
        if not donate:
            param, copy = state_copy(param), None if copy is None else state_copy(copy)
        parts, extra, ranges = {}, dict(state.extra), layout.trainable_ranges(rank)
        for label, o in self.optimizers:
            rows = tuple(state.parts[label].values())
            on = [a and m for a, m in zip(active, self._mask(layout, label))]
            if any(on) and not donate:
                rows = tuple(state_copy(r) for r in rows)
                extra[label] = FrozenMap({n: FrozenMap({k: t.clone() for k, t in f.items()})
                                          for n, f in extra[label].items()})
            at, pos = {}, 0  # slot -> where its range starts in the label's compact rows (0 where it has none)
            for k, ((lo, hi), m) in enumerate(zip(ranges, self._row_mask(layout, label))):
                at[k], pos = pos, pos + (max(0, hi - lo) if m else 0)
            if any(on) and hasattr(o, "step_slots"):
                kw = {"comm": comm} if getattr(o, "collective", False) else {}
                if hasattr(o, "extra_entries"):  # (its counts and its state beside the rows: Adafactor's)
                    kw.update(count=count, extra=extra[label])
                phased = getattr(o, "step_phases", None)
                phases = (phased or o.step_slots)(layout, rank, param, grad, rows,
                                                  [(k, at[k]) for k, a in enumerate(on) if a], grad_scale, updates,
                                                  copy, **kw)
                if phased is not None:
                    yield from phases
            elif any(on):
                start = {ranges[k][0]: at[k] for k, a in enumerate(on) if a and ranges[k][1] > ranges[k][0]}
                _, segments = o.plan(layout, rank, state.count, on, updates)
                # (a run is adjacent slots of this label: adjacent in the rows too)
                apply_runs(o, [(param[lo:hi], grad[lo:hi], tuple(r[start[lo]:start[lo] + hi - lo] for r in rows), step,
                                grad_scale, lr, wd, None if copy is None else copy[lo:hi])
                               for lo, hi, step, lr, wd in segments])
            parts[label] = rows
        new = state.with_rows(count, [r for label, _ in self.optimizers for r in parts[label]])
        return param, dataclasses.replace(new, extra=FrozenMap(extra)), copy

    def exchange_plan(self, layout: UnitLayout, rank: int, active: list[bool], n: int) -> list[list] | None:
        """The exchanges its optimizers' update issues, per phase of ``update_phases`` (each member's phases in
        label order, a member's last phase running on into the next member's first); None where a collective member
        cannot say (its collectives are then checked one by one)."""
        phases: list[list] = [[]]
        if not any(active):
            return phases
        for label, o in self.optimizers:
            on = [a and m for a, m in zip(active, self._mask(layout, label))]
            if getattr(o, "collective", False) and not hasattr(o, "exchange_plan"):
                return None
            if any(on) and hasattr(o, "step_phases"):
                mine = o.exchange_plan(layout, rank, on, n)
                if mine is None:
                    return None
                phases[-1] += mine[0]
                phases += mine[1:]
        return phases

    def exchange_bytes(self, layout: UnitLayout, rank: int, active: list[bool], n: int) -> int:
        """The bytes its optimizers' exchanges send in an update of the ``active`` slots (``fs.muon``'s)."""
        return sum(o.exchange_bytes(layout, rank, [a and m for a, m in zip(active, self._mask(layout, label))], n)
                   for label, o in self.optimizers if hasattr(o, "exchange_bytes"))

    def resolved_impl(self, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
        return "+".join(sorted({o.resolved_impl(device, dtype) for _, o in self.optimizers}))


def partition(optimizers: Mapping, label_fn: Callable) -> Partition:
    """Several optimizers over disjoint parameter groups in one state: ``optimizers`` maps a label to an fshard
    optimizer, ``label_fn(name, param) -> label`` (canonical names, as ``model.named_parameters()`` gives them)
    chooses each trainable parameter's, e.g. ``fs.partition({"muon": fs.muon(lr=0.02), "adamw": fs.adamw(3e-4)},
    lambda name, p: "muon" if p.ndim == 2 and "emb" not in name else "adamw")``."""
    if not isinstance(optimizers, Mapping) or not optimizers:
        raise ArgumentTypeError(f"fs.partition(optimizers={optimizers!r}): a non-empty dict label -> optimizer, e.g. "
                                "{'muon': fs.muon(), 'adamw': fs.adamw()}.")
    for label, o in optimizers.items():
        if not isinstance(label, str):
            raise ArgumentTypeError(f"fs.partition: label {label!r} must be a str.")
        if isinstance(o, Partition):
            raise ArgumentTypeError(f"fs.partition: {label!r} is itself an fs.partition; give one partition all "
                                    "the labels.")
        odd = hasattr(o, "covers") or hasattr(o, "extra_entries")  # (Adafactor: one compact row, factors beside)
        if odd and (not hasattr(o, "step_slots") or len(o.rows) > 1):
            raise ArgumentTypeError(f"fs.partition: {label!r} maps to {type(o).__name__}, whose state is not rows "
                                    "over every one of its parameters (compact rows, or state beside the rows) and "
                                    "which has no step_slots over one such row, so a partition cannot drive it. Use "
                                    "it alone (fs.init(model, mesh, optimizer)).")
        if not all(hasattr(o, a) for a in ("rows", "update", "plan", "apply", "init", "param_groups")):
            raise ArgumentTypeError(f"fs.partition: {label!r} maps to {o!r}, not an fshard optimizer (fs.adamw(...), "
                                    "fs.muon(...), ...).")
    if not callable(label_fn):
        raise ArgumentTypeError(f"fs.partition(label_fn={label_fn!r}): a callable label_fn(name, param) -> label.")
    return Partition(tuple(optimizers.items()), label_fn)
