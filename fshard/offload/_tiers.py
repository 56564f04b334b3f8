"""Which units of an ``fs.offload_state`` go to which tier (``choose_tiers``, ``choose_stores``: whole units in
model order, each tier's ``fraction`` of the optimizer-state bytes in turn), and a unit's optimizer rows (as many as
the optimizer declares) written into its store as chunk items (``put_moments``: ``Stored`` leaves,
fshard/state/_stored.py). ``fs.init(..., offload=)`` places units
by the same rule as they are made (fshard/offload/_placer.py), and so does ``fs.load(..., offload=)``.
"""
from __future__ import annotations

import torch

from ..errors import ArgumentError
from ..state._stored import Stored, _chunks, _Items, _location


def choose_tiers(layouts, rank: int, fractions) -> dict:
    """Unit name -> tier (an index into ``fractions``): whole units in model order, the first ones to tier 0 until
    their moments make up ``fractions[0]`` of all moment bytes, the next ones to tier 1 until the tiers so far hold
    ``fractions[0] + fractions[1]``, and so on; the units left stay on the device (absent)."""
    sizes = [(u.name, u.opt_numel(rank)) for u in layouts]  # (every unit keeps the same rows: elements weigh alike)
    total, acc, out, tier, bound = sum(b for _, b in sizes), 0, {}, 0, fractions[0]
    for name, b in sizes:
        while tier < len(fractions) and acc >= (bound - 1e-9) * total:  # this tier is full: the next one
            tier += 1
            bound += fractions[tier] if tier < len(fractions) else 0.0
        if tier == len(fractions):
            break
        out[name] = tier
        acc += b
    return out


def choose_stores(spec, opt_state, stores, fractions) -> dict:
    """Unit name -> the store of its tier (``choose_tiers`` over the units that have moments): offload_state's
    placement, which fs.init(..., offload=) and fs.load(..., offload=) follow too."""
    tiers = choose_tiers([u for u in spec.units if opt_state.get(u.name) is not None], spec.mesh.rank, fractions)
    return {name: stores[t] for name, t in tiers.items()}



def stored_state(like, items: "_Items", count, numel: int, dtype, location: str):
    """A unit state of ``like``'s kind whose rows are the rows of ``items`` (``Stored`` leaves), with ``count``."""
    return like.with_rows(count, [Stored(items, r, numel, dtype, location) for r in range(len(items.rows))])


def put_moments(store, key: str, s, names: tuple[str, ...], chunk: int, created: list):
    """``s``'s rows (named ``names``, the optimizer's declared rows) written to ``store`` (the caller holds its lock)
    as chunk items ``(key, i)``, the rows stacked, each key noted in ``created`` as it is written: the same state
    with Stored leaves."""
    rows = s.rows
    if not rows:  # an optimizer without per-parameter rows (plain SGD): nothing to keep in the store
        return s
    if len({r.dtype for r in rows}) > 1:
        raise ArgumentError(f"fs.offload_state keeps a unit's optimizer rows stacked in one store item, so they need "
                            f"one dtype; the rows {names} are {[r.dtype for r in rows]}. Keep this optimizer's state "
                            "on the device (offload_state(fraction=0) or no offload).")
    n, dtype = rows[0].numel(), rows[0].dtype
    chunks, handles = _chunks(n, chunk), []
    for i, (lo, hi) in enumerate(chunks):
        handles.append(store.put((key, i), torch.stack([r[lo:hi] for r in rows])))
        created.append((key, i))
    for h in handles:
        h.wait()
    return stored_state(s, _Items(store, key, chunks, names), s.count, n, dtype, _location(store))
