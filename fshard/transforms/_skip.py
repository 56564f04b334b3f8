"""fs.skip_nonfinite: skip a step whose gradients hold inf or NaN, on every rank alike.

An inf on one rank's local gradient reaches only the ranks whose shards cover it after the reduction, so a local
check would let ranks disagree. The decision uses the global sum of squares (``Grads.with_sq_norm``: one
all-reduce, shared with the loss scaler when both are composed), which is the same number on every rank and is
non-finite exactly when some gradient element is. A skipped step returns its input state with
``state.skipped`` counted up (training state: it is checkpointed with the rest) and the buffers forward updated
(as torch keeps BatchNorm's running statistics of a step whose optimizer step is skipped), sets
``metrics["skipped"]``, and warns.
"""
from __future__ import annotations

import math
import warnings

from ..protocol._stages import Grads
from ..protocol._transform import Transform


class skip_nonfinite(Transform):
    """Skip the update when any gradient is inf or NaN; every rank decides the same way (a link of the grads
    chain: it sees the gradients as the transforms before it left them)."""

    name = "skip_nonfinite"

    def grads(self, comm, grads: Grads) -> Grads:
        grads = grads.with_sq_norm(comm)
        finite = math.isfinite(grads.sq_norm)
        if not finite:
            warnings.warn("fshard: non-finite gradients (inf or NaN); the step was skipped: no update, and "
                          "state.skipped counted up (metrics['skipped_total']).", stacklevel=4)
        return grads.replace(skip=grads.skip or not finite, metrics={**grads.metrics, "skipped": int(not finite)})
