"""The transforms fshard ships: gather_ahead, bucket_reduce, accumulate, clip_by_global_norm, skip_nonfinite,
mixed_precision (with dynamic loss scaling).

Its public names, listed in ``__all__``; the modules behind them are private."""
from ._accumulate import accumulate
from ._bucket_reduce import bucket_reduce
from ._clip import clip_by_global_norm
from ._gather_ahead import GatherOrder, gather_ahead
from ._loss_scale import LossScaleState
from ._mixed_precision import MixedPrecisionState, mixed_precision
from ._skip import skip_nonfinite

__all__ = ["gather_ahead", "GatherOrder", "bucket_reduce", "accumulate", "clip_by_global_norm", "skip_nonfinite",
    "mixed_precision", "MixedPrecisionState", "LossScaleState"]
