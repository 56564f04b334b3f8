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

Code that runs outside unit calls (the root unit's layers, the loss) sees the root's parameters in
``param_dtype`` and its inputs as the batch gives them. Buffers keep their dtype.
"""
from __future__ import annotations

import torch

from ._base import GatherPolicy, ReducePolicy
from ._errors import ArgumentTypeError
from ._transforms import Transform

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Precision(GatherPolicy):
    """The wrapped gather policy, every hook forwarded; declares the compute dtype."""

    def __init__(self, inner: GatherPolicy, param_dtype: torch.dtype):
        self.inner, self.param_dtype = inner, param_dtype

    @property
    def schedule(self):
        return self.inner.schedule

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
    """The wrapped reduce policy, given each unit's gradient in ``reduce_dtype``."""

    def __init__(self, inner: ReducePolicy, reduce_dtype: torch.dtype):
        self.inner, self.reduce_dtype = inner, reduce_dtype

    def reduce(self, step, unit, grad):
        self.inner.reduce(step, unit, grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype))

    def finish(self, step):
        self.inner.finish(step)

    def close(self):
        self.inner.close()


class mixed_precision(Transform):
    """Gather and compute in ``param_dtype``, reduce gradients in ``reduce_dtype`` (None: in ``param_dtype``), and
    update the master state in its own dtype (see the module docstring). Wraps the gather and reduce stages, so it
    comes after the transforms that set them: ``fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(25),
    fs.mixed_precision())``.
    """

    name = "mixed_precision"
    stages = {"gather": "wrap", "reduce": "wrap"}

    def __init__(self, param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype | None = torch.float32):
        for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if not (dt is None and what == "reduce_dtype") and dt not in _FLOATS:
                raise ArgumentTypeError(f"fs.mixed_precision: {what} must be one of {_FLOATS}, got {dt!r}.")
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype or param_dtype

    def wrap_gather(self, gather: GatherPolicy) -> GatherPolicy:
        return _Precision(gather, self.param_dtype)

    def wrap_reduce(self, reduce: ReducePolicy) -> ReducePolicy:
        return _ReduceIn(reduce, self.reduce_dtype)

    def __repr__(self) -> str:
        return (f"fs.mixed_precision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype})")
