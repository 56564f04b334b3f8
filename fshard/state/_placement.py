"""Where a unit's state lives, as data (issue #39, "Placement is a property of the state").

A unit's parameter shard and optimizer rows are in memory (tensors) or in a store (``Stored``/``StoredParam`` leaves,
fshard/state/_stored.py). ``Where`` says which store, in items of how many elements, and whether the parameter shard
is there beside the rows. A ``Placement`` is anything that says it per unit (``fs.offload_state`` is one:
``offload_state.placement``); ``fs.init(..., offload=)`` writes each unit where its placement says as the unit is
made (``place_unit``), and ``fs.load(..., offload=)`` makes its load targets there. A state says where it keeps its
own units (``placement_of``), read from its leaves, so a load without ``offload=`` keeps ``like``'s placement.

So model/ and checkpoint/ ask a placement for data and never import the transform that keeps it (fshard/offload/).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import ArgumentTypeError
from ..store._protocol import locked
from ._flat import UnitLayout
from ._stored import in_store, param_key, put_moments, put_param, stored_items


@dataclass(frozen=True)
class Where:
    """Where one unit's state lives outside memory: ``store`` holds its optimizer rows (and, with ``params``, its
    parameter shard), as items of ``chunk`` elements per row."""

    store: Any
    chunk: int
    params: bool = False


@runtime_checkable
class Placement(Protocol):
    """What ``fs.init(..., offload=)`` and ``fs.load(..., offload=)`` take: an object that says where each unit's
    state goes (``fs.offload_state(...)`` is one)."""

    def placement(self, units: Sequence[UnitLayout], rank: int) -> Mapping[str, Where]:
        """Unit name -> ``Where`` for the units kept in a store, among ``units`` (those with optimizer state, in
        model order); a unit left out stays in memory."""


def check_placement(placement, caller: str) -> None:
    """An object without the protocol is an ``ArgumentTypeError`` naming the call (``caller``) and the fix."""
    if not callable(getattr(placement, "placement", None)):
        raise ArgumentTypeError(f"{caller}: pass the fs.offload_state(...) the step is composed with (or another "
                                f"placement: an object with placement(units, rank)), not {type(placement).__name__}.")


def placement_for(placement, units: Sequence[UnitLayout], rank: int, caller: str) -> dict[str, Where]:
    """``placement.placement(units, rank)``, checked (``check_placement``, and every value a ``Where``)."""
    check_placement(placement, caller)
    where = dict(placement.placement(tuple(units), rank))
    bad = [n for n, w in where.items() if not isinstance(w, Where)]
    if bad:
        raise ArgumentTypeError(f"{caller}: {type(placement).__name__}.placement must map unit names to "
                                f"fshard.state.Where, got {type(where[bad[0]]).__name__} for unit {bad[0]!r}.")
    return where


def placement_of(state) -> dict[str, Where]:
    """Where ``state`` keeps its units (unit name -> ``Where``; units in memory are absent), read from its leaves:
    the store of its rows (else of its parameter shard), the size of their first item, and whether the parameter
    shard is in a store too."""
    out = {}
    for name, p in state.params.items():
        rows, param = stored_items(state.opt_state.get(name)), in_store(p)
        if rows is None and param is None:
            continue
        parts = (rows,) if rows is not None else (param.head, param.tail)
        items = next(i for i in parts if i is not None)
        lo, hi = items.chunks[0]
        out[name] = Where(items.store, max(1, hi - lo), param is not None)
    return out


def place_unit(where: Where | None, u: UnitLayout, rank: int, param, s, rows: tuple[str, ...], key: str):
    """``(param, s)`` of unit ``u`` written where ``where`` says (``fs.init(..., offload=)``, as each unit is made):
    its optimizer rows (named ``rows``) as chunk items under ``key``, and with ``where.params`` its parameter shard;
    as they are where ``where`` is None. Items written before a failure are deleted (no state refers to them)."""
    if where is None or s is None:
        return param, s
    created = []
    try:
        with locked(where.store):
            s = put_moments(where.store, key, s, rows, where.chunk, created)
            if where.params:
                param = put_param(where.store, param_key(key), param, u.opt_numel(rank), where.chunk, created)
        return param, s
    except BaseException:
        where.store.delete_later(created)
        raise


__all__ = ["Where", "Placement", "check_placement", "placement_for", "placement_of", "place_unit"]
