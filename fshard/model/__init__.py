"""From a model to a state and back: ``fs.init``, ``fs.full_params``, ``fs.full_state_dict``, and the refusal of
models another wrapper holds.

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._init import full_params, init
from ._state_dict import full_state_dict

__all__ = ["init", "full_params", "full_state_dict"]
