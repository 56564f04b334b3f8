"""fshard: functional sharded-state (ZeRO-3) training for PyTorch.

State is data (an immutable, sharded pytree) and the step is a pure function::

    import fshard as fs
    mesh = fs.Mesh.from_env()
    state = fs.init(model, mesh, fs.adamw(lr=1e-3))
    with fs.compose(loss_fn) as step:
        for batch in loader:
            state, metrics = step(state, batch)

The names a training script uses are re-exported here, as optax does; ``__all__`` lists them (at most 40). The rest of
the public surface is in public modules, shown by ``dir(fs)`` but not in ``__all__`` (so ``from fshard import *`` loads
none of them): ``fs.errors`` (every error type; the common ones are also here), ``fs.state`` (the state's types:
``ShardSpec``, ``FrozenMap``, ``Donation``, the layouts, the stored leaves), ``fs.optim`` (the optimizers besides
``fs.adamw``, ``fs.muon``, ``fs.adafactor`` and ``fs.partition``: ``sgd``, ``adam``, ``adagrad``, ``rmsprop``, ``lion``,
``from_torch``; their classes and state types; the protocol and ``Elementwise``, the base of your own), ``fs.schedules`` (learning-rate schedules), ``fs.protocol`` (what a transform author writes
against: ``Transform``, ``Policy``, the stage protocols and their views), ``fs.transforms`` (the shipped transforms and
their state types), ``fs.store`` (plain Python until an ``NVMeStore`` is opened, when tensornvme loads), and two that
load on first use, because they pull in what a training run may not need: ``fs.ops`` (the native kernels) and
``fs.testing`` (hypothesis). ``fs.save``, ``fs.load``, ``fs.latest`` and ``fs.SaveHandle`` load their module (and
torch.distributed.checkpoint) when first used. The packages by concern behind them are laid out in
design/ARCHITECTURE.md.
"""
from __future__ import annotations

import importlib

import torch as _torch

from . import errors
# The oldest torch fshard is tested on: 2.11 (the GPU machine's 2.11.0+cu130: the CUDA tests; benchmarks/RESULTS.md,
# "GPU"); the suite runs on 2.13.0. Older ones are untested, and those before 2.6 lack broadcast(group_src=).
_TORCH_MIN = (2, 11)
if tuple(int(x) for x in _torch.__version__.split("+")[0].split(".")[:2]) < _TORCH_MIN:
    raise errors.TorchVersionError(
        f"fshard needs torch >= {'.'.join(map(str, _TORCH_MIN))}; this is torch {_torch.__version__}. Upgrade torch "
        "(pip install 'torch>=2.11'), or use the bootstrap's torch==2.13.0.")

from ._malloc import from_env as _mmap_from_env, set_mmap_threshold
_mmap_from_env()  # FSHARD_MMAP_THRESHOLD (fshard/_malloc.py)

from . import optim, protocol, state, transforms  # noqa: F401 (public modules, with errors and store)
from .dist import Mesh
from .errors import (ArgumentError, ArgumentTypeError, CheckpointError, CollectiveError, FshardError, InitError,
                     RankDivergenceError, StepError)
from .model import full_params, full_state_dict, init
from .offload import offload_state
from .optim import adafactor, adamw, muon, partition, schedules  # noqa: F401 (fs.schedules: a public module)
from .protocol import Transform
from .state import TrainState
from .step import Plan, Step, Timeline, compose, timeline
from .store import CPUStore, NVMeStore, Store
from .transforms import (GatherOrder, accumulate, bucket_reduce, clip_by_global_norm, gather_ahead, mixed_precision,
                         skip_nonfinite)

__version__ = "0.1.0"

_LAZY = ("ops", "testing")
# Names whose module loads on first use: the checkpoint functions import torch.distributed.checkpoint and with it
# DTensor and sympy (1.2 s of an `import fshard` that took 2.3 s beyond torch's own 2.4; a run that never saves
# does not need them). `from fshard import *` loads them, as these names are in __all__.
_CHECKPOINT_NAMES = ("save", "load", "latest", "SaveHandle")
_MODULES = ("errors", "state", "optim", "schedules", "protocol", "transforms", "store")  # the public modules

__all__ = [
    # state and set-up
    "Mesh", "init", "full_params", "full_state_dict", "TrainState", "adamw", "muon", "partition",
    "adafactor", "set_mmap_threshold",
    # checkpoints
    "save", "load", "latest", "SaveHandle",
    # the step and its transforms (their state types: fs.transforms; writing one: fs.protocol)
    "compose", "Step", "Transform", "gather_ahead", "GatherOrder", "bucket_reduce", "accumulate", "clip_by_global_norm",
    "skip_nonfinite", "offload_state", "mixed_precision",
    # what a step costs: step.plan(state, batch) before it runs, fs.timeline(...) of one that ran
    "Plan", "timeline", "Timeline",
    # stores
    "Store", "CPUStore", "NVMeStore",
    # the common errors, every one an FshardError (all of them: fs.errors)
    "FshardError", "ArgumentError", "ArgumentTypeError", "InitError", "StepError", "CheckpointError",
    "RankDivergenceError", "CollectiveError",
]


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"fshard.{name}")
    if name in _CHECKPOINT_NAMES:
        return getattr(importlib.import_module("fshard.checkpoint"), name)
    raise AttributeError(f"module 'fshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_LAZY) | set(_MODULES) | {"__version__"})
