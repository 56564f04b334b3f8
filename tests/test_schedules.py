"""Learning-rate schedules and weight-decay masks against torch.optim.AdamW with two param groups and LambdaLR.

The oracle: DDP + ``torch.optim.AdamW([{decay params, weight_decay=wd}, {the others, weight_decay=0}], lr=1.0)`` and
``LambdaLR(opt, schedule)`` (base lr 1.0, so torch's ``lr = base_lr * schedule(count)`` is exactly
``schedule(count)``), on the same batches, with the test models' tied, frozen, unused, 0-dim and prime-sized
parameters. Bitwise with ``impl="torch"`` at world sizes 1 and 2; within 1e-6 with the native kernel, and at 3.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _dist import run_ranks
from models import check_oracle, oracle_model, oracle_step, param_diffs

STEPS = 8
HP = dict(betas=(0.9, 0.95), eps=1e-8)
WD = 0.1


def _mask(name, p):
    return p.ndim >= 2  # matrices decay; biases, norms, the 0-dim scale and 1-dim params do not


def _schedule():
    import fshard as fs
    return fs.schedules.warmup_cosine_decay_schedule(3e-4, 3e-3, warmup_steps=3, decay_steps=STEPS, end_value=3e-4)


def _compare(name: str, impl: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = oracle_model(name, STEPS, seed=5)
    ref = copy.deepcopy(model)
    schedule = _schedule()
    state = fs.init(model, mesh, fs.adamw(lr=schedule, weight_decay=WD, weight_decay_mask=_mask, impl=impl, **HP))
    step = fs.compose(loss_fn)
    ddp = DDP(ref, find_unused_parameters=True) if mesh.world_size > 1 else ref
    trainable = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if _mask(n, p)], "weight_decay": WD},
              {"params": [p for n, p in trainable if not _mask(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1.0, fused=impl != "torch", **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ours, theirs, lrs = [], [], []
    for batch in batches(mesh.rank, mesh.world_size):
        lrs.append((state.spec.optimizer.lr_at(int(state.step)), opt.param_groups[0]["lr"]))
        state, metrics = step(state, batch)
        ours.append(metrics["loss"])
        theirs.append(oracle_step(ddp, opt, loss_fn, batch, mesh.world_size))
        sched.step()
    diffs, equal = param_diffs(fs.full_params(state), ref)
    bitwise = equal and ours == theirs
    return ours, theirs, diffs, bitwise, lrs


def _all_cases():
    return {(name, impl): _compare(name, impl) for name in ("gpt", "awkward") for impl in ("torch", "native")}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_schedule_and_mask_match_torch_param_groups_and_lambdalr(world_size):
    results = run_ranks(_all_cases, world_size) if world_size > 1 else [_all_cases()]
    for rank_result in results:
        for (name, impl), (ours, theirs, diffs, bitwise, lrs) in rank_result.items():
            assert [a for a, _ in lrs] == [b for _, b in lrs], f"{name}/{impl}: learning rates differ"
            assert len(set(a for a, _ in lrs)) > 3  # the schedule really moves
            check_oracle(f"{name}/{impl}", world_size, impl, ours, theirs, diffs, bitwise)


def test_the_mask_changes_the_result():
    """A mask that decays nothing gives a different result from decaying everything (the mask is applied)."""
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss

    out = []
    for mask in (None, lambda n, p: False):
        torch.manual_seed(0)
        state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw(lr=1e-2, weight_decay=0.5, weight_decay_mask=mask,
                                                             impl="torch"))
        step = fs.compose(awkward_loss)
        for b in awkward_batches(2, 3):
            state, _ = step(state, b)
        out.append(fs.full_params(state)["up.weight"])
    assert not torch.equal(out[0], out[1])


def test_a_skipped_step_does_not_advance_the_schedule():
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss

    seen = []

    def lr(count):
        seen.append(count)
        return 1e-3

    torch.manual_seed(0)
    state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw(lr=lr))
    step = fs.compose(lambda m, b: awkward_loss(m, b[:2]) * b[2], fs.skip_nonfinite())
    for i, (x, y) in enumerate(awkward_batches(2, 4)):
        state, _ = step(state, (x, y, float("inf") if i == 1 else 1.0))
    assert int(state.step) == 3 and int(state.skipped) == 1
    assert sorted(set(seen)) == [0, 1, 2]  # the update after the skipped step still uses count 1


def test_bad_schedules_and_masks_name_the_fix():
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss

    with pytest.raises(fs.ArgumentTypeError, match="schedule lr"):
        fs.adamw(lr="3e-4")
    with pytest.raises(fs.ArgumentTypeError, match="mask"):
        fs.adamw(weight_decay_mask=True)
    with pytest.raises(fs.ArgumentTypeError, match="must return True"):
        fs.init(Awkward(), fs.Mesh.local(), fs.adamw(weight_decay_mask=lambda n, p: p.ndim))
    state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw(lr=lambda c: float("nan")))
    with pytest.raises(fs.ArgumentError, match="finite number"):
        fs.compose(awkward_loss)(state, next(awkward_batches(2, 1)))
    state.check_usable()  # nothing was updated: the input state is still the one to use
    assert int(state.step) == 0


# ---------------------------------------------------------------- the schedules themselves (optax's definitions)


def test_schedules_at_known_points():
    from fshard import schedules as S
    assert S.constant_schedule(0.1)(7) == 0.1
    lin = S.linear_schedule(0.0, 1.0, transition_steps=4, transition_begin=2)
    assert [lin(c) for c in range(8)] == [0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    cos = S.cosine_decay_schedule(2.0, decay_steps=10, alpha=0.1)
    assert cos(0) == 2.0 and cos(10) == cos(99) == pytest.approx(0.2) and cos(5) == pytest.approx(1.1)
    w = S.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14, end_value=0.1)
    assert w(0) == 0.0 and w(2) == 0.5 and w(4) == 1.0 and w(9) == pytest.approx(0.55) and w(14) == pytest.approx(0.1)
    assert w(100) == pytest.approx(0.1)


@given(st.floats(0, 1), st.floats(0, 1), st.integers(1, 50), st.integers(0, 10), st.integers(0, 200))
def test_linear_schedule_stays_between_its_ends(a, b, steps, begin, count):
    from fshard import schedules as S
    v = S.linear_schedule(a, b, steps, begin)(count)
    assert min(a, b) - 1e-12 <= v <= max(a, b) + 1e-12


@given(st.floats(1e-6, 1), st.floats(1e-6, 1), st.integers(0, 20), st.integers(1, 50), st.floats(0, 1))
def test_warmup_cosine_is_continuous_and_ends_at_end_value(init, peak, warmup, extra, end_frac):
    from fshard import schedules as S
    end = peak * end_frac
    s = S.warmup_cosine_decay_schedule(init, peak, warmup, warmup + extra, end)
    assert s(warmup) == pytest.approx(peak)
    assert s(warmup + extra) == pytest.approx(end, abs=1e-12) and s(warmup + extra + 5) == pytest.approx(end)
    for c in range(warmup + extra):  # no jump larger than the steepest part of either piece allows
        assert abs(s(c + 1) - s(c)) <= abs(peak - init) / max(warmup, 1) + math.pi * peak / extra + 1e-12
