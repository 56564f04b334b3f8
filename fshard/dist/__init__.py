"""Ranks and their collectives: ``Mesh``, the step's ``Comm``, how ranks agree (the check before each collective,
the descriptors every rank raises with), and ``Call``, a collective call outside a step.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._mesh import Mesh

__all__ = ["Mesh"]
