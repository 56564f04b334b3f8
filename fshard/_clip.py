"""fs.clip_by_global_norm: clip by the L2 norm of all gradients, computed from the shards.

Each rank sums the squares of its gradient shards (in float64: no overflow, and inf or NaN survive), one small
all-reduce adds the ranks' sums, and every rank gets the same global norm. The clip factor
``min(1, max_norm / (norm + 1e-6))`` is torch.nn.utils.clip_grad_norm_'s; it is not applied to the shards here
but handed to the update: the native AdamW kernel multiplies each gradient by it as it reads it (no extra pass);
the torch and fused arithmetics multiply first, as clip_grad_norm_ does.
"""
from __future__ import annotations

import math

import torch

from ._transforms import Grads, Transform
from ._errors import ArgumentError


def global_sq_norm(comm, grads: Grads) -> float:
    """Sum over ranks of the squares of every gradient shard (the shards tile the model, so each element counts
    once); cached on ``grads`` so that clipping and the non-finite check share one all-reduce."""
    if grads.sq_norm is None:
        local = torch.zeros((), dtype=torch.float64, device=comm.mesh.device)
        for g in grads.shards.values():
            local += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
        grads.sq_norm = float(comm.all_reduce(local.reshape(1), "grad_norm")[0])
    return grads.sq_norm


class _Clip:
    def __init__(self, inner, max_norm: float):
        self.inner, self.max_norm = inner, max_norm

    def __call__(self, comm, grads: Grads) -> Grads:
        grads = self.inner(comm, grads)
        norm = math.sqrt(global_sq_norm(comm, grads))
        coef = self.max_norm / (norm + 1e-6)  # an inf norm gives 0, a NaN norm NaN, as in torch
        if coef < 1.0 or math.isnan(coef):  # (fs.skip_nonfinite skips such steps)
            grads.scale *= coef
        grads.metrics["grad_norm"] = norm
        grads.metrics["grad_clip_scale"] = min(1.0, coef) if math.isfinite(coef) else coef
        return grads


class clip_by_global_norm(Transform):
    """Scale the gradients so that their global L2 norm is at most ``max_norm`` (as clip_grad_norm_ does).
    Reports ``metrics["grad_norm"]`` (before clipping)."""

    name = "clip_by_global_norm"

    def __init__(self, max_norm: float):
        if not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ArgumentError(f"fs.clip_by_global_norm: max_norm must be a number > 0, got {max_norm!r}.")
        self.max_norm = float(max_norm)

    def wrap_grads(self, grads):
        return _Clip(grads, self.max_norm)

    def __repr__(self) -> str:
        return f"fs.clip_by_global_norm({self.max_norm})"
