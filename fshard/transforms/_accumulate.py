"""fs.accumulate: k micro-batches per optimizer step, reduced once.

With ``fs.compose(loss_fn, fs.accumulate(k))`` the step takes a list of k micro-batches. It runs forward and
backward on each in turn; each unit's gradient is summed locally over the first k-1 micro-batches and reduced
once, in the last micro-batch's backward, as DDP's ``no_sync`` does (with bucket_reduce, the buckets of the last
backward overlap it). The gradient is the average over the micro-batches, as if each loss were divided by k, and
``metrics["loss"]`` is the mean loss. The local sums are full-size gradients of the trainable units, held only
while the step runs (DDP and FSDP keep the same under ``no_sync``).
"""
from __future__ import annotations

import torch

from ..protocol._stages import BatchesPolicy
from ..errors import ArgumentError, ArgumentTypeError
from ..protocol._transform import Transform


class _MicroBatches(BatchesPolicy):
    def __init__(self, k: int):
        self.k = k

    def __call__(self, batch) -> list:
        if not isinstance(batch, list) or len(batch) != self.k:
            what = f"a list of {len(batch)}" if isinstance(batch, list) else type(batch).__name__
            raise ArgumentTypeError(
                f"a step composed with fs.accumulate({self.k}) takes a list of {self.k} micro-batches, got {what}. "
                f"Pass step(state, [mb_1, ..., mb_{self.k}]) (a list, so that a tuple batch such as (x, y) is never "
                "mistaken for micro-batches).")
        return batch


class accumulate(Transform):
    """Accumulate the gradients of k micro-batches per step; reduce them once, in the last micro-batch."""

    name = "accumulate"
    stages = {"batches": "set"}

    def __init__(self, k: int):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ArgumentError(f"fs.accumulate: k must be an int >= 1 (micro-batches per step), got {k!r}.")
        self.k = k

    def wrap_batches(self, batches: BatchesPolicy) -> BatchesPolicy:
        return _MicroBatches(self.k)

    def __repr__(self) -> str:
        return f"fs.accumulate({self.k})"


class Accumulator:
    """One step's gradients summed over its micro-batches before their one reduction, and which parameters got
    a gradient in any of them. With one micro-batch it stays empty."""

    def __init__(self, k: int):
        self.k = k
        self.grads: dict[str, torch.Tensor] = {}
        self.got: dict[str, list[bool]] = {}

    def add(self, name: str, grad: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Add a micro-batch's gradient, summing in ``dtype`` (the reduce policy's ``reduce_dtype``; None: the
        gradient's own)."""
        acc = self.grads.get(name)
        if acc is None:  # autograd hands over the first one: kept, or cast once to the dtype of the sum
            self.grads[name] = grad if dtype is None or grad.dtype == dtype else grad.to(dtype)
        else:
            acc.add_(grad)  # a low-precision grad is upcast into the sum (FSDP2's accumulated grad += grad)

    def got_so_far(self, name: str, got: list[bool]) -> list[bool]:
        """Which parameters got a gradient in the earlier micro-batches or in this one (``got``)."""
        prev = self.got.get(name)
        return list(got) if prev is None else [a or b for a, b in zip(prev, got)]

    def take(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        acc = self.grads.pop(name, None)
        return grad if acc is None else acc.add_(grad)
