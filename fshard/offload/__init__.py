"""``fs.offload_state``: optimizer moments (and parameter shards) held in stores and streamed through the
update (design/OFFLOAD.md): the transform, its update policy, the pipeline, and which units go to which tier.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._transform import offload_state

__all__ = ["offload_state"]
