"""Learning-rate schedules for ``fs.adamw(lr=...)``, named and defined as optax defines them.

A schedule is a plain callable ``schedule(count) -> float``: ``count`` is the number of updates already applied
(``state.step``; 0 for the first update, as torch's ``LambdaLR`` counts), so a state resumed from a checkpoint
continues where it was. The values are Python floats computed in float64, the same on every rank.

    lr = fs.schedules.warmup_cosine_decay_schedule(0.0, 3e-4, warmup_steps=100, decay_steps=10_000)
    opt = fs.adamw(lr=lr, weight_decay=0.1, weight_decay_mask=lambda name, p: p.ndim >= 2)

Each schedule is a small frozen object with a readable ``repr`` (it appears in ``print(state)``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ArgumentError

__all__ = ["constant_schedule", "linear_schedule", "cosine_decay_schedule", "warmup_cosine_decay_schedule",
           "join_schedules"]


def _count(count) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ArgumentError(f"a schedule takes the number of updates applied, an int >= 0, got {count!r}.")
    return count


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ArgumentError(f"{name} must be an int > 0, got {value!r}.")


@dataclass(frozen=True)
class constant_schedule:
    """``value`` at every count."""

    value: float

    def __call__(self, count: int) -> float:
        _count(count)
        return float(self.value)


@dataclass(frozen=True)
class linear_schedule:
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps`` updates, starting after
    ``transition_begin`` updates; constant before and after. A linear warmup (``0 -> peak``) or a linear decay."""

    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0

    def __post_init__(self):
        _positive("linear_schedule: transition_steps", self.transition_steps)
        if not isinstance(self.transition_begin, int) or self.transition_begin < 0:
            raise ArgumentError(f"linear_schedule: transition_begin must be an int >= 0, got "
                                f"{self.transition_begin!r}.")

    def __call__(self, count: int) -> float:
        done = min(max(_count(count) - self.transition_begin, 0), self.transition_steps) / self.transition_steps
        return float(self.init_value + (self.end_value - self.init_value) * done)


@dataclass(frozen=True)
class cosine_decay_schedule:
    """``init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * t / decay_steps))) ** exponent + alpha)`` with
    ``t = min(count, decay_steps)``: from ``init_value`` down to ``alpha * init_value``, then constant."""

    init_value: float
    decay_steps: int
    alpha: float = 0.0
    exponent: float = 1.0

    def __post_init__(self):
        _positive("cosine_decay_schedule: decay_steps", self.decay_steps)

    def __call__(self, count: int) -> float:
        t = min(_count(count), self.decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * t / self.decay_steps))
        return float(self.init_value * ((1.0 - self.alpha) * cosine ** self.exponent + self.alpha))


@dataclass(frozen=True)
class join_schedules:
    """``schedules[i]`` from ``boundaries[i - 1]`` on, fed the count since that boundary (optax's join)."""

    schedules: Sequence[Callable[[int], float]]
    boundaries: Sequence[int]

    def __post_init__(self):
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "boundaries", tuple(self.boundaries))
        if len(self.schedules) != len(self.boundaries) + 1 or list(self.boundaries) != sorted(self.boundaries):
            raise ArgumentError("join_schedules: give one more schedule than boundaries, and boundaries in "
                                f"increasing order; got {len(self.schedules)} schedules, boundaries "
                                f"{list(self.boundaries)}.")

    def __call__(self, count: int) -> float:
        count, start, i = _count(count), 0, 0
        while i < len(self.boundaries) and count >= self.boundaries[i]:
            start, i = self.boundaries[i], i + 1
        return float(self.schedules[i](count - start))


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
                                 end_value: float = 0.0, exponent: float = 1.0) -> join_schedules:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps`` updates, then cosine decay to
    ``end_value`` at update ``decay_steps`` (counted from the start, warmup included), as optax defines it."""
    _positive("warmup_cosine_decay_schedule: decay_steps", decay_steps)
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps < decay_steps:
        raise ArgumentError(f"warmup_cosine_decay_schedule: warmup_steps must be an int in [0, decay_steps), got "
                            f"{warmup_steps!r} with decay_steps={decay_steps}.")
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    warmup = linear_schedule(init_value, peak_value, max(warmup_steps, 1))
    return join_schedules([warmup, cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
                          [warmup_steps])
