"""fs.gather_ahead: gather the next units while the current one computes, in forward and in backward.

The gather order is a value, not a trace cache: ``GatherOrder(forward, backward)`` lists the units in the order the step
acquires them. A step walks it with a cursor; at each position it starts the gathers of the next ``depth`` units
(async, in the backend's threads or on a CUDA side stream) and waits only on the unit about to compute.

What counts as a position (an "event"): in forward, the root unit at the start and each call of a unit module; in
backward, the first time backward is about to use a unit (a gradient reaches an output of its call, autograd reads
one of its saved tensors, or a checkpoint recomputes its call) after that unit's previous backward use finished (or
after forward); a routed group's members are events at its container's call. The same rule runs when recording
and when replaying, and it does not depend on which units happen to be gathered, so an order recorded in one
step replays exactly in the next one with the same model order.

The window of an event is the next ``depth`` positions, where the root's positions count for none: where backward
begins with the root (its parameters used after the last unit's call, as a GPT's head), it is still gathered from
forward, and a position spent on it would prefetch nothing. After a use, a unit is released unless it is not to be
resharded after forward, or the next event or its window needs it again (``depth`` + 1 such positions): freed, it
would be gathered again at once. Off the gather order, a unit kept so stays gathered until its use or the step's end.

The gather order never changes a result, only when gathers are issued: every gather is of the unit whose name the
position holds, into that unit's own buffer, and data is read only after waiting on that unit's own gather. If
the model's order changes, the first event that does not match stops all prefetching for the rest of the step
(in-flight gathers are completed and freed). Then either the step finishes blocking and the observed order
becomes the gather order (``on_change="replan"``, with a warning), or the step raises ``GatherOrderError`` right there,
inside forward or backward (``on_change="error"``), before any update, with the state untouched.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..protocol._stages import GatherPolicy
from ..state._flat import ROOT
from ..errors import ArgumentError, ArgumentTypeError, GatherOrderError
from ..protocol._transform import Transform


@dataclass(frozen=True)
class GatherOrder:
    """The order in which a step acquires units: ``forward`` then ``backward`` (unit names; a unit used twice
    appears twice). Inspect it as ``step.gather_order``; pass one to ``fs.gather_ahead(order=...)`` to override."""

    forward: tuple[str, ...]
    backward: tuple[str, ...]

    def __post_init__(self):
        for f in ("forward", "backward"):
            v = getattr(self, f)
            if isinstance(v, str) or not all(isinstance(n, str) for n in v):
                raise ArgumentTypeError(f"GatherOrder.{f} must be a sequence of unit names, got {v!r}.")
            object.__setattr__(self, f, tuple(v))

    @property
    def events(self) -> tuple[str, ...]:
        return self.forward + self.backward

    def __repr__(self) -> str:
        return f"GatherOrder(forward={list(self.forward)}, backward={list(self.backward)})"


class _Walk:
    """One step's progress through the gather order."""

    def __init__(self, order: GatherOrder | None, training: bool = True):
        # an eval pass (forward only) walks the forward half; prefetching backward's units would gather for nothing
        self.plan = () if order is None else order.events if training else order.forward
        self.on_plan = order is not None  # False once an event did not match: blocking from then on
        self.forward: list[str] = []
        self.backward: list[str] = []
        self.active: set[str] = set()  # units with a backward use under way
        self.uses: dict[str, int] = {}  # forward uses per unit, for reshard_after_forward=False
        self.done_uses: dict[str, int] = {}
        self.prefetched = 0

    @property
    def cursor(self) -> int:
        return len(self.forward) + len(self.backward)


