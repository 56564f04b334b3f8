"""fs.skip_nonfinite: skip a step whose gradients hold inf or NaN, on every rank alike.

An inf on one rank's local gradient reaches only the ranks whose shards cover it after the reduction, so a local
check would let ranks disagree. The decision uses the global sum of squares (one all-reduce, shared with
clip_by_global_norm when both are composed), which is the same number on every rank and is non-finite exactly
when some gradient element is. A skipped step returns its input state (bitwise unchanged, not even the step
count moves), sets ``metrics["skipped"]``, and warns with the number of steps this step function has skipped.
"""
from __future__ import annotations

import math
import warnings

from ._clip import global_sq_norm
from ._transforms import Grads, Transform


class _Skip:
    def __init__(self, inner):
        self.inner = inner
        self.skipped = 0  # steps skipped by this step function (a counter, not training state)

    def __call__(self, comm, grads: Grads) -> Grads:
        grads = self.inner(comm, grads)
        finite = math.isfinite(global_sq_norm(comm, grads))
        grads.metrics["skipped"] = int(not finite)
        if not finite:
            grads.skip = True
            self.skipped += 1
            warnings.warn(f"fshard: non-finite gradients (inf or NaN); the step was skipped and the state is "
                          f"unchanged. {self.skipped} step(s) skipped so far by this step function.", stacklevel=3)
        grads.metrics["skipped_total"] = self.skipped
        return grads


class skip_nonfinite(Transform):
    """Skip the update when any gradient is inf or NaN; every rank decides the same way."""

    name = "skip_nonfinite"

    def wrap_grads(self, grads):
        return _Skip(grads)
