"""fs.mixed_precision: gather and compute in a low precision, reduce in another, keep fp32 master state.

The state is unchanged: master parameter shards and moments stay in their own dtype (fp32). What changes is what a
step moves and computes with, through two declared seams:

- gather: the wrapped gather policy declares ``param_dtype``. The step casts each shard to it before the gather
  (so a gather moves half of fp32's bytes with bf16), binds the gathered low-precision views, and casts the
  floating-point tensors passed to a unit's call to it (FSDP2's ``cast_forward_inputs``); forward and backward
  run in it, and each unit's gradient arrives in it.
- reduce: the wrapped reduce policy casts each unit's gradient to ``reduce_dtype`` before reducing it (fp32 by
  default, as FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``); the shard it hands over is cast to the
  master dtype, and the update runs there.

- grads (fp16): dynamic loss scaling, as ``torch.amp.GradScaler`` (fshard/transforms/_loss_scale.py), with the scale in
  the state: a link of the grads chain (``grads_link``), which holds no other.

With ``param_copies=True`` (the default) the gather policy also declares ``param_copies``: the state holds a
persistent ``param_dtype`` copy of every shard (``TrainState.copies``, made once by the step), gathers send it
instead of casting the shard, and the update writes the new copy in its kernel pass. The results are the cast
way's bit for bit (both round to nearest); the copies cost ``param_dtype`` bytes per parameter and rank, and save
a cast per gather (design/ARCHITECTURE.md, mixed_precision, has the measurement).

Code that runs outside unit calls (the root unit's layers, the loss) sees the root's parameters in
``param_dtype`` and its inputs as the batch gives them. Buffers keep their dtype.

Its entry in ``TrainState.transform_state`` (``MixedPrecisionState``) records the dtypes, so ``print(state)``
shows each unit's compute dtype beside its master dtype, and holds the loss scale.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import optree
import torch

from ..protocol._stages import GatherPolicy, GradsPolicy, ReducePolicy
from ..errors import ArgumentTypeError
from ._loss_scale import LossScale, LossScaleState, LossScaling
from ..state._train_state import NAMESPACE, _frozen_setattr
from ..protocol._transform import Transform

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionState:
    """``fs.mixed_precision``'s state: the dtypes units compute and reduce in (static: pytree metadata) and, with
    loss scaling, the ``LossScaleState`` (its leaves)."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    loss_scale: LossScaleState | None = None

    def replace(self, **changes) -> "MixedPrecisionState":
        return dataclasses.replace(self, **changes)


MixedPrecisionState.__setattr__ = _frozen_setattr
optree.register_pytree_node(
    MixedPrecisionState, lambda s: ((s.loss_scale,), (s.param_dtype, s.reduce_dtype), ("loss_scale",)),
    lambda meta, children: MixedPrecisionState(*meta, *children), namespace=NAMESPACE)


class _Precision(GatherPolicy):
    """The wrapped gather policy, every hook forwarded; declares the compute dtype."""

    def __init__(self, inner: GatherPolicy, param_dtype: torch.dtype, param_copies: bool):
        self.inner, self.param_dtype, self.param_copies = inner, param_dtype, param_copies

    @property
    def gather_order(self):
        return self.inner.gather_order

    @gather_order.setter
    def gather_order(self, order):  # (step.plan, on its copy of the policy: the order a first step will record)
        self.inner.gather_order = order

    def start(self, step):
        self.inner.start(step)

    def before_forward(self, step, unit):
        self.inner.before_forward(step, unit)

    def after_forward(self, step, unit):
        self.inner.after_forward(step, unit)

    def before_backward(self, step, unit):
        self.inner.before_backward(step, unit)

    def after_backward(self, step, unit):
        self.inner.after_backward(step, unit)

    def finish(self, step):
        return self.inner.finish(step)

    def close(self):
        self.inner.close()


class _ReduceIn(ReducePolicy):
    """The wrapped reduce policy, given each unit's gradient in ``reduce_dtype`` (declared: micro-batches' gradients
    are summed in it too)."""

    def __init__(self, inner: ReducePolicy, reduce_dtype: torch.dtype):
        self.inner, self.reduce_dtype = inner, reduce_dtype
        self.per_slot = inner.per_slot  # (a cast of a SlotGrad stays per slot)

    def reduce(self, step, unit, grad):
        if grad.dtype != self.reduce_dtype and not (self.inner.widens and _widening(grad.dtype, self.reduce_dtype)):
            grad = grad.to(self.reduce_dtype)
        self.inner.reduce(step, unit, grad)

    def finish(self, step):
        self.inner.finish(step)

    def close(self):
        self.inner.close()


