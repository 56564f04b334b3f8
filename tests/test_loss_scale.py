"""fp16 with dynamic loss scaling (fs.mixed_precision(torch.float16)) against torch.amp.GradScaler.

The oracle: FSDP2 ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16,
reduce_dtype=torch.float32))`` on every block and the root, ``torch.optim.AdamW`` and ``ShardedGradScaler``, same
weights and batches at world size 2.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _dist import run_ranks
from models import oracle_step, param_diffs
from test_mixed_precision import HP, _setup, fsdp2_mixed


FP16_STEPS = 14


def _fp16_against_fsdp2(max_norm):
    """fshard fp16 with dynamic loss scaling against FSDP2 fp16 and ShardedGradScaler (torch.amp.GradScaler's
    subclass for sharded gradients: it all-reduces the overflow flag, which a plain GradScaler would leave local
    to each rank). growth_interval=3 makes the scale grow back to 2**16 every few steps, where the fp16 gradient
    of the loss itself (2**16 > fp16's largest, 65504) overflows: the run skips a step every fourth."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    fs, mesh, model, loss_fn, _ = _setup()
    from gpt import GPTConfig, synthetic_batches
    batches = list(synthetic_batches(GPTConfig.tiny(n_layers=3), 4, FP16_STEPS, 0, mesh.rank, mesh.world_size))
    ref, opt = fsdp2_mixed(model, mesh.world_size, torch.float16)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    clip = () if max_norm is None else (fs.clip_by_global_norm(max_norm),)
    step = fs.compose(loss_fn, fs.mixed_precision(torch.float16, growth_interval=3), *clip)
    scaler = ShardedGradScaler(device="cpu", growth_interval=3)
    ours, theirs = [], []
    for b in batches:
        state, m = step(state, b)
        ours.append((m["loss"], m["loss_scale"], m["skipped"]))
        scale = scaler.get_scale()
        loss = oracle_step(ref, opt, loss_fn, b, mesh.world_size, scaler=scaler, max_norm=max_norm)
        theirs.append((loss, scale, int(scaler.get_scale() < scale)))  # a skipped step backs the scale off
    full = fs.full_params(state)
    theirs_full = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in ref.named_parameters()}
    diffs, bitwise = param_diffs(full, theirs_full)
    return (ours, theirs, diffs, bitwise, int(state.skipped), scaler.get_scale(),
            float(state.transform_state["mixed_precision"].loss_scale.scale))


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_fp16_loss_scale_and_skipped_steps_equal_grad_scaler(max_norm):
    for ours, theirs, diffs, bitwise, skipped, their_scale, scale in run_ranks(_fp16_against_fsdp2, 2, max_norm):
        assert [o[1:] for o in ours] == [t[1:] for t in theirs]  # the scale sequence and the skipped steps
        assert skipped == sum(t[2] for t in theirs) >= 3 and scale == their_scale
        if max_norm is None:  # the same arithmetic: bitwise
            assert [o[0] for o in ours] == [t[0] for t in theirs]
            assert bitwise, diffs
        else:  # the global norm differs in rounding (fshard: a float64 sum over shards; torch: fp32 norms of
            # DTensors), and fp16's casts of the parameters carry such differences into the forward: losses agree
            # within fp16's resolution, parameters to 1e-4 (the key third of a qkv bias, whose gradient is exactly
            # zero, is rounding noise; models.param_diffs keeps it apart)
            assert all(abs(a[0] - b[0]) <= 1e-3 * abs(b[0]) for a, b in zip(ours, theirs))
            assert max(d for n, d in diffs.items() if not n.endswith("[key]")) <= 1e-4, diffs


def _composed():
    """fp16 with the other transforms: the loss scale lives in the state, so scheduling, offload, a resumed state
    and donation never change a result."""
    fs, mesh, model, loss_fn, batches = _setup()
    import fshard.testing as ft
    fp16 = lambda: fs.mixed_precision(torch.float16, growth_interval=2)  # noqa: E731
    configs = {
        "fp16": (fp16(),),
        "fp16+ahead+buckets": (fs.gather_ahead(1), fs.bucket_reduce(0.004), fp16()),
        "fp16+offload": (fp16(), fs.offload_state(fs.CPUStore(), chunk_mb=0.01)),
        "fp16+accumulate+clip": (fs.accumulate(2), fp16(), fs.clip_by_global_norm(1.0)),
        "fp16 static": (fs.mixed_precision(torch.float16, loss_scale=1024.0),),
    }
    out = {}
    for name, ts in configs.items():
        state = fs.init(copy.deepcopy(model), mesh, fs.adamw(**HP, impl="torch"))
        with fs.compose(loss_fn, *ts) as step:
            rows = []
            for i, b in enumerate(batches[:8]):
                b = [b, b] if "accumulate" in name else b
                plan, before, snap = step.plan(state, b), state, ft.snapshot(state)
                state, m = step(state, b)
                ft.check_unchanged(before, snap)  # a skipped step too: the scale changes in the new state only
                rows.append((m["loss"], m["loss_scale"], m["skipped"]))
                off = [k for k in plan.figures if abs(plan[k] - m[k]) > 0.05 * max(plan[k], m[k])]
                # a plan assumes the update runs; a skipped step makes no new state and writes nothing
                skip_only = {"mem/new_state_bytes", "mem/peak_bytes", "io/write_bytes", "io/read_bytes"}
                # before the first step the plan is of the later steps, which prefetch along the recorded gather order
                first = ({"mem/peak_gathered_bytes", "comm/gather_bytes", "mem/peak_bytes"}
                         if i == 0 and "ahead" in name else set())
                assert set(off) <= (skip_only if m["skipped"] else set()) | first, (name, [(k, plan[k], m[k])
                                                                                          for k in off])
        out[name] = (rows, {n: t.numpy().tobytes() for n, t in fs.full_params(state).items()}, int(state.skipped))
    # the same run in two halves, the second by a new step function on the first's state, with donate=True
    state = fs.init(copy.deepcopy(model), mesh, fs.adamw(**HP, impl="torch"))
    rows = []
    first = batches[:5]  # split where the growth tracker is 1, so dropping it would show
    for half in (first, batches[5:8]):
        with fs.compose(loss_fn, fp16(), donate=half is not first) as step:
            for b in half:
                state, m = step(state, b)
                rows.append((m["loss"], m["loss_scale"], m["skipped"]))
    out["fp16 resumed+donate"] = (rows, {n: t.numpy().tobytes() for n, t in fs.full_params(state).items()},
                                  int(state.skipped))
    return out


