"""Flat-unit layout: where each parameter lives in its unit's flat buffer, and which slice each rank holds.

Everything here is plain data and pure functions, so the sharding invariants can be property-tested without
any communication (fs.testing).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import _pages

ROOT = "<root>"  # the root unit: the parameters outside every unit module, and those tied across units
ALIGN_BYTES = 64  # each parameter starts on a cache line; each shard is a whole number of cache lines


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a unit's flat buffer. Tied names share a slot (``aliases``; canonical name first)."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int
    numel: int
    requires_grad: bool


@dataclass(frozen=True)
class UnitLayout:
    """One unit: a flat buffer of ``numel`` elements of ``dtype``, split evenly over ``world_size`` ranks.

    Trainable parameters come first, so the optimizer state of a rank covers the prefix
    ``[0, trainable_numel)`` of its shard and frozen parameters get none.
    """

    name: str
    module: str
    dtype: torch.dtype
    slots: tuple[ParamSlot, ...]
    world_size: int
    numel: int
    trainable_numel: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    @property
    def used_numel(self) -> int:
        return max((s.offset + s.numel for s in self.slots), default=0)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property  # (a layout is frozen; the update asks for these once a unit a step, between kernels
    def trainable(self) -> tuple[ParamSlot, ...]:  # that leave Python's data cold: kept, not recomputed)
        return tuple(s for s in self.slots if s.requires_grad)

    @functools.cached_property
    def trainable_index(self) -> tuple[int | None, ...]:
        """For each slot, its index among the trainable slots (``trainable``), or None for a frozen one."""
        out, k = [], 0
        for s in self.slots:
            out.append(k if s.requires_grad else None)
            k += bool(s.requires_grad)
        return tuple(out)

    def shard_range(self, rank: int) -> tuple[int, int]:
        lo = rank * self.shard_numel
        return lo, lo + self.shard_numel

    def opt_numel(self, rank: int) -> int:
        """Elements of this rank's shard that hold trainable parameters (and so have optimizer state)."""
        lo, hi = self.shard_range(rank)
        return max(0, min(hi, self.trainable_numel) - lo)

    def trainable_ranges(self, rank: int) -> list[tuple[int, int]]:
        """For each trainable slot, the shard-local range it owns: from its start to the next slot's start, so
        the padding after a parameter travels with it (padding stays zero under AdamW). A new list each call, made
        from one kept per rank."""
        kept = self.__dict__.setdefault("_ranges", {})  # (as ``trainable``: computed once per rank)
        if rank not in kept:
            lo, hi = self.shard_range(rank)
            train = self.trainable
            ends = [s.offset for s in train[1:]] + [self.trainable_numel]
            kept[rank] = tuple((min(max(s.offset, lo), hi) - lo, min(max(e, lo), hi) - lo) for s, e in zip(train, ends))
        return list(kept[rank])

    def split_sizes(self) -> list[int]:
        """Sizes that ``torch.split`` cuts the flat buffer into: param, gap, param, gap, ..., tail."""
        sizes, pos = [], 0
        for s in self.slots:
            sizes += [s.offset - pos, s.numel]
            pos = s.offset + s.numel
        return sizes + [self.numel - pos]


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def plan_unit(name: str, module: str, params: list[tuple[tuple[str, ...], tuple[int, ...], bool]],
              dtype: torch.dtype, world_size: int, align_bytes: int = ALIGN_BYTES) -> UnitLayout:
    """Lay out ``params`` ((aliases, shape, requires_grad), in model order) in one padded flat buffer."""
    align = max(1, align_bytes // dtype.itemsize)
    ordered = [p for p in params if p[2]] + [p for p in params if not p[2]]
    slots, pos, trainable_numel = [], 0, 0
    for aliases, shape, requires_grad in ordered:
        numel = math.prod(shape)
        slots.append(ParamSlot(aliases[0], tuple(aliases), tuple(shape), pos, numel, requires_grad))
        pos = _round_up(pos + numel, align)
        if requires_grad:
            trainable_numel = pos
    numel = _round_up(max(pos, 1), world_size * align)
    return UnitLayout(name, module, dtype, tuple(slots), world_size, numel, trainable_numel)


def flatten(layout: UnitLayout, tensors: dict[str, torch.Tensor], device=None) -> torch.Tensor:
    """The padded flat buffer of ``layout`` filled from ``tensors`` (name -> tensor); padding is zero."""
    first = next(iter(tensors.values()), None)
    device = device if device is not None else (first.device if first is not None else "cpu")
    flat = torch.zeros(layout.numel, dtype=layout.dtype, device=device)
    for s in layout.slots:
        flat[s.offset:s.offset + s.numel].copy_(tensors[s.name].detach().reshape(-1))
    return flat


def shard(layout: UnitLayout, tensors: dict[str, torch.Tensor], rank: int, device=None) -> torch.Tensor:
    """Rank ``rank``'s slice of the flat buffer ``flatten(layout, tensors)``, without making the flat buffer: only
    the slice is allocated (a shard never aliases its inputs), and each parameter's overlap with it copied in, so
    init holds one shard, not one unit, per unit."""
    lo, hi = layout.shard_range(rank)

    def write(out):
        out.zero_()
        for s in layout.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b:
                out[a - lo:b - lo].copy_(tensors[s.name].detach().reshape(-1)[a - s.offset:b - s.offset])
    return _pages.state_empty(hi - lo, layout.dtype, device, write)  # (huge pages: read at every update)


def unshard(shards: list[torch.Tensor]) -> torch.Tensor:
    """The flat buffer from all ranks' shards, in rank order."""
    return torch.cat([s.reshape(-1) for s in shards])


def views(flat: torch.Tensor, layout: UnitLayout) -> dict[str, torch.Tensor]:
    """Canonical name -> view of ``flat``. One ``split`` makes all views, so autograd returns the gradient of the
    whole flat buffer from one node (a ``cat``), not one full-size buffer per parameter."""
    pieces = flat.split(layout.split_sizes())
    return {s.name: pieces[2 * i + 1].view(s.shape) for i, s in enumerate(layout.slots)}
