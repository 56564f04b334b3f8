"""The step: ``fs.compose`` and ``Step`` (the call, ``eval``, ``plan``, ``close``), its guards, ``fs.Plan`` and the
simulated step that makes it, and ``fs.timeline``.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._plan import Plan
from ._step import Step, compose
from ._timeline import Timeline, timeline

__all__ = ["compose", "Step", "Plan", "timeline", "Timeline"]
