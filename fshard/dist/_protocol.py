"""What a policy receives of the step's collectives (``fs.protocol.Collectives``, ``fs.protocol.InFlight``): declared
here, beside their implementation (``Comm`` and ``CollectivesView`` in fshard/dist/_collectives.py), so that the
collectives do not import the stage protocols that re-export them (fshard/protocol/_stages.py)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

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

    Attributes:
      mesh: the ranks of the state (``fs.Mesh``): ``rank``, ``world_size``, ``device``.
    """

    mesh: Mesh

    def all_reduce(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Sum a small control tensor over ranks, in place, blocking. Returns ``t``."""

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str) -> InFlight:
        """Start ``out <- this rank's 1/N slice of the sum over ranks of full``."""

    def reduce_each(self, sections: Sequence[torch.Tensor], tag: str) -> InFlight:
        """Start one SUM reduce per rank: ``sections[r]`` is summed over ranks into rank r's ``sections[r]``."""