def test_fp16_composes_and_its_scale_survives_a_new_step_function():
    for out in run_ranks(_composed, 2):
        base = out["fp16"]
        assert sum(r[2] for r in base[0]) >= 2 and base[2] == sum(r[2] for r in base[0])  # overflows were skipped
        assert len({r[1] for r in base[0]}) >= 2  # and the scale moved
        for name in ("fp16+ahead+buckets", "fp16+offload", "fp16 resumed+donate"):
            assert out[name] == base, name
        for name, (rows, _, skipped) in out.items():
            assert all(r[0] == r[0] for r in rows) and rows[-1][0] < rows[0][0], name  # finite, and training
        assert {r[1] for r in out["fp16 static"][0]} == {1024.0}


def test_print_state_shows_master_and_compute_dtypes_and_the_scale():
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn
    mesh = fs.Mesh.local()
    state = fs.init(GPT(GPTConfig.tiny(n_layers=1)), mesh, fs.adamw())
    assert "float32   float32" in repr(state)  # master, compute: fp32 without mixed precision
    with fs.compose(loss_fn, fs.mixed_precision(torch.float16)) as step:
        text = repr(step.init(state))
    assert "master   compute" in text and "float32   float16" in text
    assert "LossScaleState(scale=65536, growth_tracker=0)" in text
    assert state.transform_state == {}  # step.init makes a new state; the input has no transform state


def test_loss_scaling_misuse_is_named():
    import fshard as fs
    from gpt import loss_fn
    with pytest.raises(fs.errors.TransformConflictError, match="both scale the loss"):
        fs.compose(loss_fn, fs.mixed_precision(torch.float16), fs.mixed_precision(torch.float16))
    for bad in (dict(loss_scale="yes"), dict(init_scale=0.0), dict(growth_factor=0.5), dict(growth_interval=0)):
        with pytest.raises((fs.ArgumentError, fs.ArgumentTypeError)):
            fs.mixed_precision(torch.float16, **bad)
    assert fs.mixed_precision(torch.bfloat16).scaling is None  # bf16 needs no loss scale ("auto")
    assert fs.mixed_precision(torch.bfloat16, loss_scale="dynamic").scaling.dynamic


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(1, 5),
       st.sampled_from([2.0, 3.0, 1.5]), st.sampled_from([0.5, 0.25, 0.75]), st.sampled_from([1.0, 2.0 ** 16, 3e38]))
def test_scale_rules_equal_torch_amp_update_scale(found, interval, growth, backoff, init):
    """The rules (``LossScaling.next``) against torch's own kernel, ``torch._amp_update_scale_``, on any sequence
    of overflows, including a scale that would grow past fp32's range (it then stays)."""
    from fshard.transforms._loss_scale import LossScaleState, LossScaling
    rules, ours = LossScaling(init, growth, backoff, interval), LossScaleState.initial(init)
    scale, tracker = torch.full((1,), init, dtype=torch.float32), torch.zeros(1, dtype=torch.int32)
    for f in found:
        ours = rules.next(ours, f)
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(f)), growth, backoff, interval)
        assert float(ours.scale) == float(scale) and int(ours.growth_tracker) == int(tracker)


def test_clipping_a_float64_model():
    """The global norm of float64 shards (which fshard.ops.sq_norm does not take) comes from torch's float64 norm."""
    import fshard as fs
    from models import awkward_batches, awkward_loss, Awkward
    torch.manual_seed(0)
    state = fs.init(Awkward().double(), fs.Mesh.local(), fs.adamw())
    with fs.compose(awkward_loss, fs.clip_by_global_norm(0.1), fs.skip_nonfinite()) as step:
        state, m = step(state, next(awkward_batches(2, 1)))
    assert m["grad_norm"] > 0.1 and m["grad_clip_scale"] < 1.0 and m["skipped"] == 0
