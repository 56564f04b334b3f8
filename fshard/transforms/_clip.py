"""fs.clip_by_global_norm: clip by the L2 norm of all gradients, computed from the shards as clip_grad_norm_ does.

torch.nn.utils.clip_grad_norm_ takes the fp32 norm of each parameter's gradient (``torch._foreach_norm``, per
device and dtype group, in parameter order, leaving out parameters without a gradient), the norm of those norms
(``vector_norm(stack(norms))``), and ``clip_coef = max_norm / (total + 1e-6)`` clamped to 1, all in fp32 tensor
arithmetic, then multiplies every gradient by that fp32 value. ``_global_norm`` repeats it on the shards:

- N = 1: each shard holds whole parameters; ``_foreach_norm`` over each parameter's slot view of the shard (not the
  padding after it), grouped and ordered as torch does: bitwise clip_grad_norm_'s norm.
- N > 1, fp32 gradients on the CPU: a parameter may span ranks. torch's CPU fp32 norm sums in one fixed order (8
  lanes, then a fold and a tail: ops/torch_norm.cpp), and the bits depend on that order only, so the ranks repeat
  it: a parameter a rank holds whole gets ``_foreach_norm``; one cut by shard boundaries is begun by its first rank
  (``fshard.ops.norm_continue_``) and continued by the next from the running state (8 fp32 numbers), which the
  k-th of N - 1 small all-reduces brings from rank k to rank k + 1 (every rank joins each, adding zeros, so the
  sum is the sender's bits); one more all-reduce shares the per-parameter norms, each from the rank that finished
  it. The global norm is then bitwise clip_grad_norm_'s on the same gradients, for any N and any cut (tested at
  N = 1-4). The rank-to-rank hand-offs run in sequence: 7.3-10.2 ms at N = 2 on the example GPT's 27.4M
  elements, where each DDP rank's clip_grad_norm_ takes 7.7-9.9 ms (benchmarks/clip.py). Exact agreement
  matters: torch's fp32 sum drifts from the true norm as a parameter grows (4e-5 relative on a 2.4M-element
  gradient, 7e-4 on 16.8M), so any other order differs from DDP by that much, not by an ulp.
- Otherwise (CUDA, bf16/fp16 gradients, or no native build; torch's order there is not repeated): each rank sums
  the squares of its part of every parameter in float64, one all-reduce adds the ranks' vectors, and each
  parameter's norm is the square root, rounded to the gradients' dtype; then the same ``vector_norm``. Each norm
  is then the correctly rounded one, which torch's differs from by its own drift.

On a 2-D mesh (HSDP) N is the shard group's size and every all-reduce above runs in the shard group: its shards tile
the model once, and every replica group holds the same reduced shards, so each makes the same sums, bit for bit.

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

from ..protocol._stages import Grads
from ..errors import ArgumentError
from ..protocol._transform import Transform


def _global_norm(comm, grads: Grads) -> float:
    """clip_grad_norm_'s total norm of the gradients the shards hold (module docstring)."""
    spec, rank, n = grads.spec, comm.mesh.shard_rank, comm.mesh.shard_size  # (2-D: the shard group's shards)
    slot_of = {s.name: (u, k, s) for u in spec.units for k, s in enumerate(u.trainable)}
    parts, groups = [], {}  # (unit, slot, this rank's part); (device, dtype) -> indices, as torch groups them
    for name in spec.param_names:
        if name not in slot_of:
            continue  # frozen: no gradient
        u, k, s = slot_of[name]
        if not grads.active.get(u.name, [False] * (k + 1))[k] or u.name not in grads.shards:
            continue  # no gradient on any rank: torch leaves it out
        shard = grads.shards[u.name]
        lo, hi = u.shard_range(rank)
        a, b = max(s.offset, lo) - lo, min(s.offset + s.numel, hi) - lo
        real = shard.numel() == u.shard_numel  # else step.plan's placeholder: the same messages, no values
        parts.append((u, s, shard[a:b] if real and a < b else shard[:0]))  # (torch's order: group, then name)
        groups.setdefault((shard.device, shard.dtype), []).append(len(parts) - 1)
    if not parts:
        return 0.0
    placeholder = any(grads.shards[u.name].numel() != u.shard_numel for u, _, _ in parts)
    if n == 1 and not placeholder:
        norms = [x for g in groups.values() for x in torch._foreach_norm([parts[i][2] for i in g], 2.0)]
    elif comm.mesh.device.type == "cpu" and list(groups) == [(torch.device("cpu"), torch.float32)] \
            and _ops().native_available():
        norms = list(_chained_norms(comm, parts, placeholder))
    else:
        norms = _rounded_norms(comm, [p for _, _, p in parts], groups)
    first = norms[0].device
    return float(torch.linalg.vector_norm(torch.stack([x.to(first) for x in norms]), 2.0))