class GatherAhead(GatherPolicy):
    """The gather policy of ``fs.gather_ahead`` (see the module docstring). Per step, its walk and counts live in
    ``step.scratch(self)``; the gather order, which never changes a result, lives here."""

    def __init__(self, depth: int, order: GatherOrder | None, reshard_after_forward, on_change: str):
        self.depth, self.gather_order = depth, order
        self.reshard_after_forward, self.on_change = reshard_after_forward, on_change
        self.replans = 0
        self._checked = None  # (gather order, unit names) last validated

    # --- the gather protocol -------------------------------------------------------------------------------------

    def start(self, run) -> None:
        run.scratch(self)["walk"] = _Walk(self.gather_order, run.training)
        self._check_names(run)

    def before_forward(self, run, unit) -> None:
        w = run.scratch(self)["walk"]
        w.uses[unit.name] = w.uses.get(unit.name, 0) + 1
        self._event(run, w.forward, unit)

    def after_forward(self, run, unit) -> None:
        if not self._keep(run, unit, forward=True):
            unit.release()

    def before_backward(self, run, unit) -> None:
        w = run.scratch(self)["walk"]
        name = unit.name
        if run.phase != "backward":  # a saved tensor read during forward (e.g. by a custom autograd.Function)
            return unit.acquire()
        if name in w.active:  # the same backward use, still under way
            return unit.acquire()
        w.active.add(name)
        self._event(run, w.backward, unit)

    def after_backward(self, run, unit) -> None:
        w = run.scratch(self)["walk"]
        name = unit.name
        w.active.discard(name)
        w.done_uses[name] = w.done_uses.get(name, 0) + 1
        if not self._keep(run, unit, forward=False):
            unit.release()

    def finish(self, run) -> dict:
        """After each micro-batch's backward (an eval pass: after its forward): settle the gather order and report the
        step's counts so far (the step then releases what is left)."""
        scratch = run.scratch(self)
        w = scratch["walk"]
        observed = GatherOrder(tuple(w.forward), tuple(w.backward))
        if run.training:  # an eval pass neither records nor changes the gather order
            if self.gather_order is None:
                self.gather_order = observed  # first step: recorded with no prefetch (a warm-up, as Gemini does)
            elif observed != self.gather_order:
                self._changed(run, observed)  # raises with on_change="error"
                self.gather_order = observed
                scratch["replanned"] = scratch.get("replanned", 0) + 1
        scratch["prefetched"] = scratch.get("prefetched", 0) + w.prefetched
        return {"gather/depth": self.depth, "gather/prefetched": scratch["prefetched"],
                "gather/replanned": scratch.get("replanned", 0)}

    # --- the walk ------------------------------------------------------------------------------------------------

    def _event(self, run, phase: list[str], unit) -> None:
        w = run.scratch(self)["walk"]
        k = w.cursor
        phase.append(unit.name)
        if w.on_plan and (k >= len(w.plan) or w.plan[k] != unit.name):
            self._stop(run)
            if self.on_change == "error" and run.training:  # eval-only control flow may differ: blocking there
                self._changed(run, None, at=k, got=unit.name)
        unit.launch()  # before the units ahead: issued after their gathers, its own would wait behind them
        if w.on_plan:
            for name in self._window(w, k + 1):
                u = run.units[name]
                if not u.alive:
                    u.launch()
                    w.prefetched += 1
        unit.acquire()

    def _window(self, w: _Walk, start: int, extra: int = 0) -> list[str]:
        """The distinct units of the next ``depth`` (+ ``extra``) positions from ``start``, where the root's
        positions count for none (the module docstring says why)."""
        seen: list[str] = []
        left = self.depth + extra
        plan = w.plan
        for i in range(start, len(plan)):  # (by index: a slice would copy the rest of the plan at every event)
            if left <= 0:
                break
            name = plan[i]
            if name != ROOT:
                left -= 1
            if name not in seen:
                seen.append(name)
        return seen

    def _keep(self, run, unit, forward: bool) -> bool:
        """Keep a unit gathered instead of freeing it: it is not to be resharded after forward (until its last
        backward use), or a position up to the window the next event prefetches needs it again. That is one position
        past the current window: freed, such a unit (at the end of forward, the one before the last) would be
        gathered again by the very next event, which costs a gather and holds no less memory."""
        w, name = run.scratch(self)["walk"], unit.name
        if run.training and not self._reshard(name) and (forward or w.done_uses.get(name, 0) < w.uses.get(name, 0)):
            return True
        return w.on_plan and name in self._window(w, w.cursor, extra=1)

    def _stop(self, run) -> None:
        """Leave the plan: complete every gather in flight and free what nobody is using."""
        w = run.scratch(self)["walk"]
        w.on_plan = False
        current = set(w.active)
        for u in run.units.values():
            if u.in_flight and u.name not in current:
                u.release()

    def _changed(self, run, observed: GatherOrder | None, at: int | None = None, got: str | None = None) -> None:
        old = self.gather_order
        if self.on_change == "error":
            where = (f"at position {at} the step acquired {got!r} where the gather order has "
                     f"{old.events[at]!r}" if at is not None and at < len(old.events) else
                     f"the step acquired {got!r} after the gather order's last position" if at is not None else
                     f"the step acquired units in the order {observed!r}")
            raise GatherOrderError(
                f"the model's unit order differs from gather_ahead's gather order: {where}. The order was "
                f"{old!r}. Nothing was updated. If the order legitimately changes between steps, use "
                "fs.gather_ahead(on_change='replan') (the default), which finishes such a step without prefetch "
                "and adopts the new order; or pass the right order with fs.gather_ahead(order=fs.GatherOrder(...)).")
        self.replans += 1
        if self.replans == 1:
            warnings.warn(f"fshard gather_ahead: the model's unit order changed; the step ran without prefetch "
                          f"from the first difference and the gather order is now {observed!r} (was {old!r}). Further "
                          "changes are counted in metrics['gather/replanned'] without a warning.", stacklevel=4)

    def _reshard(self, name: str) -> bool:
        r = self.reshard_after_forward
        if isinstance(r, bool):
            return r
        if isinstance(r, Mapping):
            return bool(r.get(name, True))
        return bool(r(name))

    def _check_names(self, run) -> None:
        key = (self.gather_order, tuple(run.units))
        if self._checked == key:
            return
        known = set(run.units)
        names = set(self.gather_order.events) if self.gather_order is not None else set()
        if isinstance(self.reshard_after_forward, Mapping):
            names |= set(self.reshard_after_forward)
        unknown = sorted(names - known)
        if unknown:
            raise ArgumentError(f"fs.gather_ahead: unknown unit names {unknown}; this state's units are "
                                f"{sorted(known)}.")
        self._checked = key


