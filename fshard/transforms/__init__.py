"""The transforms fshard ships: gather_ahead, bucket_reduce, accumulate, clip_by_global_norm, skip_nonfinite,
mixed_precision (with dynamic loss scaling)."""
