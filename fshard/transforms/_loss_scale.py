"""Dynamic loss scaling for fp16, as ``torch.amp.GradScaler`` does it, with the scale in the state.

fp16 holds numbers down to about 6e-8 (6e-5 at full precision), and small gradients flush to zero there. Backward
therefore runs on ``loss * scale``; the gradients arrive multiplied by ``scale``, and the update must apply them
divided by it. When a scaled gradient overflows (inf or NaN), the step is skipped on every rank and the scale is
multiplied by ``backoff_factor``; after ``growth_interval`` good steps in a row it is multiplied by
``growth_factor``. Those are GradScaler's rules (``torch._amp_update_scale_``), and its defaults.

Where each part runs:

- the scale is training state: ``LossScaleState`` in ``TrainState.transform_state`` (under ``fs.mixed_precision``'s
  entry), so a resumed run goes on with its scale, and a pure step returns the new one;
- backward's scaling: this grads link declares ``scales_loss``, and the step multiplies the loss before backward
  (``GradsPolicy.loss_scale``);
- the unscale: the step starts ``Grads.scale`` at ``1 / scale``, and the update fuses it into its kernel (the
  native AdamW multiplies each gradient as it reads it): no pass over the gradients, where GradScaler's
  ``unscale_`` reads and writes each one;
- the check: whether any gradient element is inf or NaN must be the same answer on every rank (each holds
  different shards), so it is the global sum of squares (``Grads.with_sq_norm``: one read pass, one small
  all-reduce, shared with ``skip_nonfinite``), non-finite exactly when some element is. A check inside the
  update kernel (``fshard.ops.adamw_(check_finite=True)``) would be local: one rank would skip while another
  updated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..protocol._stages import Grads, GradsPolicy
from ..errors import ArgumentError
from ..state._train_state import register_node


@register_node
@dataclass(frozen=True)
class LossScaleState:
    """The loss scale (a 0-dim fp32 tensor, as GradScaler's) and the good steps since it last changed (int64)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor

    @staticmethod
    def initial(scale: float) -> "LossScaleState":
        return LossScaleState(torch.tensor(float(scale), dtype=torch.float32), torch.zeros((), dtype=torch.int64))

    def __repr__(self) -> str:
        return f"LossScaleState(scale={float(self.scale):g}, growth_tracker={int(self.growth_tracker)})"


@dataclass(frozen=True)
class LossScaling:
    """The rules: ``torch.amp.GradScaler``'s arguments (``dynamic=False``: the scale never changes, and a step
    whose gradients overflow is still skipped, as DeepSpeed's static loss scale does)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    dynamic: bool = True

    def __post_init__(self):
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ArgumentError(f"fs.mixed_precision: init_scale must be a finite number > 0, got {self.init_scale}.")
        if self.dynamic and not (self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0):
            raise ArgumentError(f"fs.mixed_precision: growth_factor must be > 1 and backoff_factor in (0, 1), got "
                                f"{self.growth_factor} and {self.backoff_factor}.")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ArgumentError(f"fs.mixed_precision: growth_interval must be an int >= 1, got "
                                f"{self.growth_interval!r}.")

    def next(self, s: LossScaleState, found_inf: bool) -> LossScaleState:
        """The state after a step that found (or not) a non-finite gradient: ``torch._amp_update_scale_``."""
        if not self.dynamic:
            return s
        scale, tracker = float(s.scale), int(s.growth_tracker)
        if found_inf:
            scale, tracker = scale * self.backoff_factor, 0
        elif tracker + 1 == self.growth_interval:
            grown = float(torch.tensor(scale * self.growth_factor, dtype=torch.float32))
            scale, tracker = (grown if math.isfinite(grown) else scale), 0
        else:
            tracker += 1
        return LossScaleState(torch.tensor(scale, dtype=torch.float32), torch.tensor(tracker, dtype=torch.int64))


class LossScale(GradsPolicy):
    """fs.mixed_precision's link of the grads chain (``grads_link``): scales the loss, skips a step whose gradients
    overflow, and steps the scale. Its
    ``LossScaleState`` is the ``loss_scale`` field of the entry ``key`` of ``transform_state`` (its transform's)."""

    changes_grads = True  # skip; the unscale is in Grads.scale
    scales_loss = True

    def __init__(self, rules: LossScaling, key: str):
        self.rules, self.key = rules, key

    def loss_scale(self, state) -> float:
        return float(state.transform_state[self.key].loss_scale.scale)

    def __call__(self, comm, grads: Grads) -> Grads:
        grads = grads.with_sq_norm(comm)
        found_inf = not math.isfinite(grads.sq_norm)  # the same on every rank: one global sum
        entry = grads.transform_state[self.key]
        new = entry.replace(loss_scale=self.rules.next(entry.loss_scale, found_inf))
        return grads.replace(skip=grads.skip or found_inf,
                             transform_state={**grads.transform_state, self.key: new},
                             metrics={**grads.metrics, "loss_scale": float(entry.loss_scale.scale),
                                      "skipped": int(grads.skip or found_inf)})
