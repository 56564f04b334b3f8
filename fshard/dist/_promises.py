"""Exchanges checked ahead: what ``Collectives.promise`` keeps for one step's ``Comm`` (design/ARCHITECTURE.md,
"Exchanges checked ahead").

A check before each collective brings the ranks together at each. An update whose ranks are meant to drift apart
between its exchanges (fs.muon's pipeline: a rank with less Newton-Schulz in one unit goes on to the next) checks the
whole list of them once, up front, and issues each unchecked if it is the next one promised. If this rank fails
before the end, the rest are issued with zeros, in order, so that no other rank waits in one."""
from __future__ import annotations

import collections
import zlib

import torch
import torch.distributed as dist

from ..errors import PolicyError
from ._agreement import wait_works
from ._bare import bare
from ._protocol import Exchange


class Promises:
    """The exchanges checked ahead and not issued yet, in order."""

    def __init__(self):
        self._left: collections.deque[Exchange] = collections.deque()

    def __len__(self) -> int:
        return len(self._left)

    @staticmethod
    def entry(plan: list[Exchange]) -> tuple:
        """The check every rank makes for ``plan``: its length and a checksum of its exchanges' tags, tables of
        pieces and dtypes, alike on every rank (each rank's splits are its row and column of the table)."""
        crc = zlib.crc32(repr([(e.tag, e.sizes, str(e.dtype)) for e in plan]).encode())
        return ("promise", f"{len(plan)} exchanges", "", crc)

    def add(self, plan: list[Exchange]) -> None:
        if self._left:
            raise PolicyError(f"Collectives.promise: {len(self._left)} exchanges promised before are not issued yet "
                              f"(the next {self._left[0].tag!r}); promise a sequence once it is all issued")
        self._left.extend(plan)

    def is_next(self, tag: str, sizes: str, dtype: torch.dtype, out_splits, in_splits) -> bool:
        """Is this exchange the next one promised? (It stays promised until ``issued``: if issuing it fails, the
        zeros of ``keep`` still pair with the others'.) Anything but the next one, while some are left, is refused."""
        if not self._left:
            return False
        e = self._left[0]
        if (e.tag, e.sizes, e.dtype, e.out_splits, e.in_splits) != (tag, sizes, dtype, tuple(out_splits),
                                                                      tuple(in_splits)):
            raise PolicyError(f"Collectives.exchange: {tag!r} ({sizes}, {dtype}) is not the exchange promised next, "
                              f"{e.tag!r} ({e.sizes}, {e.dtype}, splits {e.out_splits} / {e.in_splits}): an "
                              "optimizer's exchange_plan does not match its update")
        return True

    def issued(self) -> None:
        self._left.popleft()

    def refuse(self, what: str) -> None:
        """Refuse the collective ``what`` while promised exchanges are left: the other ranks are in them, or on
        their way."""
        if self._left:
            raise PolicyError(f"Comm: {what} was about to be issued with {len(self._left)} promised exchanges not "
                              f"issued yet, the next {self._left[0].tag!r}: whatever promised them (an optimizer's "
                              "exchange_plan) does not match what it issued")

    def keep(self, comm) -> None:
        """This rank failed with promised exchanges left: issue each with zeros, in order, so that no other rank
        waits in one (they finish their update on the zeros and fail at the commit vote)."""
        mesh = comm.mesh
        while self._left:
            e = self._left[0]
            out = torch.empty(sum(e.out_splits), dtype=e.dtype, device=mesh.device)
            inp = torch.zeros(sum(e.in_splits), dtype=e.dtype, device=mesh.device)
            with bare():
                work = dist.all_to_all_single(out, inp, list(e.out_splits), list(e.in_splits),
                                              group=mesh.shard_group, async_op=True)
            mesh.hold(out, inp)  # (the process may exit right after the error: Mesh.hold)
            self._left.popleft()
            wait_works([work], comm, lambda: f"its promised exchange {e.tag!r} (zeros: this rank failed)")
