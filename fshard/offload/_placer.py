"""``fs.init(..., offload=)``: each unit's optimizer moments (and, with ``offload_state(params=True)``, its parameter
shard) go straight into the store as the unit is made, so the device never holds more than one unit's moments and
parameters (a model that fits only in the store can be initialised).

The alternative, moving them on the first step (what ``offload_state`` does with a state from a plain ``fs.init``),
needs every moment on the device first: a 6.3B-parameter GPT's 50 GB of moments beside its 25 GB of fp32 weights
ran an H100 out of memory at init. The placement is the transform's own (``choose_tiers``: whole units in model order,
each tier's ``fraction`` of the moment bytes in turn, chunks of ``chunk_mb``), so the step finds them where it would
have put them.
"""

import uuid

from ..errors import ArgumentTypeError
from ._pipeline import param_key
from ._tiers import choose_tiers, put_moments
from ._transform import offload_state, refuse_unstreamable
from ..state._stored import put_param
from ..store._protocol import locked


def placer(offload, layouts, mesh, names: tuple[str, ...], opt=None):
    """``place(layout, param, state) -> (param, state)``: for a unit ``offload`` keeps in its store, the same
    zero optimizer rows (named ``names``, as the optimizer declares them) as chunk items in the store (``Stored``
    leaves), and with ``offload_state(params=True)`` its
    parameter shard too (a ``StoredParam``); the others as they are. None without ``offload``."""
    if offload is None:
        return None
    if not isinstance(offload, offload_state):
        raise ArgumentTypeError(f"fs.init(..., offload=): pass the fs.offload_state(...) the step will be composed "
                                f"with, not {type(offload).__name__}.")
    if opt is not None:
        refuse_unstreamable(opt, "fs.init(..., offload=fs.offload_state(...))")
    chunk, tag = offload.chunk_numel, uuid.uuid4().hex[:8]
    # the units the optimizer makes state for (its init: the trainable ones)
    tiers = choose_tiers([u for u in layouts if u.trainable], mesh.rank, offload.fractions)

    def place(u, param, s):
        if u.name not in tiers:
            return param, s
        store = offload.stores[tiers[u.name]]
        created = []
        try:
            with locked(store):
                s = put_moments(store, f"{u.name}@init-{tag}", s, names, chunk, created)
                if offload.params:
                    param = put_param(store, param_key(f"{u.name}@init-{tag}"), param, u.opt_numel(mesh.rank),
                                      chunk, created)
                return param, s
        except BaseException:
            store.delete_later(created)  # the items written before the failure: no state refers to them
            raise

    return place
