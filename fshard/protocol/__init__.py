"""The stage protocols a transform's policies follow (``GatherPolicy`` ... ``UpdatePolicy``, the views they
receive, ``Grads``) and ``Transform`` with ``fold``, which composes transforms.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ..dist._protocol import Collectives, Exchange, InFlight
from ._grads import Grads
from ._stages import BatchesPolicy, GatherPolicy, GradsPolicy, ReducePolicy, StepView, UnitView, UpdatePolicy
from ._transform import Policy, Transform

__all__ = ["Transform", "Policy", "GatherPolicy", "ReducePolicy", "GradsPolicy", "UpdatePolicy", "BatchesPolicy",
    "StepView", "UnitView", "Collectives", "Exchange", "InFlight", "Grads"]
