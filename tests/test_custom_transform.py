"""examples/custom_transform.py: a grads-stage transform written against the public protocol, at world sizes 1 and 2.

The example is at most 30 lines with public names only (issue #39). Its per-unit gradient norms match a plain torch
model's full gradients on the same global batch; composing it changes nothing else, bitwise; it composes with
clip_by_global_norm and skip_nonfinite in any order; under fp16 loss scaling its norms are of the unscaled gradients
(``Grads.loss_scale``); and, since it declares ``changes_grads = False``, offload_state still begins updates during
backward."""
from __future__ import annotations

import ast
import copy
import math
import os

import pytest
import torch

from _dist import run_ranks

STEPS = 3
HP = dict(lr=3e-3, weight_decay=0.1)


def _build(name, n):
    """model, loss_fn, this rank's batches (rank -> iterator), and the global batches (the ranks' rows, in order)."""
    torch.manual_seed(0)
    if name == "gpt":
        from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
        cfg = GPTConfig.tiny()
        return (GPT(cfg), loss_fn, lambda r: synthetic_batches(cfg, 2, STEPS, seed=5, rank=r, world_size=n),
                synthetic_batches(cfg, 2 * n, STEPS, seed=5))
    from models import Awkward, awkward_batches, awkward_loss
    return (Awkward(), awkward_loss, lambda r: awkward_batches(2, STEPS, rank=r, world_size=n),
            awkward_batches(2 * n, STEPS))


def _unit_norms(metrics):
    return {k.removeprefix("grad_norm/"): v for k, v in metrics.items() if k.startswith("grad_norm/")}


def _against_reference(name, mesh, transforms):
    """Per step: the transform's norms, and each unit's norm of a torch copy's gradients on the global batch."""
    import fshard as fs
    from custom_transform import unit_grad_norms
    model, loss_fn, batches, global_batches = _build(name, mesh.world_size)
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters(remove_duplicate=False))  # tied names -> the same Parameter
    state = fs.init(model, mesh, fs.adamw(**HP))
    got, want = [], []
    with fs.compose(loss_fn, *transforms, unit_grad_norms()) as step:
        for batch, global_batch in zip(batches(mesh.rank), global_batches):
            with torch.no_grad():
                for n, p in fs.full_params(state).items():  # the reference sees the state's current parameters
                    params[n].copy_(p)
            ref.zero_grad(set_to_none=True)
            loss_fn(ref, global_batch).backward()  # the mean over the global batch: DDP's average over ranks
            grads = {u.name: [params[s.name].grad for s in u.slots if params[s.name].grad is not None]
                     for u in state.spec.units}
            want.append({u: math.sqrt(sum(float(g.double().square().sum()) for g in gs))
                         for u, gs in grads.items() if gs})  # a unit nothing reached has no gradient, no metric
            state, m = step(state, batch)
            got.append(_unit_norms(m))
    return got, want


def _train(mesh, transforms, name="awkward"):
    """Losses, full parameters (as bytes) and the last metrics after STEPS steps."""
    import fshard as fs
    model, loss_fn, batches, _ = _build(name, mesh.world_size)
    state = fs.init(model, mesh, fs.adamw(**HP))
    losses = []
    with fs.compose(loss_fn, *transforms) as step:
        for batch in batches(mesh.rank):
            state, m = step(state, batch)
            losses.append(m["loss"])
    return losses, {n: p.numpy().tobytes() for n, p in fs.full_params(state).items()}, m


def _on_rank(directory):
    import fshard as fs
    from custom_transform import unit_grad_norms as ugn
    mesh = fs.Mesh.from_env()
    base = lambda: (fs.gather_ahead(2), fs.bucket_reduce(0.001))  # noqa: E731 - a fresh set per step function
    out = {"reference": {"awkward/blocking": _against_reference("awkward", mesh, ()),
                         "awkward/bucketed": _against_reference("awkward", mesh, base()),
                         "gpt/bucketed": _against_reference("gpt", mesh, base())}}
    clip, skip = lambda: fs.clip_by_global_norm(0.5), fs.skip_nonfinite  # noqa: E731 - 0.5: it does clip
    compositions = {  # label -> (without the transform, with it)
        "plain": (base(), (*base(), ugn())),
        "ugn,clip,skip": ((*base(), clip(), skip()), (*base(), ugn(), clip(), skip())),
        "clip,ugn,skip": ((*base(), clip(), skip()), (*base(), clip(), ugn(), skip())),
        "clip,skip,ugn": ((*base(), clip(), skip()), (*base(), clip(), skip(), ugn())),
    }
    out["compose"] = {label: (_train(mesh, without), _train(mesh, with_))
                      for label, (without, with_) in compositions.items()}
    fp16 = (fs.mixed_precision(torch.float16, init_scale=1024.0), fs.clip_by_global_norm(1e9), ugn())
    out["fp16"] = _train(mesh, fp16)[2]  # clip's grad_norm is of the unscaled gradients
    with fs.NVMeStore(f"{directory}/r{mesh.rank}") as store:
        ts = (fs.bucket_reduce(0.001), ugn(), fs.offload_state(store, chunk_mb=0.01, overlap_backward=True))
        out["offload"] = _train(mesh, ts, name="gpt")[2]
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request, tmp_path_factory):
    """What each rank returned; one run of everything per world size (spawning ranks costs more than the steps)."""
    n, directory = request.param, str(tmp_path_factory.mktemp("nvme"))
    return run_ranks(_on_rank, n, directory) if n > 1 else [_on_rank(directory)]


