"""What a policy receives of the step's collectives (``fs.protocol.Collectives``, ``fs.protocol.InFlight``,
``fs.protocol.Exchange``): declared here, beside their implementation (``Comm`` in fshard/dist/_collectives.py,
``CollectivesView`` in _view.py), so that the collectives do not import the stage protocols that re-export them
(fshard/protocol/_stages.py)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from ._mesh import Mesh


class InFlight(Protocol):
    """A collective that was issued asynchronously."""

    def done(self) -> bool:
        """Whether it has completed; never blocks."""

    def wait(self) -> None:
        """Block until its output may be read."""


class Collectives(Protocol):
    """The step's collectives. Every gather and reduction is recorded and hashed (ranks compare the sequence after
    backward, so ranks that issue different ones fail the step instead of mixing data); ``all_reduce``, a small
    control message, is recorded in the trace but not hashed.

    On a 2-D mesh (HSDP) the shards live in the rank's shard group: ``reduce_scatter`` and ``reduce_each`` sum over
    it, and ``replicate`` then sums each reduced shard over the replica group (ranks holding the same shard).

    Attributes:
      mesh: the ranks of the state (``fs.Mesh``): ``rank``, ``world_size``, ``device``; ``shard_rank`` of
        ``shard_size`` (what the layout shards over), ``replicas``.
    """

    mesh: Mesh

    def all_reduce(self, t: torch.Tensor, tag: str, over: str = "world") -> torch.Tensor:
        """Sum a small control tensor over ranks (``over="shard"``: over the shard group only, each shard once), in
        place, blocking. Returns ``t``."""

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str) -> InFlight:
        """Start ``out <- this rank's 1/k slice of the sum over the shard group's k ranks of full``."""

    def reduce_each(self, sections: Sequence[torch.Tensor], tag: str, empty=None) -> InFlight:
        """Start one SUM reduce per rank of the shard group: ``sections[r]`` is summed into shard rank r's
        ``sections[r]``. ``empty(numel, dtype)``: where a buffer the transport receives into comes from (by default
        a new one); it is the caller's again once the flight has been waited for."""

    def exchange(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list, tag: str,
                 sizes: str) -> InFlight:
        """Start an all-to-all over the shard group: piece r of ``inp`` (``in_splits[r]`` elements, in rank order) to
        shard rank r; shard rank r's piece for this rank into piece r of ``out`` (``out_splits``). ``sizes``: the
        entry every rank checks (the group's whole table of pieces, the same on every rank)."""

    def replicate(self, t: torch.Tensor, tag: str, sizes: str | None = None) -> InFlight:
        """Start the SUM all-reduce of a reduced shard over the replica group (nothing on a 1-D mesh); ``sizes``:
        the entry every rank checks where the shard ranks' sizes differ."""

    def promise(self, exchanges: Sequence[Exchange]) -> None:
        """Check, in one check, the ``exchange`` calls about to follow, in this order, with nothing else between
        them; each is then issued without a check of its own, so that a rank does not wait at each for the others
        to reach it. Call it only where every rank knows the whole sequence up front and issues no other collective
        until its end (``DeviceUpdate`` does, for an optimizer with ``exchange_plan``). If this rank fails before
        the end, its failure handler issues the rest with zeros, so that no other rank waits in one, and posts the
        failure at their next check (the step's commit vote)."""


class Exchange(NamedTuple):
    """One ``Collectives.exchange`` call announced to ``Collectives.promise``: its arguments but the tensors.

    Attributes:
      tag, sizes: as ``exchange`` takes them.
      dtype: the tensors' dtype.
      out_splits, in_splits: as ``exchange`` takes them (elements from and to each shard rank).
    """

    tag: str
    sizes: str
    dtype: torch.dtype
    out_splits: tuple
    in_splits: tuple