def _chained_norms(comm, parts: list, placeholder: bool) -> torch.Tensor:
    """torch's fp32 norm of each parameter, bitwise, from the ranks' parts (module docstring): rank k continues the
    parameters that rank k - 1 began, after the k-th of n - 1 small all-reduces brings their running states."""
    rank, n = comm.mesh.shard_rank, comm.mesh.shard_size
    owner = [_ranks(u, s) for u, s, _ in parts]  # (first rank, last rank) holding each parameter
    states = torch.zeros(len(parts), 8)
    norms = torch.zeros(len(parts))
    whole = [i for i, (f, l) in enumerate(owner) if f == l == rank]
    if whole and not placeholder:
        norms[whole] = torch.stack(torch._foreach_norm([parts[i][2] for i in whole], 2.0))

    def run(idx: list[int]) -> None:  # continue parameters idx over this rank's parts
        if idx and not placeholder:
            st = states[idx].contiguous()
            starts = [max(0, parts[i][0].shard_range(rank)[0] - parts[i][1].offset) for i in idx]
            _ops().norm_continue_([parts[i][2] for i in idx], starts, [parts[i][1].numel for i in idx], st)
            states[idx] = st

    run([i for i, (f, l) in enumerate(owner) if f == rank < l])  # the parameters this rank begins
    for k in range(n - 1):
        cross = [i for i, (f, l) in enumerate(owner) if f <= k < l]  # parameters rank k hands to rank k + 1
        if not cross:
            continue
        msg = states[cross] if rank == k else torch.zeros(len(cross), 8)  # one rank's values: the sum is exact
        msg = comm.all_reduce(msg.contiguous().to(comm.mesh.device), "grad_norm_chain", over="shard").cpu()
        if rank == k + 1:
            states[cross] = msg
            run(cross)
    ends = [i for i, (f, l) in enumerate(owner) if f < l == rank]
    norms[ends] = states[ends, 0]
    return comm.all_reduce(norms.to(comm.mesh.device), "grad_norm", over="shard")  # each from the rank finishing it


def _ops():
    from .. import ops  # on first use: importing fshard loads no native code
    return ops


def _ranks(u, s) -> tuple[int, int]:
    """The first and last rank whose shard holds part of slot s of unit u (an empty slot: the rank of its offset)."""
    last = (s.offset + max(s.numel, 1) - 1) // u.shard_numel
    return min(s.offset // u.shard_numel, u.world_size - 1), min(last, u.world_size - 1)


def _rounded_norms(comm, parts: list[torch.Tensor], groups: dict) -> list[torch.Tensor]:
    """Each parameter's norm, correctly rounded to its dtype, from float64 sums of squares added over the ranks:
    one all-reduce. Where no torch order can be repeated (CUDA, bf16/fp16 gradients, no native build)."""
    if all(p.device.type == "cpu" for p in parts):  # one native read pass each (vector_norm(float64) is 5-13x)
        sq = torch.tensor([_ops().sq_norm(p) for p in parts], dtype=torch.float64)
    else:
        sq = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float64) ** 2 if p.numel() else
                          torch.zeros((), dtype=torch.float64, device=p.device) for p in parts])
    roots = comm.all_reduce(sq.to(comm.mesh.device), "grad_norm", over="shard").sqrt()
    return [roots[i].to(dtype) for (_, dtype), g in groups.items() for i in g]


def _coef(max_norm: float, norm: float) -> float:
    """``max_norm / (norm + 1e-6)`` in fp32, as clip_grad_norm_ computes it on its fp32 norm tensor."""
    total = torch.tensor(norm, dtype=torch.float32)
    return float(max_norm / (total + 1e-6))


class clip_by_global_norm(Transform):
    """Scale the gradients so that their global L2 norm is at most ``max_norm`` (as clip_grad_norm_ does).
    Reports ``metrics["grad_norm"]`` (before clipping)."""

    name = "clip_by_global_norm"

    def __init__(self, max_norm: float):
        if not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ArgumentError(f"fs.clip_by_global_norm: max_norm must be a number > 0, got {max_norm!r}.")
        self.max_norm = float(max_norm)

    def grads(self, comm, grads: Grads) -> Grads:
        """A link of the grads chain: the norm of what the update applies so far (``shards * scale``), and the
        factor multiplied into ``scale``."""
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

    def __repr__(self) -> str:
        return f"fs.clip_by_global_norm({self.max_norm})"
