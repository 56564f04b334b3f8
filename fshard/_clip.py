"""fs.clip_by_global_norm: clip by the L2 norm of all gradients, computed from the shards as clip_grad_norm_ does.

torch.nn.utils.clip_grad_norm_ takes the fp32 norm of each parameter's gradient (``torch._foreach_norm``, per
device and dtype group, in parameter order, leaving out parameters without a gradient), the norm of those norms
(``vector_norm(stack(norms))``), and ``clip_coef = max_norm / (total + 1e-6)`` clamped to 1, all in fp32 tensor
arithmetic, then multiplies every gradient by that fp32 value. ``_global_norm`` repeats it on the shards:

- N = 1: each shard holds whole parameters; ``_foreach_norm`` over each parameter's slot view of the shard (not the
  padding after it), grouped and ordered as torch does: bitwise clip_grad_norm_'s norm.
- N > 1: a parameter spans ranks; each rank sums the squares of its part of every parameter in float64, one
  all-reduce adds the ranks' vectors (one number per parameter that got a gradient), and each parameter's norm is
  the square root, rounded to fp32; then the same fp32 ``vector_norm`` and coefficient. Each per-parameter norm is
  the correctly rounded one where ``_foreach_norm`` rounds as it sums, so the global norm is within a few fp32 ulps
  (1e-7 relative) of torch's.

The coefficient (a Python float holding the fp32 value) is handed to the update as ``Grads.scale``: the native
AdamW kernel multiplies each gradient by it as it reads it (no extra pass); the torch and fused arithmetics multiply
first, an fp32 product as ``_foreach_mul_`` makes it. With fp16 loss scaling the shards hold scaled gradients: the
norm is the shards' times ``|scale|`` (torch unscales each gradient first, so the two differ by rounding). The norm
is not shared with ``skip_nonfinite``'s and the loss scaler's finiteness check (``Grads.with_sq_norm``), which need
one number, not one per parameter: with both, a step makes two small all-reduces.
"""
from __future__ import annotations

import math

import torch

from ._base import Grads, GradsPolicy
from ._errors import ArgumentError
from ._transforms import Transform


def _global_norm(comm, grads: Grads) -> float:
    """clip_grad_norm_'s total norm of the gradients the shards hold (module docstring)."""
    spec, rank, n = grads.spec, comm.mesh.rank, comm.mesh.world_size
    slot_of = {s.name: (u, k, s) for u in spec.units for k, s in enumerate(u.trainable)}
    groups: dict = {}  # (device, dtype) -> parts, in first-appearance order, as torch groups the gradients
    placeholder = False
    for name in spec.param_names:
        if name not in slot_of:
            continue  # frozen: no gradient
        u, k, s = slot_of[name]
        if not grads.active.get(u.name, [False] * (k + 1))[k] or u.name not in grads.shards:
            continue  # no gradient on any rank: torch leaves it out
        shard = grads.shards[u.name]
        placeholder |= shard.numel() != u.shard_numel  # step.plan's: the same messages, no values
        lo, hi = u.shard_range(rank)
        a, b = max(s.offset, lo) - lo, min(s.offset + s.numel, hi) - lo
        part = shard[a:b] if not placeholder and a < b else shard[:0]
        groups.setdefault((shard.device, shard.dtype), []).append(part)
    parts = [p for g in groups.values() for p in g]
    if not parts:
        return 0.0
    if n == 1 and not placeholder:
        norms = [x for g in groups.values() for x in torch._foreach_norm(g, 2.0)]
    else:
        sq = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float64) ** 2 if p.numel() else
                          torch.zeros((), dtype=torch.float64, device=p.device) for p in parts])
        sq = comm.all_reduce(sq.to(comm.mesh.device), "grad_norm")
        roots, i = sq.sqrt(), 0
        norms = []
        for (_, dtype), g in groups.items():
            norms += list(roots[i:i + len(g)].to(dtype))
            i += len(g)
    first = norms[0].device
    return float(torch.linalg.vector_norm(torch.stack([x.to(first) for x in norms]), 2.0))


def _coef(max_norm: float, norm: float) -> float:
    """``max_norm / (norm + 1e-6)`` in fp32, as clip_grad_norm_ computes it on its fp32 norm tensor."""
    total = torch.tensor(norm, dtype=torch.float32)
    return float(max_norm / (total + 1e-6))


class _Clip(GradsPolicy):
    changes_grads = True  # the scale

    def __init__(self, inner: GradsPolicy, max_norm: float):
        self.inner, self.max_norm = inner, max_norm

    def __call__(self, comm, grads: Grads) -> Grads:
        grads = self.inner(comm, grads)
        if grads.spec is None:  # a Grads built without the layout (a custom caller): the float64 global sum
            grads = grads.with_sq_norm(comm)
            norm = math.sqrt(grads.sq_norm)
        else:
            norm = _global_norm(comm, grads)
        if grads.scale != 1.0:  # of what the update applies (fp16: unscaled)
            norm = float(torch.tensor(norm, dtype=torch.float32) * abs(grads.scale))
        coef = _coef(self.max_norm, norm)  # an inf norm gives 0, a NaN norm NaN, as in torch
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
