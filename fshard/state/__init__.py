"""The training state: ``TrainState`` and ``ShardSpec`` (an immutable optree pytree), the flat-unit layout, the
leaves of shards held in a store (``in_store``: the one question the core asks of a leaf), where a state keeps its
units (``Where``, ``Placement``, ``placement_of``), and what ``state.replace`` checks.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._flat import ParamSlot, UnitLayout
from ._placement import Placement, Where, placement_of
from ._stored import Stored, StoredParam, in_store
from ._train_state import Donation, FrozenMap, ShardSpec, TrainState

__all__ = ["TrainState", "ShardSpec", "FrozenMap", "Donation", "ParamSlot", "UnitLayout", "Stored", "StoredParam",
           "in_store", "Where", "Placement", "placement_of"]
