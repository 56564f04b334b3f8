"""fs.clip_by_global_norm: clip by the L2 norm of all gradients, computed from the shards.

Each rank sums the squares of its gradient shards (in float64: no overflow, and inf or NaN survive), one small
all-reduce adds the ranks' sums, and every rank gets the same global norm (``Grads.with_sq_norm``, shared with any
other policy that needs it); times ``Grads.scale`` so far, it is the norm of the gradients the update applies (with
fp16 loss scaling, the unscaled ones, as torch clips after ``GradScaler.unscale_``). The clip factor
``min(1, max_norm / (norm + 1e-6))`` is torch.nn.utils.clip_grad_norm_'s; it is not applied to the shards here but
handed to the update: the native AdamW kernel multiplies each gradient by it as it reads it (no extra pass); the
torch and fused arithmetics multiply first, as clip_grad_norm_ does.
"""
from __future__ import annotations

import math

from ._base import Grads, GradsPolicy
from ._errors import ArgumentError
from ._transforms import Transform


class _Clip(GradsPolicy):
    changes_grads = True  # the scale

    def __init__(self, inner: GradsPolicy, max_norm: float):
        self.inner, self.max_norm = inner, max_norm

    def __call__(self, comm, grads: Grads) -> Grads:
        grads = self.inner(comm, grads).with_sq_norm(comm)
        norm = math.sqrt(grads.sq_norm) * abs(grads.scale)  # of what the update applies (fp16: unscaled)
        coef = self.max_norm / (norm + 1e-6)  # an inf norm gives 0, a NaN norm NaN, as in torch
        scale = grads.scale * coef if (coef < 1.0 or math.isnan(coef)) else grads.scale  # (skip_nonfinite skips)
        return grads.replace(scale=scale, metrics={
            **grads.metrics, "grad_norm": norm,
            "grad_clip_scale": min(1.0, coef) if math.isfinite(coef) else coef})

    def close(self) -> None:
        self.inner.close()


class clip_by_global_norm(Transform):
    """Scale the gradients so that their global L2 norm is at most ``max_norm`` (as clip_grad_norm_ does).
    Reports ``metrics["grad_norm"]`` (before clipping)."""

    name = "clip_by_global_norm"
    stages = {"grads": "wrap"}

    def __init__(self, max_norm: float):
        if not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ArgumentError(f"fs.clip_by_global_norm: max_norm must be a number > 0, got {max_norm!r}.")
        self.max_norm = float(max_norm)

    def wrap_grads(self, grads: GradsPolicy) -> GradsPolicy:
        return _Clip(grads, self.max_norm)

    def __repr__(self) -> str:
        return f"fs.clip_by_global_norm({self.max_norm})"
