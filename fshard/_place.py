"""``fs.init(..., offload=)``: each unit's optimizer moments (and, with ``offload_state(params=True)``, its parameter
shard) go straight into the store as the unit is made, so the device never holds more than one unit's moments and
parameters (a model that fits only in the store can be initialised).

The alternative, moving them on the first step (what ``offload_state`` does with a state from a plain ``fs.init``),
needs every moment on the device first: a 6.3B-parameter GPT's 50 GB of moments beside its 25 GB of fp32 weights
ran an H100 out of memory at init. The placement is the transform's own (``choose_units``: whole units in model order
up to ``fraction`` of the moment bytes, chunks of ``chunk_mb``), so the step finds them where it would have put them.
"""
from __future__ import annotations

import uuid

from ._errors import ArgumentTypeError
from ._early import param_key
from ._stored import put_moments, put_param
from .store._protocol import locked


def choose_units(spec, opt_state, fraction: float) -> frozenset:
    """The units offload_state(fraction=...) places in its store: whole units in model order until their moments
    make up ``fraction`` of all moment bytes (fs.load(..., offload=) places a loaded state's moments the same way)."""
    return choose_layouts([u for u in spec.units if opt_state.get(u.name) is not None], spec.mesh.rank, fraction)


def choose_layouts(layouts, rank: int, fraction: float) -> frozenset:
    """``choose_units`` over the unit layouts that have moments, before a state exists (fs.init(..., offload=))."""
    sizes = [(u.name, 2 * u.opt_numel(rank)) for u in layouts]
    total, acc, names = sum(b for _, b in sizes), 0, set()
    for name, b in sizes:
        if acc >= fraction * total - 1e-9 * total:
            break
        names.add(name)
        acc += b
    return frozenset(names)


def placer(offload, layouts, mesh):
    """``place(layout, param, moments) -> (param, moments)``: for a unit ``offload`` keeps in its store, the same
    zero moments as chunk items in the store (``Stored`` leaves), and with ``offload_state(params=True)`` its
    parameter shard too (a ``StoredParam``); the others as they are. None without ``offload``."""
    if offload is None:
        return None
    from ._offload import offload_state  # (which imports this module)
    if not isinstance(offload, offload_state):
        raise ArgumentTypeError(f"fs.init(..., offload=): pass the fs.offload_state(...) the step will be composed "
                                f"with, not {type(offload).__name__}.")
    store, chunk, tag = offload.store, offload.chunk_numel, uuid.uuid4().hex[:8]
    # the units AdamW makes moments for (AdamW.init: the trainable ones)
    chosen = choose_layouts([u for u in layouts if u.trainable], mesh.rank, offload.fraction)

    def place(u, param, s):
        if u.name not in chosen:
            return param, s
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
