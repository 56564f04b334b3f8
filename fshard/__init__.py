"""fshard: functional sharded-state (ZeRO-3) training for PyTorch.

State is data (an immutable, sharded pytree) and the step is a pure function::

    import fshard as fs
    mesh = fs.Mesh.from_env()
    state = fs.init(model, mesh, fs.adamw(lr=1e-3))
    with fs.compose(loss_fn) as step:
        for batch in loader:
            state, metrics = step(state, batch)

Public names are re-exported here over private modules (``fshard._*``), as optax does; ``__all__`` lists them.
The subpackages are modules, shown by ``dir(fs)`` but not in ``__all__`` (so ``from fshard import *`` loads none of
them): ``fs.schedules`` (learning-rate schedules), ``fs.store`` (plain Python until an ``NVMeStore`` is opened,
when tensornvme loads), and two that load on
first use, because they pull in what a training run may not need: ``fs.ops`` (the native kernels) and
``fs.testing`` (hypothesis).
"""
from __future__ import annotations

import importlib

import torch as _torch

from ._errors import TorchVersionError
# The oldest torch fshard is tested on: 2.11 (the GPU machine's 2.11.0+cu130: the CUDA tests; benchmarks/RESULTS.md,
# "GPU"); the suite runs on 2.13.0. Older ones are untested, and those before 2.6 lack broadcast(group_src=).
_TORCH_MIN = (2, 11)
if tuple(int(x) for x in _torch.__version__.split("+")[0].split(".")[:2]) < _TORCH_MIN:
    raise TorchVersionError(f"fshard needs torch >= {'.'.join(map(str, _TORCH_MIN))}; this is torch "
                            f"{_torch.__version__}. Upgrade torch (pip install 'torch>=2.11'), or use the bootstrap's "
                            "torch==2.13.0.")

from ._malloc import from_env as _mmap_from_env, set_mmap_threshold
_mmap_from_env()  # FSHARD_MMAP_THRESHOLD (fshard/_malloc.py)

from ._accumulate import accumulate
from ._base import (BatchesPolicy, Collectives, GatherPolicy, Grads, GradsPolicy, InFlight, ReducePolicy, StepView,
                    UnitView, UpdatePolicy)
from ._bucket_reduce import bucket_reduce
from ._checkpoint import SaveHandle, latest, save
from ._ckpt_load import load
from ._clip import clip_by_global_norm
from ._errors import (AbstractStateError, ArgumentError, ArgumentTypeError, BatchMismatchError, CheckpointError,
                      CollectiveError, ConcurrentStepError, DonatedStateError, EmptyBatchError, FrozenStateError,
                      FshardError, InitError, LossError, MemoryBudgetError, MeshMismatchError, PolicyError,
                      RankDivergenceError, RankFailedError, RecomputeError, SaveInProgressError, ScheduleError,
                      StepClosedError, StepError, TemplateCallError, TransformConflictError, UnboundParameterError)
from ._gather_ahead import Schedule, gather_ahead
from ._init import full_params, init
from ._layout import ParamSlot, UnitLayout
from ._mesh import Mesh
from ._loss_scale import LossScaleState
from ._mixed_precision import MixedPrecisionState, mixed_precision
from ._offload import OffloadError, offload_state
from ._optim import AdamW, AdamWState, adamw
from ._plan import Plan
from ._skip import skip_nonfinite
from ._state import Donation, FrozenMap, ShardSpec, TrainState
from ._state_dict import full_state_dict
from ._step import Step, compose
from ._stored import Stored, StoredParam
from ._timeline import Timeline, timeline
from ._transforms import Policy, Transform
from . import schedules
from .store import CPUStore, NVMeStore, Store, StoreError

__version__ = "0.1.0"

_LAZY = ("ops", "testing")

__all__ = [
    # state and set-up
    "Mesh", "init", "full_params", "full_state_dict", "TrainState", "ShardSpec", "FrozenMap", "set_mmap_threshold",
    "Donation", "ParamSlot", "UnitLayout", "adamw", "AdamW", "AdamWState", "Stored", "StoredParam",
    # checkpoints
    "save", "load", "latest", "SaveHandle",
    # the step and its transforms
    "compose", "Step", "Transform", "Policy", "gather_ahead", "Schedule", "bucket_reduce", "accumulate",
    "clip_by_global_norm", "skip_nonfinite", "offload_state", "mixed_precision", "MixedPrecisionState",
    "LossScaleState",
    # what a step costs: step.plan(state, batch) before it runs, fs.timeline(...) of one that ran
    "Plan", "timeline", "Timeline",
    # the stage protocols (fshard/_base.py)
    "GatherPolicy", "ReducePolicy", "GradsPolicy", "UpdatePolicy", "BatchesPolicy", "StepView", "UnitView",
    "Collectives", "InFlight", "Grads",
    # stores
    "Store", "CPUStore", "NVMeStore",
    # errors: every one an FshardError
    "FshardError", "AbstractStateError", "ArgumentError", "ArgumentTypeError", "BatchMismatchError", "CheckpointError",
    "CollectiveError", "ConcurrentStepError", "DonatedStateError", "EmptyBatchError", "FrozenStateError", "InitError",
    "LossError",
    "MemoryBudgetError", "MeshMismatchError", "OffloadError", "PolicyError", "RankDivergenceError", "RankFailedError",
    "RecomputeError", "SaveInProgressError", "ScheduleError", "StepClosedError", "StepError", "StoreError",
    "TemplateCallError", "TorchVersionError", "TransformConflictError", "UnboundParameterError",
]


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"fshard.{name}")
    raise AttributeError(f"module 'fshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_LAZY) | {"store", "schedules", "__version__"})
