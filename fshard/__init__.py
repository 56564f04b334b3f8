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

from .errors import TorchVersionError
# The oldest torch fshard is tested on: 2.11 (the GPU machine's 2.11.0+cu130: the CUDA tests; benchmarks/RESULTS.md,
# "GPU"); the suite runs on 2.13.0. Older ones are untested, and those before 2.6 lack broadcast(group_src=).
_TORCH_MIN = (2, 11)
if tuple(int(x) for x in _torch.__version__.split("+")[0].split(".")[:2]) < _TORCH_MIN:
    raise TorchVersionError(f"fshard needs torch >= {'.'.join(map(str, _TORCH_MIN))}; this is torch "
                            f"{_torch.__version__}. Upgrade torch (pip install 'torch>=2.11'), or use the bootstrap's "
                            "torch==2.13.0.")

from ._malloc import from_env as _mmap_from_env, set_mmap_threshold
_mmap_from_env()  # FSHARD_MMAP_THRESHOLD (fshard/_malloc.py)

from .transforms._accumulate import accumulate
from .protocol._stages import (BatchesPolicy, Collectives, GatherPolicy, Grads, GradsPolicy, InFlight, ReducePolicy,
                               StepView, UnitView, UpdatePolicy)
from .transforms._bucket_reduce import bucket_reduce
from .checkpoint._save import SaveHandle, latest, save
from .checkpoint._load import load
from .transforms._clip import clip_by_global_norm
from .errors import (AbstractStateError, ArgumentError, ArgumentTypeError, BatchMismatchError, CheckpointError,
                      CollectiveError, ConcurrentStepError, DonatedStateError, EmptyBatchError, FrozenStateError,
                      FshardError, InitError, LossError, MemoryBudgetError, MeshMismatchError, PolicyError,
                      RankDivergenceError, RankFailedError, RecomputeError, SaveInProgressError, ScheduleError,
                      StepClosedError, StepError, TemplateCallError, TransformConflictError, UnboundParameterError)
from .transforms._gather_ahead import Schedule, gather_ahead
from .model._init import full_params, init
from .state._flat import ParamSlot, UnitLayout
from .dist._mesh import Mesh
from .transforms._loss_scale import LossScaleState
from .transforms._mixed_precision import MixedPrecisionState, mixed_precision
from .offload._transform import OffloadError, offload_state
from .optim._adamw import AdamW, AdamWState, adamw
from .step._plan import Plan
from .transforms._skip import skip_nonfinite
from .state._train_state import Donation, FrozenMap, ShardSpec, TrainState
from .model._state_dict import full_state_dict
from .step._step import Step, compose
from .state._stored import Stored, StoredParam
from .step._timeline import Timeline, timeline
from .protocol._transform import Policy, Transform
from .optim import schedules
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
    # the stage protocols (fshard/protocol/_stages.py)
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
