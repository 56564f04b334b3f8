"""The training state: ``TrainState`` and ``ShardSpec`` (an immutable optree pytree), the flat-unit layout, the
leaves of shards held in a store, and what ``state.replace`` checks."""
