"""Which units of an ``fs.offload_state`` go to which tier (``choose_tiers``, ``choose_stores``: whole units in
model order, each tier's ``fraction`` of the optimizer-state bytes in turn). ``offload_state.placement`` states the
same rule as data (fshard/state/_placement.py's ``Where``), which ``fs.init(..., offload=)`` and
``fs.load(..., offload=)`` follow; a unit's rows are written into its store by ``put_moments``
(fshard/state/_stored.py).
"""
from __future__ import annotations



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
    tiers = choose_tiers([u for u in spec.units if opt_state.get(u.name) is not None], spec.mesh.shard_rank, fractions)
    return {name: stores[t] for name, t in tiers.items()}
