"""Composition, property-tested at world size 1: any subset of the shipped transforms, in any order, trains exactly
as the blocking step with the same result-changing transforms (clip, skip, accumulate), bit for bit.

gather_ahead and bucket_reduce change only when collectives happen; clip_by_global_norm and skip_nonfinite wrap
the grads stage and commute (both read the one shared norm; clip scales, skip skips); accumulate sets the
batches stage. So the order given to fs.compose must never change a bit of the result.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard as fs
import fshard.testing as ft
from models import Awkward, awkward_batches, awkward_loss

STEPS = 2


def _loss(m, batch):
    x, y, poison = batch
    return awkward_loss(m, (x, y)) * (float("inf") if poison else 1.0)


@st.composite
def _compositions(draw):
    """(transforms in the order drawn, the blocking reference's transforms, k, poison per micro-batch)."""
    k = draw(st.integers(1, 3))
    speed = draw(st.lists(st.sampled_from(["gather", "reduce"]), unique=True))
    semantic = draw(st.lists(st.sampled_from(["clip", "skip", "accumulate"]), unique=True))
    if k > 1 and "accumulate" not in semantic:
        semantic.append("accumulate")
    make = {"gather": lambda: fs.gather_ahead(draw(st.integers(0, 3))),
            "reduce": lambda: fs.bucket_reduce(draw(st.sampled_from([1e-6, 2e-4, 25]))),
            "clip": lambda: fs.clip_by_global_norm(draw(st.sampled_from([1e-3, 0.1, 10.0]))),
            "skip": fs.skip_nonfinite, "accumulate": lambda: fs.accumulate(k)}
    made = {name: make[name]() for name in speed + semantic}
    order = draw(st.permutations(list(made)))
    reference = [made[n] for n in ("accumulate", "clip", "skip") if n in made]
    poison = [[draw(st.booleans()) and "skip" in made for _ in range(k)] for _ in range(STEPS)]
    return [made[n] for n in order], reference, k, poison


def _train(transforms, k, poison):
    torch.manual_seed(0)
    state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw(lr=1e-2, weight_decay=0.1))
    bs = list(awkward_batches(2, STEPS * k))
    losses = []
    with fs.compose(_loss, *transforms) as step:
        for s in range(STEPS):
            mbs = [(x, y, p) for (x, y), p in zip(bs[s * k:(s + 1) * k], poison[s])]
            state, m = step(state, mbs if any(isinstance(t, fs.accumulate) for t in transforms) else mbs[0])
            losses.append(m["loss"])
    return state, losses


@pytest.mark.filterwarnings("ignore:fshard. non-finite gradients")
@settings(max_examples=40, deadline=None)
@given(_compositions())
def test_any_subset_and_order_trains_as_the_blocking_step_bit_for_bit(case):
    transforms, reference, k, poison = case
    got, got_losses = _train(transforms, k, poison)
    want, want_losses = _train(reference, k, poison)
    ft.check_unchanged(got, ft.snapshot(want))  # every leaf, bit for bit: params, moments, counts, step, skipped
    assert int(got.skipped) == sum(any(p) for p in poison) and int(got.step) == STEPS - int(got.skipped)
    assert got_losses == want_losses
