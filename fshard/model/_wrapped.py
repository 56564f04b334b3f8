"""Models that another wrapper already holds, refused by fs.init with the module to pass instead.

fshard shards, binds and reduces the plain model itself. A wrapper in the way either fails deep inside (FSDP2's
DTensor shards: no ``.numpy()``, Tensor and DTensor mixed in a copy), or is accepted and goes wrong (DDP's
``module.`` prefix on every name of the state and of ``fs.full_state_dict``; a compiled module's ``_orig_mod.``), so
each is named with its fix up front. A wrapper can only exist if its torch module was imported, so FSDP's and
dynamo's types are looked up only where they are in ``sys.modules``: the check imports neither.
"""
from __future__ import annotations

import sys

import torch.nn as nn

from ..errors import InitError


def check_not_wrapped(model: nn.Module) -> None:
    """Raise ``InitError`` naming the first wrapper found in ``model`` (itself or any submodule) and the fix."""
    wrappers = _wrappers()
    for path, m in model.named_modules():
        fix = next((fix for kind, fix in wrappers if isinstance(m, kind)), None)
        if fix is not None:
            where = "the model" if not path else f"its submodule {path!r}"
            raise InitError(f"fs.init: {where} is {fix}")
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    if dtensor is not None:
        for name, p in model.named_parameters():
            if isinstance(p, dtensor):
                raise InitError(
                    f"fs.init: parameter {name!r} is a DTensor (a shard made by fully_shard or a tensor-parallel "
                    "plan): the model is sharded already. Pass the model before it was sharded; fshard shards it "
                    "itself. To carry trained weights over, load its full state dict (torch.distributed.checkpoint."
                    "state_dict.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))) into a "
                    "model built without sharding, and pass that.")


def _wrappers() -> list[tuple[type, str]]:
    """(wrapper type, what it is and what to pass instead), for the wrapper types that can exist now."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel
    kinds = [
        (DistributedDataParallel,
         "wrapped in DistributedDataParallel, which would prefix every name with 'module.' and all-reduce gradients "
         "that fshard reduce-scatters itself. Pass the plain module, ddp.module (fshard replaces DDP: do not wrap "
         "the model in it)."),
        (DataParallel,
         "wrapped in DataParallel, which replicates the model over the GPUs of one process. Pass the plain module, "
         "dp.module: fshard runs one rank per device (torchrun) and shards the model itself."),
        (_loaded("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
         "wrapped in FullyShardedDataParallel (FSDP1), whose parameters are flat shards already. Pass the model "
         "before wrapping it: fshard shards it itself. To carry trained weights over, load the full state dict "
         "(FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT)) into a model built without FSDP."),
        (_loaded("torch.distributed.fsdp", "FSDPModule"),
         "sharded by fully_shard (FSDP2), whose parameters are DTensor shards already. Pass the model before "
         "fully_shard was applied, built without it: fshard shards it itself. To carry trained weights over, load "
         "its full state dict (torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
         "options=StateDictOptions(full_state_dict=True))) into that unsharded model."),
        (_loaded("torch._dynamo.eval_frame", "OptimizedModule"),
         "a torch.compile'd module (OptimizedModule), which would prefix every name with '_orig_mod.'. Pass the "
         "plain module, compiled._orig_mod, and compile inside the step: fs.compose(loss_fn, compile=True) "
         "compiles each unit's forward (and torch.compile(loss_fn) the code between units)."),
    ]
    return [(kind, fix) for kind, fix in kinds if kind is not None]


def _loaded(module: str, name: str):
    """``module.name`` if ``module`` was imported, else None (no wrapper of it can exist then)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None
