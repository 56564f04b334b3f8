"""``Grads``: the frozen value the grads stage transforms and the update consumes (the stage protocols are in
fshard/protocol/_stages.py)."""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..state._slot_grad import grad_parts

if TYPE_CHECKING:
    from ..dist._protocol import Collectives


@dataclass(frozen=True)
class Grads:
    """The value the grads stage transforms and the update consumes. Frozen: a grads policy returns a new one
    (``grads.replace(...)``).

    Attributes:
      shards: unit name -> this rank's reduced gradient shard (units that got a gradient).
      scale: a factor the update multiplies every gradient by (fused into the optimizer kernel where it can be).
        The step starts it at ``1 / loss_scale`` when a grads policy scales the loss (fp16), so the shards hold the
        scaled gradients and ``shards * scale`` is always what the update applies: a policy that reads gradient
        values (a norm) multiplies by it.
      loss_scale: the factor backward multiplied the loss by (fp16 loss scaling; 1.0 otherwise), set by the step:
        ``shards / loss_scale`` are the gradients of the loss, whatever ``scale`` a clip has multiplied in since.
      skip: whether to skip the update; the step then returns the input state with ``skipped`` + 1, the
        ``transform_state`` below, and the buffers forward updated (BatchNorm's running statistics, as in torch,
        where a step whose optimizer is skipped has still run forward).
      sq_norm: the global sum of squares of all shards (not times ``scale``), once a policy asked (``with_sq_norm``).
      spec, active: the state's ``ShardSpec`` and, per unit, which trainable slots got a gradient on some rank
        (per-parameter norms, as ``clip_grad_norm_`` takes them; a step's plan passes placeholder shards).
      metrics: added to the step's metrics.
      transform_state: the input state's ``TrainState.transform_state``; a policy that keeps state across steps
        returns its new entry here (``grads.replace(transform_state={**grads.transform_state, key: new})``), and
        the step puts it in the new state, also when the update is skipped.
    """

    shards: Mapping[str, torch.Tensor]
    scale: float = 1.0
    loss_scale: float = 1.0
    skip: bool = False
    sq_norm: float | None = None
    spec: Any = None
    active: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    transform_state: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for f in ("shards", "metrics", "transform_state"):
            object.__setattr__(self, f, types.MappingProxyType(dict(getattr(self, f))))

    def replace(self, **changes) -> Grads:
        """A copy with ``changes``. New ``shards`` drop the cached ``sq_norm`` (unless one is given with them)."""
        if "shards" in changes and "sq_norm" not in changes:
            changes["sq_norm"] = None
        return replace(self, **changes)

    def with_metrics(self, **metrics) -> Grads:
        return replace(self, metrics={**self.metrics, **metrics})

    def with_sq_norm(self, comm: Collectives) -> Grads:
        """This value with ``sq_norm`` set: the sum over ranks of the squares of every gradient shard (the shards
        of a shard group tile the model, so each element counts once; on a 2-D mesh the sum runs in the shard group,
        whose replica groups hold the same shards), in float64 (no overflow; inf and NaN survive). This rank's
        sum is ``fshard.ops.sq_norm`` (on the CPU one native read pass, 13x faster than torch's float64 norm);
        one all-reduce adds the ranks', only if no policy has computed it yet."""
        if self.sq_norm is not None:
            return self
        from .. import ops  # loaded on first use, as everywhere (it may build the native kernels)
        from ..ops._reference import SQ_NORM_DTYPES
        shards = [t for g in self.shards.values() for _, _, t in grad_parts(g, 0, g.shape[0])]  # (SlotGrad: per slot)
        native = [g for g in shards if g.dtype in SQ_NORM_DTYPES]
        wide = [g for g in shards if g.dtype not in SQ_NORM_DTYPES]  # float64 models: torch's norm
        total = ops.sq_norm(native) + sum(float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2) for g in wide)
        local = torch.tensor([total], dtype=torch.float64, device=comm.mesh.device)
        return replace(self, sq_norm=float(comm.all_reduce(local, "grad_norm", over="shard")[0]))