class gather_ahead(Transform):
    """Prefetch the all-gathers of the next ``depth`` units while the current one computes.

    depth: how many units ahead to gather (0: none; the gather order is still recorded and checked).
    order: an ``fs.GatherOrder``; by default the first step records it, without prefetch.
    reshard_after_forward: True (free each unit after its forward), False (keep every unit gathered from forward to
        backward: one all-gather per unit instead of two, for more memory), or a mapping / callable from unit name
        to bool, per unit.
    on_change: what a step does when the model's order differs from the gather order: "replan" (finish the step
        without prefetch, adopt the new order, warn once) or "error" (raise ``fs.errors.GatherOrderError``).

    Live memory: at most depth + 1 gathered units besides the root unit in forward (the current one and the
    prefetched ones), one more in backward; ``metrics["mem/peak_gathered_bytes"]`` measures it.
    """

    name = "gather_ahead"
    stages = {"gather": "set"}

    def __init__(self, depth: int = 2, order: GatherOrder | None = None,
                 reshard_after_forward: bool | Mapping[str, bool] | Callable[[str], bool] = True,
                 on_change: str = "replan"):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ArgumentError(f"fs.gather_ahead: depth must be an int >= 0 (units gathered ahead), got {depth!r}.")
        if order is not None and not isinstance(order, GatherOrder):
            raise ArgumentTypeError(f"fs.gather_ahead: order must be an fs.GatherOrder (or None to record one), got "
                                    f"{type(order).__name__}.")
        if on_change not in ("replan", "error"):
            raise ArgumentError(f"fs.gather_ahead: on_change must be 'replan' or 'error', got {on_change!r}.")
        if not isinstance(reshard_after_forward, (bool, Mapping)) and not callable(reshard_after_forward):
            raise ArgumentTypeError("fs.gather_ahead: reshard_after_forward must be a bool, a mapping from unit name "
                                    f"to bool, or a callable, got {type(reshard_after_forward).__name__}.")
        self.depth, self.order = depth, order
        self.reshard_after_forward, self.on_change = reshard_after_forward, on_change

    def wrap_gather(self, gather: GatherPolicy) -> GatherPolicy:
        # Each composed step gets its own policy, so two steps built from one transform keep their own gather order.
        return GatherAhead(self.depth, self.order, self.reshard_after_forward, self.on_change)

    def __repr__(self) -> str:
        return f"fs.gather_ahead(depth={self.depth})"