def _widening(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is exactly a ``dst`` value (bf16 or fp16 -> fp32): a policy that widens as it
    copies then computes what a cast first would."""
    return torch.promote_types(src, dst) == dst and dst.itemsize > src.itemsize


class mixed_precision(Transform):
    """Gather and compute in ``param_dtype``, reduce gradients in ``reduce_dtype`` (None: in ``param_dtype``), and
    update the master state in its own dtype (see the module docstring). Wraps the gather and reduce stages (and
    adds a link to the grads chain, with loss scaling), so it comes after the transforms that set them:
    ``fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(25), fs.mixed_precision())``.

    ``param_copies``: keep persistent ``param_dtype`` copies of the shards, written by the update, instead of a
    cast per gather: the same results, 0.97x the step time and ``param_dtype`` bytes per parameter more state on
    the 117M GPT (benchmarks/RESULTS.md); False casts per gather, as FSDP2 does.
    ``loss_scale``: "auto" (dynamic for fp16, none otherwise), "dynamic", a number (a static scale; a step whose
    gradients overflow is still skipped), or None. The dynamic scale follows ``torch.amp.GradScaler(init_scale,
    growth_factor, backoff_factor, growth_interval)``; a skipped step adds one to ``state.skipped`` and applies no
    update, so a learning-rate schedule does not advance (as DeepSpeed's fp16 engine).
    """

    name = "mixed_precision"
    stages = {"gather": "wrap", "reduce": "wrap"}

    def __init__(self, param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype | None = torch.float32,
                 *, loss_scale: str | float | None = "auto", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 param_copies: bool = True):
        for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if not (dt is None and what == "reduce_dtype") and dt not in _FLOATS:
                raise ArgumentTypeError(f"fs.mixed_precision: {what} must be one of {_FLOATS}, got {dt!r}.")
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype or param_dtype
        if not isinstance(param_copies, bool):
            raise ArgumentTypeError(f"fs.mixed_precision(param_copies={param_copies!r}): pass True (keep copies) or "
                                    "False (cast each gather).")
        self.param_copies = param_copies
        if loss_scale == "auto":
            loss_scale = "dynamic" if param_dtype == torch.float16 else None
        if loss_scale is None:
            self.scaling = None
        elif loss_scale == "dynamic":
            self.scaling = LossScaling(init_scale, growth_factor, backoff_factor, growth_interval)
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            self.scaling = LossScaling(float(loss_scale), growth_interval=growth_interval, dynamic=False)
        else:
            raise ArgumentTypeError(f"fs.mixed_precision(loss_scale={loss_scale!r}): use 'auto', 'dynamic', a "
                                    "number (a static scale) or None.")

    def wrap_gather(self, gather: GatherPolicy) -> GatherPolicy:
        return _Precision(gather, self.param_dtype, self.param_copies)

    def wrap_reduce(self, reduce: ReducePolicy) -> ReducePolicy:
        return _ReduceIn(reduce, self.reduce_dtype)

    def grads_link(self) -> GradsPolicy | None:
        return None if self.scaling is None else LossScale(self.scaling, self.name)

    def init_state(self, spec, old):
        if old is not None and not isinstance(old, MixedPrecisionState):
            raise ArgumentTypeError(f"state.transform_state[{self.name!r}] holds {old!r}, not fs.mixed_precision's "
                                    "state; the state was made by another transform of that name.")
        kept = old.loss_scale if old is not None else None
        scale = None
        if self.scaling is not None:  # a dynamic scale goes on from the state's; a static one is the configured
            fresh = kept is None or (not self.scaling.dynamic and float(kept.scale) != self.scaling.init_scale)
            scale = LossScaleState.initial(self.scaling.init_scale) if fresh else kept
        if old is not None and (old.param_dtype, old.reduce_dtype) == (self.param_dtype, self.reduce_dtype) \
                and old.loss_scale is scale:
            return old
        return MixedPrecisionState(self.param_dtype, self.reduce_dtype, scale)

    def __repr__(self) -> str:
        scaling = "" if self.scaling is None else f", loss_scale={self.scaling}"
        return (f"fs.mixed_precision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}{scaling}, "
                f"param_copies={self.param_copies})")
