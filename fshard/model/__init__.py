"""From a model to a state and back: ``fs.init``, ``fs.full_params``, ``fs.full_state_dict``, and the refusal of
models another wrapper holds."""
