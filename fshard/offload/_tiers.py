"""``fs.init(..., offload=)``: each unit's optimizer moments (and, with ``offload_state(params=True)``, its parameter
shard) go straight into the store as the unit is made, so the device never holds more than one unit's moments and
parameters (a model that fits only in the store can be initialised).

The alternative, moving them on the first step (what ``offload_state`` does with a state from a plain ``fs.init``),
needs every moment on the device first: a 6.3B-parameter GPT's 50 GB of moments beside its 25 GB of fp32 weights
ran an H100 out of memory at init. The placement is the transform's own (``choose_tiers``: whole units in model order,
each tier's ``fraction`` of the moment bytes in turn, chunks of ``chunk_mb``), so the step finds them where it would
have put them.
"""
from __future__ import annotations

import uuid

from ..errors import ArgumentTypeError
from ._pipeline import param_key
from ..state._stored import put_moments, put_param
from ..store._protocol import locked


def choose_tiers(layouts, rank: int, fractions) -> dict:
    """Unit name -> tier (an index into ``fractions``): whole units in model order, the first ones to tier 0 until
    their moments make up ``fractions[0]`` of all moment bytes, the next ones to tier 1 until the tiers so far hold
    ``fractions[0] + fractions[1]``, and so on; the units left stay on the device (absent)."""
    sizes = [(u.name, 2 * u.opt_numel(rank)) for u in layouts]
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


def placer(offload, layouts, mesh):
    """``place(layout, param, moments) -> (param, moments)``: for a unit ``offload`` keeps in its store, the same
    zero moments as chunk items in the store (``Stored`` leaves), and with ``offload_state(params=True)`` its
    parameter shard too (a ``StoredParam``); the others as they are. None without ``offload``."""
    if offload is None:
        return None
    from ._transform import offload_state  # (which imports this module)
    if not isinstance(offload, offload_state):
        raise ArgumentTypeError(f"fs.init(..., offload=): pass the fs.offload_state(...) the step will be composed "
                                f"with, not {type(offload).__name__}.")
    chunk, tag = offload.chunk_numel, uuid.uuid4().hex[:8]
    # the units AdamW makes moments for (AdamW.init: the trainable ones)
    tiers = choose_tiers([u for u in layouts if u.trainable], mesh.rank, offload.fractions)

    def place(u, param, s):
        if u.name not in tiers:
            return param, s
        store = offload.stores[tiers[u.name]]
        created = []
        try:
            with locked(store):
                s = put_moments(store, f"{u.name}@init-{tag}", s, chunk, created)
                if offload.params:
                    param = put_param(store, param_key(f"{u.name}@init-{tag}"), param, u.opt_numel(mesh.rank),
                                      chunk, created)
                return param, s
        except BaseException:
            store.delete_later(created)  # the items written before the failure: no state refers to them
            raise

    return place
