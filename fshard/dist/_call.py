"""Collective calls outside a step (fs.save, fs.load, fs.latest(mesh=), fs.full_params, fs.full_state_dict): a
failure on one rank is an fshard error on every rank at once, never a wait for the collective timeout.

Such a call is phases of local work (reading a manifest, checking a path, writing files), each ended by a check that
every rank joins: fshard/dist/_agreement.py's ``check``, an all-gather of ``[h, failed]``, where ``h`` hashes what
every rank must hold alike (the path, the manifest it read, the files it sees) and ``failed`` is 1 on a rank whose
work raised. If no rank failed and the hashes are equal, the call goes on to its next phase, whose
collectives therefore pair. Otherwise every rank learns it at that check, and one all-gather of fixed-size
descriptors names each rank's side: the rank that failed raises its own error, the others ``RankFailedError``
naming it; ranks that hold different values raise ``RankDivergenceError`` naming each one's. A rank interrupted
(Ctrl-C) or killed posts nothing; the others' wait at the check is interruptible and ends in a ``CollectiveError``
naming the call and the ranks that had not arrived (``wait_works``), not in a raw transport error.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._bare import bare
from ._agreement import _descriptors, check, small_hash, wait_works
from ._collectives import Comm
from ..errors import CollectiveError, RankDivergenceError, RankFailedError


class Call:
    """One collective call outside a step on ``mesh``: ``name`` for messages ("fs.save"), ``intact`` says what a
    failure leaves as it was ("step1 is unchanged"). Every rank makes the same calls of ``run`` in the same order."""

    def __init__(self, mesh, name: str, intact: str = ""):
        self.mesh, self.name, self.intact = mesh, name, intact
        self.comm = Comm(mesh, verify=True, context=name)

    def run(self, what: str, fn=None, same=None, differ: str = ""):
        """``fn()`` on this rank (its part of ``what``), then a check every rank joins; returns ``fn``'s result. If
        ``fn`` raised on any rank, every rank raises at the check (this rank its own error). ``same``: a value, or a
        function of ``fn``'s result, that every rank must hold alike; where they differ, every rank raises
        ``RankDivergenceError`` naming each rank's and ``differ`` (the fix)."""
        try:
            out = fn() if fn is not None else None
        except CollectiveError:
            raise  # the transport broke: nothing more can be posted
        except Exception as e:
            try:
                self._check(what, failure=e)
            except CollectiveError:
                pass  # the transport broke too; this rank's own error is the one to report
            raise
        value = same(out) if callable(same) else same
        self._check(what, value=value, differ=differ)
        return out

    def all_reduce(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Sum ``t`` (a CPU tensor) over ranks, after a ``run`` that agreed on its size, on the mesh's device (NCCL
        reduces only device tensors); interruptible, transport errors named. Returns the sum on the CPU."""
        if self.mesh.group is None:
            return t
        d = t.to(self.mesh.device)
        with bare():
            work = dist.all_reduce(d, group=self.mesh.control_group, async_op=True)
        wait_works([work], self.comm, lambda: what)
        return d.cpu()

    def _check(self, what: str, value=None, differ: str = "", failure: BaseException | None = None) -> None:
        mesh = self.mesh
        if mesh.group is None:
            return
        same, failed = check(self.comm, small_hash(value) if failure is None else 0, failure is not None,
                             lambda: f"the other ranks at {what}")  # (the step's own check: a rank saving
        # and one stepping meet at their checks and raise, instead of waiting for the timeout)
        if same and not failed:
            return
        self.comm.closed = True
        mine = (f"failed at {what}: {type(failure).__name__}: {failure}" if failure is not None else
                f"reached {what} with {value!r}")
        sides = _descriptors(self.comm, mine)
        if failure is not None:
            return  # the caller raises its own error
        left = f" {self.intact}." if self.intact else ""
        if failed:
            bad = "; ".join(f"rank {r} {d}" for r, d in enumerate(sides) if d.startswith("failed"))
            raise RankFailedError(f"{self.name}: {bad}. Every rank stopped at {what}, this one too.{left} The error "
                                  "above is the failing rank's own: fix it there and call again on every rank.")
        listing = "; ".join(f"rank {r} {d}" for r, d in enumerate(sides))
        raise RankDivergenceError(f"{self.name}: ranks differ at {what} ({listing}).{left} {differ}".rstrip())
