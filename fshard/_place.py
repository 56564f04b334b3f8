"""``fs.init(..., offload=)``: each unit's optimizer moments go straight into the store as the unit is made, so the
device never holds more than one unit's moments (a model whose moments fit only in the store can be initialised).

The alternative, moving them on the first step (what ``offload_state`` does with a state from a plain ``fs.init``),
needs every moment on the device first: a 6.3B-parameter GPT's 50 GB of moments beside its 25 GB of fp32 weights
ran an H100 out of memory at init. The placement is the transform's own (``choose_units``: whole units in model order
up to ``fraction`` of the moment bytes, chunks of ``chunk_mb``), so the step finds them where it would have put them.
"""
from __future__ import annotations

import uuid

from ._errors import ArgumentTypeError
from ._offload import choose_layouts, offload_state
from ._stored import put_moments
from .store._protocol import locked


def placer(offload, layouts, mesh):
    """``place(name, moments) -> moments``: for a unit ``offload`` keeps in its store, the same zero moments as
    chunk items in the store (``Stored`` leaves); the others as they are. None without ``offload``."""
    if offload is None:
        return None
    if not isinstance(offload, offload_state):
        raise ArgumentTypeError(f"fs.init(..., offload=): pass the fs.offload_state(...) the step will be composed "
                                f"with, not {type(offload).__name__}.")
    store, chunk, tag = offload.store, offload.chunk_numel, uuid.uuid4().hex[:8]
    # the units AdamW makes moments for (AdamW.init: the trainable ones)
    chosen = choose_layouts([u for u in layouts if u.trainable], mesh.rank, offload.fraction)

    def place(name: str, s):
        if name not in chosen:
            return s
        created = []
        try:
            with locked(store):
                return put_moments(store, f"{name}@init-{tag}", s, chunk, created)
        except BaseException:
            store.delete_later(created)  # the items written before the failure: no state refers to them
            raise

    return place
