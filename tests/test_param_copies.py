"""fs.mixed_precision(param_copies=True): persistent low-precision copies, written by the update's kernel pass.

A gather then sends the state's copy instead of casting the master shard. The copy is the cast of the shard
(round to nearest, as the cast way's gather rounds), so every result equals the cast way's bit for bit: losses,
parameters, scales, skipped steps. The invariant ``copies[u] == params[u].to(param_dtype)`` holds after every
step, also for frozen and unused parameters (never updated: the copy made once stays right), tied ones, updates
begun during backward (offload_state's early updates), skipped fp16 steps, and with and without donate.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_ranks
from models import Awkward, awkward_batches, awkward_loss

STEPS = 6
HP = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _configs(fs):
    bf16 = lambda copies: fs.mixed_precision(param_copies=copies)  # noqa: E731
    fp16 = lambda copies: fs.mixed_precision(torch.float16, growth_interval=2, param_copies=copies)  # noqa: E731
    return {  # name -> (impl, donate, transforms(copies))
        "bf16 native": ("auto", False, lambda c: (bf16(c),)),
        "bf16 ahead+buckets+donate": ("torch", True, lambda c: (fs.gather_ahead(1), fs.bucket_reduce(0.0005),
                                                                bf16(c))),
        "bf16 offload early": ("auto", False, lambda c: (bf16(c), fs.offload_state(
            fs.CPUStore(), chunk_mb=0.0002, overlap_backward=True))),
        "bf16 offload+donate": ("auto", True, lambda c: (bf16(c), fs.offload_state(fs.CPUStore(), chunk_mb=0.0002))),
        "bf16 accumulate+clip": ("auto", False, lambda c: (fs.accumulate(2), bf16(c), fs.clip_by_global_norm(0.5))),
        "fp16 loss scale": ("auto", False, lambda c: (fp16(c),)),
    }


def _run(name: str):
    import fshard as fs
    import fshard.testing as ft
    mesh = fs.Mesh.from_env()
    impl, donate, ts = _configs(fs)[name]
    torch.manual_seed(0)
    model = Awkward()
    batches = list(awkward_batches(2, STEPS, mesh.rank, mesh.world_size))
    out = {}
    for copies in (False, True):
        state = fs.init(copy.deepcopy(model), mesh, fs.adamw(**HP, impl=impl))
        rows, held = [], []
        with fs.compose(awkward_loss, *ts(copies), donate=donate, timeline=True) as step:
            for i, b in enumerate(batches):
                b = [b, b] if "accumulate" in name else b
                plan = step.plan(state, b)
                before, snap = state, None if donate else ft.snapshot(state)
                state, m = step(state, b)
                if snap is not None:
                    ft.check_unchanged(before, snap)  # the input's copies too
                rows.append((m["loss"], m.get("loss_scale"), m.get("skipped", 0)))
                # the plan (from the second step: before any, it assumes every unit gets a gradient, and blocks.2
                # never does) counts the copies as the step measures them
                off = [k for k in plan.figures if i and abs(plan[k] - m[k]) > 0.05 * max(plan[k], m[k])]
                skip_only = {"mem/new_state_bytes", "mem/peak_bytes"}
                assert set(off) <= (skip_only if m.get("skipped") else set()), [(k, plan[k], m[k]) for k in off]
                dtype = state.transform_state["mixed_precision"].param_dtype
                held.append((sorted(state.copies), all(torch.equal(c, state.params[n].to(dtype))
                                                       for n, c in state.copies.items()),
                             m["mem/copies_bytes"], state.nbytes()["copies"],
                             sum(lane == "cast" for lane, *_ in m["trace/timeline"])))  # gathers that cast
        full = {n: t.numpy().tobytes() for n, t in fs.full_params(state).items()}
        out[copies] = (rows, full, held, int(state.skipped), [u.name for u in state.spec.units])
    return out


@pytest.mark.parametrize("name", ["bf16 native", "bf16 ahead+buckets+donate", "bf16 offload early",
                                  "bf16 offload+donate", "bf16 accumulate+clip", "fp16 loss scale"])
def test_copies_give_the_cast_ways_results_bitwise(name):
    for out in run_ranks(_run, 2, name):
        (rows, full, held, skipped, units), (crows, cfull, cheld, cskipped, _) = out[False], out[True]
        assert crows == rows and cfull == full and cskipped == skipped  # the same run, bit for bit
        assert all(r[0] == r[0] for r in rows) and rows[-1][0] < rows[0][0]  # finite, and training
        assert skipped >= 1 if name.startswith("fp16") else skipped == 0  # fp16: overflows skipped, copies kept
        assert all(h[:4] == ([], True, 0, 0) and h[4] > 0 for h in held)  # the cast way keeps none, and casts
        for names, equal, measured, nbytes, casts in cheld:
            assert names == sorted(units) and equal  # every unit (frozen, unused ones too), = cast of the shard
            assert measured == nbytes > 0 and casts == 0  # gathers send the copies


def _misuse():
    import fshard as fs
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = Awkward()
    b = next(awkward_batches(2, 1))
    found = {}

    class Three(fs.protocol.UpdatePolicy):  # an update policy of the old protocol: no copies returned
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, step, state, grads, active, donate):
            return self.inner(step, state, grads, active, donate)[:3]

    class Stale(Three):  # returns the input's copies: gathers would read the old weights
        def __call__(self, step, state, grads, active, donate):
            params, opt_state, m, _ = self.inner(step, state, grads, active, donate)
            return params, opt_state, m, {}

    for policy in (Three, Stale):
        class wrap(fs.Transform):
            name, stages = "wrap", {"update": "wrap"}

            def wrap_update(self, update, policy=policy):
                return policy(update)
        state = fs.init(copy.deepcopy(model), mesh, fs.adamw())
        try:
            fs.compose(awkward_loss, fs.mixed_precision(param_copies=True), wrap())(state, b)
        except fs.errors.PolicyError as e:
            found[policy.__name__] = str(e)
    # a state with copies, stepped without them: the copies are dropped, not left to go stale
    state = fs.init(copy.deepcopy(model), mesh, fs.adamw())
    state, _ = fs.compose(awkward_loss, fs.mixed_precision(param_copies=True))(state, b)
    text = repr(state)
    with_copies = sorted(state.copies)
    state, _ = fs.compose(awkward_loss)(state, b)
    try:
        fs.mixed_precision(param_copies="yes")
    except fs.ArgumentTypeError as e:
        found["arg"] = str(e)
    return found, text, with_copies, dict(state.copies)


def test_update_policies_must_keep_the_copies_and_print_shows_them():
    found, text, with_copies, after = _misuse()
    assert "returned tuple of 3" in found["Three"] and "(params, opt_state, metrics, copies)" in found["Three"]
    assert "wrong or missing" in found["Stale"]
    assert "param_copies" in found["arg"]
    assert "bfloat16 copies" in text and with_copies and after == {}
