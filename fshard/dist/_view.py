"""``CollectivesView``: what policies get of a step's ``Comm`` (``fs.protocol.Collectives``), apart from the step's
own collectives (fshard/dist/_collectives.py)."""
from __future__ import annotations

import torch

from ._collectives import Comm, Flight
from ._protocol import Collectives


class CollectivesView(Collectives):
    """What policies get of a step's ``Comm`` (``fs.protocol.Collectives``): the mesh and the collectives a policy may
    issue. The rest of ``Comm`` (gathers, timing, draining) belongs to the step. ``before()`` runs before each
    collective (the step's: issue the gathers launched so far, so that every rank issues its collectives in one order,
    fshard/run/_read_ahead.py)."""

    def __init__(self, comm: Comm, before=None):
        self._comm, self.mesh, self._before = comm, comm.mesh, before or (lambda: None)

    def all_reduce(self, t: torch.Tensor, tag: str, over: str = "world") -> torch.Tensor:
        self._before()
        return self._comm.all_reduce(t, tag, over=over)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str) -> Flight:
        self._before()
        return self._comm.reduce_scatter(out, full, tag)

    def reduce_each(self, sections: list[torch.Tensor], tag: str, empty=None) -> Flight:
        self._before()
        return self._comm.reduce_each(sections, tag, empty)

    def exchange(self, out, inp, out_splits: list, in_splits: list, tag: str, sizes: str) -> Flight:
        self._before()
        return self._comm.exchange(out, inp, out_splits, in_splits, tag, sizes)

    def replicate(self, t: torch.Tensor, tag: str, sizes: str | None = None) -> Flight:
        self._before()
        return self._comm.replicate(t, tag, sizes)

    def promise(self, exchanges) -> None:
        self._before()
        self._comm.promise(exchanges)