@pytest.mark.parametrize("case", ["awkward/blocking", "awkward/bucketed", "gpt/bucketed"])
def test_unit_norms_match_the_full_gradients_of_a_torch_copy(results, case):
    for rank, r in enumerate(results):
        got, want = r["reference"][case]
        assert len(got) == STEPS
        for s, (g, w) in enumerate(zip(got, want)):
            assert w.keys() <= g.keys(), f"rank {rank} step {s}: units {sorted(g)} vs {sorted(w)}"
            for u in w:
                assert abs(g[u] - w[u]) <= 1e-6 * w[u], f"{case} rank {rank} step {s} {u}: {g[u]} vs {w[u]}"
            # a unit no gradient reached: no shard from the blocking reduce, a zero one from bucket_reduce
            assert {u: v for u, v in g.items() if u not in w} == ({"blocks.2": 0.0} if case == "awkward/bucketed"
                                                                 else {}), f"{case} rank {rank} step {s}"
        assert got == results[0]["reference"][case][0]  # every rank reports the same norms, bitwise


@pytest.mark.parametrize("label", ["plain", "ugn,clip,skip", "clip,ugn,skip", "clip,skip,ugn"])
def test_composing_it_changes_nothing_else(results, label):
    for r in results:
        (losses0, params0, m0), (losses1, params1, m1) = r["compose"][label]
        assert losses1 == losses0
        assert params1 == params0  # bitwise, every parameter
        assert set(m1) - set(m0) == {f"grad_norm/{u}" for u in _unit_norms(m1)} and _unit_norms(m1)
        assert set(m0) <= set(m1)


def test_composes_with_clip_and_skip_in_either_order(results):
    for r in results:
        norms = {label: _unit_norms(r["compose"][label][1][2]) for label in ("ugn,clip,skip", "clip,skip,ugn")}
        norms["clip,ugn,skip"] = _unit_norms(r["compose"]["clip,ugn,skip"][1][2])
        # before or after clip, the norms are of the unclipped shards (clip only sets the update's scale)
        assert norms["ugn,clip,skip"] == norms["clip,ugn,skip"] == norms["clip,skip,ugn"]
        for label, u in norms.items():
            m = r["compose"][label][1][2]
            assert m["grad_clip_scale"] < 1.0 and m["skipped"] == 0, label  # clip did clip; nothing skipped
            # grad_norm is clip_grad_norm_'s, in fp32 arithmetic (fshard/transforms/_clip.py): two ulps of the float64 norm
            assert math.isclose(math.hypot(*u.values()), m["grad_norm"], rel_tol=3e-7), label


def test_offload_still_begins_updates_during_backward(results):
    for r in results:
        m = r["offload"]
        assert _unit_norms(m)
        assert m["update/overlapped_units"] > 0  # changes_grads = False kept the grads stage "unchanged"


def test_unit_norms_are_of_the_unscaled_gradients_under_fp16_loss_scaling(results):
    for r in results:
        m = r["fp16"]
        assert m["loss_scale"] == 1024.0 and m["skipped"] == 0 and _unit_norms(m)
        assert math.isclose(math.hypot(*_unit_norms(m).values()), m["grad_norm"], rel_tol=3e-7), m


def test_the_example_is_30_lines_of_public_names():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "custom_transform.py")
    text = open(path).read()
    assert len(text.splitlines()) <= 30
    tree = ast.parse(text)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert imported == {"torch", "fshard", "GPT", "GPTConfig", "loss_fn", "synthetic_batches"}, imported
    names = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    assert not [a for a in names if a.startswith("_")], names  # no private attribute of anything
    import fshard as fs
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "fs"}
    assert used <= set(fs.__all__), used - set(fs.__all__)
