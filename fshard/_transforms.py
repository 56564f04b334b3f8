"""The transform protocol, and the blocking policies a step uses when no transform changes them.

A step has five stages that transforms can change (design/ARCHITECTURE.md):

- ``gather``: when each unit's flat buffer is gathered and freed, in forward and in backward (gather_ahead);
- ``reduce``: how the gradient of a unit's flat buffer becomes this rank's gradient shard (bucket_reduce);
- ``grads``:  what happens to the reduced gradient shards before the update (clipping, non-finite skip);
- ``update``: where and how the optimizer runs on the shards (offload_state);
- ``batches``: how the step's batch splits into micro-batches whose gradients are summed (accumulate).

A transform is a small named object. For each stage it either returns the policy it was given, or a new policy
that wraps it; ``fs.compose`` folds the transforms over the blocking policies below, left to right. The step itself
calls the five policies and nothing else, so it never grows a branch per transform.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from ._errors import ArgumentTypeError


class Transform:
    """Base class: every stage unchanged. Subclasses override the stages they change."""

    name = "transform"

    def wrap_gather(self, gather):
        return gather

    def wrap_reduce(self, reduce):
        return reduce

    def wrap_grads(self, grads):
        return grads

    def wrap_update(self, update):
        return update

    def wrap_batches(self, batches):
        return batches

    def __repr__(self) -> str:
        return f"fs.{self.name}()"


class BlockingGather:
    """Gather a unit right before it computes and free it right after, in forward and in backward.

    The gather protocol: ``start(run)`` before forward; ``before_forward/after_forward(run, unit)`` around each
    call of a unit (the root unit: around the whole forward); ``before_backward(run, unit)`` whenever autograd
    reads a saved tensor of the unit; ``after_backward(run, unit)`` when one use of the unit has finished
    backward; ``finish(run) -> metrics`` after backward."""

    def start(self, run) -> None:
        pass

    def finish(self, run) -> dict:
        return {}

    def before_forward(self, run, unit) -> None:
        unit.acquire()

    def after_forward(self, run, unit) -> None:
        unit.release()

    def before_backward(self, run, unit) -> None:
        unit.acquire()

    def after_backward(self, run, unit) -> None:
        unit.release()


class BlockingReduce:
    """Reduce-scatter each unit's flat gradient as soon as backward has produced it, and wait for it.

    Gradients are scaled by 1/world_size before a SUM reduce-scatter, in the order DDP uses, so the average
    matches DDP's bit for bit wherever the summation order allows it."""

    def reduce(self, run, unit, grad: torch.Tensor) -> None:
        n = run.comm.mesh.world_size
        full = grad.contiguous() if n == 1 else grad * (1.0 / n)
        out = torch.empty(unit.layout.shard_numel, dtype=full.dtype, device=full.device)
        run.comm.reduce_scatter(out, full, unit.layout.name).wait()
        unit.grad = out
        run.grad_final(unit)

    def finish(self, run) -> None:
        """Called after backward: every outstanding reduction is complete when it returns."""


@dataclass
class Grads:
    """What the grads stage hands to the update: the reduced gradient shards (unit name -> shard), a factor the
    update multiplies every gradient by (fused into the optimizer kernel where it can be), whether to skip the
    update altogether, and metrics. ``sq_norm`` is the global sum of squares, once a transform has computed it."""

    shards: dict[str, torch.Tensor]
    scale: float = 1.0
    skip: bool = False
    sq_norm: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    early: dict[str, Any] = field(default_factory=dict)  # updates begun during backward (update.overlap)


class IdentityGrads:
    """Reduced gradient shards go to the update as they are."""

    def __call__(self, comm, grads: Grads) -> Grads:
        return grads


class DeviceUpdate:
    """Run the optimizer on the shards where they live, one unit at a time.

    The update protocol: ``update(spec, state, grads, active, donate) -> (params, opt_state)``, called once after
    backward and the agreement. An update policy may also define ``overlap(run, unit)``: the step calls it in the
    last micro-batch as soon as the unit's gradient shard is final, while backward still runs. It may begin that
    unit's update in the background and leave the work in ``run.early[name]`` (an object with ``abandon()``); the
    step hands those to the update in ``grads.early``, and abandons the ones a failed step never took."""

    def __call__(self, spec, state, grads: Grads, active, donate):
        rank, params, opt_state = spec.mesh.rank, dict(state.params), dict(state.opt_state)
        for u in spec.units:
            if u.name in opt_state and any(active[u.name]):
                if not isinstance(getattr(opt_state[u.name], "exp_avg", None), torch.Tensor):
                    raise ArgumentTypeError(f"unit {u.name!r} has its optimizer state in a store (fs.offload_state); compose "
                                    "this step with the same fs.offload_state(store) to update it.")
                params[u.name], opt_state[u.name] = spec.optimizer.update(
                    u, rank, state.params[u.name], grads.shards[u.name], state.opt_state[u.name], active[u.name],
                    donate, grad_scale=grads.scale)
        return params, opt_state


class OneBatch:
    """The batch is one micro-batch (``fs.accumulate(k)`` makes it a list of k)."""

    def __call__(self, batch) -> list:
        return [batch]


@dataclass(frozen=True)
class Policy:
    gather: Any
    reduce: Any
    grads: Any
    update: Any
    batches: Any


def fold(transforms) -> Policy:
    """The step's policies: the blocking ones, wrapped by each transform in turn."""
    gather, reduce, grads, update = BlockingGather(), BlockingReduce(), IdentityGrads(), DeviceUpdate()
    batches = OneBatch()
    for t in transforms:
        if not isinstance(t, Transform):
            raise ArgumentTypeError(f"fs.compose: {t!r} is not an fshard transform (fs.gather_ahead(...), ...). Pass "
                            "transforms after loss_fn: fs.compose(loss_fn, transform, ...).")
        gather, reduce = t.wrap_gather(gather), t.wrap_reduce(reduce)
        grads, update, batches = t.wrap_grads(grads), t.wrap_update(update), t.wrap_batches(batches)
    return Policy(gather, reduce, grads, update, batches)
