"""fshard: functional sharded-state (ZeRO-3) training for PyTorch.

State is data (an immutable, sharded pytree) and the step is a pure function::

    import fshard as fs
    mesh = fs.Mesh.from_env()
    state = fs.init(model, mesh, fs.adamw(lr=1e-3))
    step = fs.compose(loss_fn)
    for batch in loader:
        state, metrics = step(state, batch)

Public names are re-exported here over private modules (``fshard._*``), as optax does.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Subpackages that are heavy or optional (native ops, the NVMe store) load on first use.
_LAZY = {
    "Store": "fshard.store",
    "CPUStore": "fshard.store",
    "NVMeStore": "fshard.store",
    "ops": "fshard.ops",
    "testing": "fshard.testing",
}


def __getattr__(name: str):
    if name in _LAZY:
        mod = importlib.import_module(_LAZY[name])
        return mod if mod.__name__.endswith("." + name) else getattr(mod, name)
    raise AttributeError(f"module 'fshard' has no attribute {name!r}")

from ._errors import (BatchMismatchError, DonatedStateError, FrozenStateError, FshardError, InitError, LossError,
                      MeshMismatchError, RankDivergenceError, ScheduleError, TemplateCallError,
                      UnboundParameterError)
from ._accumulate import accumulate
from ._bucket_reduce import bucket_reduce
from ._clip import clip_by_global_norm
from ._gather_ahead import Schedule, gather_ahead
from ._init import full_params, init
from ._layout import ParamSlot, UnitLayout
from ._mesh import Mesh
from ._offload import OffloadError, offload_state
from ._optim import AdamW, AdamWState, adamw
from ._state import ShardSpec, TrainState
from ._skip import skip_nonfinite
from ._step import Step, compose
from ._stored import Stored
from ._transforms import Grads, Transform
