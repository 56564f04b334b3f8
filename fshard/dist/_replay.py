"""A step's collectives checked once, at its start: the sequence the steps before issued (design/ARCHITECTURE.md,
"A stable step's collectives are checked once").

A check before each collective brings the ranks together at each: a rank that is a moment behind holds the other
at every gather and reduction, where without checks the two only meet when one needs the other's data
(benchmarks/RESULTS.md, "Session 35": about a tenth of a two-rank step on gloo). Most steps issue exactly the
collectives of the step before. So once two steps in a row of one step function issued the same sequence
(``Sequences``), the next step compares that sequence across ranks once, with the rank check at its start
(``check_ranks``), and then issues each collective unchecked while it is the one expected next (``Replay.take``).

A rank whose step leaves the sequence (a different collective, or fewer of them) first issues what is left of it,
in order, each with zeros (``Replay.leave``), so that a rank still in the sequence pairs every collective it issues
and none waits; then it checks its own collective as usual. Ranks that all leave at the same place (the batches
took another path on every rank) pair their zeros with each other and go on, checked: the step is correct, only
slower. Where some ranks leave and others do not, those that stayed reach their next check (the agreement after
backward) while the others check a different collective, and every rank raises ``RankDivergenceError``. A rank that
raises mid-sequence leaves it the same way before posting its failure (``Comm.fail``). Nothing is committed before
the agreement after backward, so zeros never reach a state.
"""
from __future__ import annotations

import collections
import zlib
from typing import Callable, Optional

import torch

from ._mesh import released

# one collective of a sequence: its check entry (kind, tag, dtype, sizes), and how to issue it with zeros
# (``zeros(comm)``: the same call on zero tensors of the same sizes, waited for); None where that cannot be done
Item = tuple[tuple, Optional[Callable]]


def checksum(items: list[Item] | None) -> int:
    """What ranks compare before following ``items`` (0: none to follow)."""
    return 0 if not items else zlib.crc32(repr([e for e, _ in items]).encode()) or 1


class Replay:
    """The collectives of the sequence being followed, not issued yet, in order."""

    def __init__(self, items: list[Item]):
        self._left: collections.deque[Item] = collections.deque(items)

    def __len__(self) -> int:
        return len(self._left)

    def take(self, entry: tuple) -> bool:
        """Is ``entry`` the collective expected next? Then it is issued unchecked (and no longer expected)."""
        if self._left and self._left[0][0] == entry:
            self._left.popleft()
            return True
        return False

    def leave(self, comm) -> None:
        """Issue what is left of the sequence with zeros, in order, each waited for (the ranks still in it issue
        the real ones: they are in one of them or on their way, never at a check), then follow nothing."""
        left, self._left = self._left, collections.deque()
        for _, zeros in left:
            zeros(comm)


class Sequences:
    """What one step function's steps issued: the sequence to follow once ``need`` steps in a row of the same
    state layout (``key``: the spec's fingerprint) issued the same one (two at first: the first step records the
    gathers' order, a second may prefetch by it and issue in another order). A step that left the sequence and
    committed (every rank took another path: the batches change what runs) doubles ``need``, up to 64, so that a
    model whose collectives change from step to step (routed experts) rarely pays for a sequence's zeros."""

    def __init__(self):
        self._key, self._last, self._same, self._need = None, None, 0, 2

    def to_follow(self, key) -> list[Item] | None:
        return self._last if key == self._key and self._same >= self._need else None

    def observed(self, key, items: list[Item] | None, left: bool) -> None:
        """A step committed, having issued ``items`` (None: not recorded) on a state of layout ``key``; ``left``:
        it left the sequence it followed."""
        if left:
            self._need = min(2 * self._need, 64)
        if items is None or any(z is None for _, z in items):  # (a collective that cannot be issued with zeros)
            self._key, self._last, self._same = None, None, 0
            return
        same = key == self._key and self._last is not None and [e for e, _ in self._last] == [e for e, _ in items]
        self._key, self._last, self._same = key, items, self._same + 1 if same else 1


# --- a collective with zeros, for a sequence left (Comm.leave_sequence): sizes and dtypes only, no tensor kept ---
# Each waits, then waits (bounded) until gloo's thread has let go of the zero tensors, so that they are freed on
# this thread: a rank that fails may exit right after (Mesh.hold's reason; these are too large to hold).

def zeros_gather(numel: int, dtype: torch.dtype, tag: str):
    def zeros(comm) -> None:
        d = comm.mesh.device
        out, shard = torch.empty(numel, dtype=dtype, device=d), torch.zeros(numel // comm.mesh.shard_size,
                                                                             dtype=dtype, device=d)
        comm.gather(out, shard, tag).wait()
        released(out, shard)
    return zeros


def zeros_reduce_scatter(numel: int, dtype: torch.dtype, tag: str):
    def zeros(comm) -> None:
        d = comm.mesh.device
        out, full = torch.empty(numel // comm.mesh.shard_size, dtype=dtype, device=d), torch.zeros(numel, dtype=dtype,
                                                                                                    device=d)
        comm.reduce_scatter(out, full, tag).wait()
        released(out, full)
    return zeros


def zeros_reduce_each(sizes: list[int], dtype: torch.dtype, tag: str):
    def zeros(comm) -> None:
        sections = [torch.zeros(k, dtype=dtype, device=comm.mesh.device) for k in sizes]
        flight = comm.reduce_each(sections, tag)
        scratch = flight.scratch  # (what it receives into, on gloo at two ranks)
        flight.wait()
        released(*sections, *scratch)
    return zeros


def zeros_replicate(numel: int, dtype: torch.dtype, tag: str, sizes):
    def zeros(comm) -> None:
        t = torch.zeros(numel, dtype=dtype, device=comm.mesh.device)
        comm.replicate(t, tag, sizes).wait()
        released(t)
    return zeros


def zeros_all_reduce(numel: int, dtype: torch.dtype, tag: str, op, over: str):
    def zeros(comm) -> None:
        t = torch.zeros(numel, dtype=dtype, device=comm.mesh.device)
        comm.all_reduce(t, tag, op, over)
        released(t)
    return zeros
