"""The training state: ``TrainState`` and ``ShardSpec`` (an immutable optree pytree), the flat-unit layout, the
leaves of shards held in a store, and what ``state.replace`` checks.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._flat import ParamSlot, UnitLayout
from ._stored import Stored, StoredParam
from ._train_state import Donation, FrozenMap, ShardSpec, TrainState

__all__ = ["TrainState", "ShardSpec", "FrozenMap", "Donation", "ParamSlot", "UnitLayout", "Stored", "StoredParam"]
