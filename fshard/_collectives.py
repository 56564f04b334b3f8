"""The collectives of one step: torch.distributed calls, plus a record of what was issued.

Every collective goes through a ``Comm``, which keeps (a) a hash of the sequence of collectives, which ranks
compare at the end of the step so that a divergence is an error rather than silently mixed data, (b) seconds spent
per kind, for the step's profile, and (c) optionally the full list, which tests compare across ranks.
"""
from __future__ import annotations

import time
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from ._mesh import Mesh

HASH_BITS = 20  # small enough that sum(h**2) over 8 ranks is exact in float64 (see agree())


class Comm:
    def __init__(self, mesh: Mesh, trace: bool = False):
        self.mesh = mesh
        self.trace: list[tuple] | None = [] if trace else None
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self._hash = 0

    @property
    def seq_hash(self) -> int:
        return self._hash & ((1 << HASH_BITS) - 1)

    def _note(self, kind: str, tag: str, t: torch.Tensor) -> None:
        entry = (kind, tag, str(t.dtype).removeprefix("torch."), t.numel())
        self._hash = zlib.crc32(repr(entry).encode(), self._hash)
        self.bytes[kind] += t.nbytes
        if self.trace is not None:
            self.trace.append(entry)

    def _issue(self, kind: str, phase: str, tag: str, t: torch.Tensor, collective, local) -> None:
        """Note, then run and time one data collective (``local`` when there is no process group)."""
        self._note(kind, tag, t)
        t0 = time.perf_counter()
        local() if self.mesh.group is None else collective()
        self.seconds[phase] += time.perf_counter() - t0

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, tag: str) -> None:
        """out <- concatenation of every rank's ``shard`` (blocking)."""
        self._issue("all_gather", "gather", tag, out, lambda: dist.all_gather_single(out, shard, group=self.mesh.group),
                    lambda: out.copy_(shard))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str) -> None:
        """out <- this rank's slice of the sum over ranks of ``full`` (blocking)."""
        self._issue("reduce_scatter", "reduce", tag, full,
                    lambda: dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=self.mesh.group),
                    lambda: out.copy_(full))

    def all_reduce(self, t: torch.Tensor, tag: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of a small control tensor; not hashed (it carries the hash check itself)."""
        if self.trace is not None:
            self.trace.append(("all_reduce", tag, str(t.dtype).removeprefix("torch."), t.numel()))
        t0 = time.perf_counter()
        if self.mesh.group is not None:
            dist.all_reduce(t, op=op, group=self.mesh.group)
        self.seconds["control"] += time.perf_counter() - t0
        return t


def agree(comm: Comm, values: list[float], hashes: list[int]) -> tuple[list[float], list[bool]]:
    """One all-reduce that sums ``values`` over ranks and tells, for each small integer in ``hashes``, whether
    every rank holds the same one: all n values are equal iff n * sum(h^2) == sum(h)^2 (Cauchy-Schwarz).
    All entries stay exact in float64, so the check is exact."""
    n = comm.mesh.world_size
    buf = torch.tensor(values + [float(h) for h in hashes] + [float(h) ** 2 for h in hashes], dtype=torch.float64,
                       device=comm.mesh.device)
    comm.all_reduce(buf, "agree")
    k, m = len(values), len(hashes)
    sums, sq = buf[k:k + m].tolist(), buf[k + m:].tolist()
    return buf[:k].tolist(), [n * q == s * s for s, q in zip(sums, sq)]
