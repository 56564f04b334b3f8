"""TrainState as a value: immutable, inspectable, an optree pytree; donation; init paths."""
from __future__ import annotations

import copy

import optree
import pytest
import torch

import fshard as fs
import fshard.testing as ft
from gpt import GPT, GPTConfig, init_weights, loss_fn, synthetic_batches
from models import Awkward, awkward_batches, awkward_loss


def _state(model=None, n=1, rank=0, **kw):
    model = model if model is not None else Awkward()
    return fs.init(model, fs.Mesh(rank, n, "local", torch.device("cpu")), fs.adamw(impl="torch"), **kw)


def test_fields_cannot_be_assigned():
    state = _state()
    with pytest.raises(fs.errors.FrozenStateError, match=r"state\.replace\(params=\.\.\.\)"):
        state.params = {}
    with pytest.raises(fs.errors.FrozenStateError):
        state.opt_state["<root>"].exp_avg = None
    with pytest.raises(AttributeError):  # FrozenInstanceError is an AttributeError, as for dataclasses
        del state.step
    assert state.replace(step=torch.tensor(5)).step == 5 and state.step == 0


def test_is_an_optree_pytree_in_the_fshard_namespace():
    state = _state()
    leaves, spec = optree.tree_flatten(state, namespace="fshard")
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    paths = [".".join(map(str, p)) for p in optree.tree_paths(state, namespace="fshard")]
    assert "params.<root>" in paths and "opt_state.blocks.0.exp_avg" in paths and "buffers.shift" in paths
    back = optree.tree_unflatten(spec, leaves)
    assert isinstance(back, fs.TrainState) and back.spec is state.spec


def test_print_shows_units_shard_sizes_and_bytes_per_rank():
    text = repr(_state(n=3, rank=1))
    for unit in ("<root>", "blocks.0", "blocks.1", "blocks.2"):
        assert unit in text
    assert "rank 1/3" in text and "bytes/rank" in text and "per rank: params" in text


def test_layout_metadata_is_explicit():
    state = _state(n=2)
    root = state.spec.unit("<root>")
    emb = next(s for s in root.slots if s.name == "emb.weight")
    assert emb.aliases == ("emb.weight", "head.weight") and emb.shape == (13, 8) and emb.requires_grad
    frozen = next(s for s in root.slots if s.name == "frozen")
    assert not frozen.requires_grad and frozen.offset >= root.trainable_numel  # frozen: no optimizer state
    assert state.params["<root>"].numel() == root.numel // 2
    assert state.opt_state["<root>"].exp_avg.numel() == root.opt_numel(0)


def test_tied_parameter_is_stored_once():
    state = _state()
    names = [s.name for u in state.spec.units for s in u.slots]
    assert "emb.weight" in names and "head.weight" not in names
    assert len(names) == len({s for s in names})


def test_donated_step_updates_in_place_and_refuses_reuse():
    state = _state()
    batch = next(awkward_batches(2, 1))
    ref, _ = fs.compose(awkward_loss)(state, batch)
    donated, _ = fs.compose(awkward_loss, donate=True)(state, batch)
    assert torch.equal(donated.params["<root>"], ref.params["<root>"])
    assert donated.params["<root>"] is state.params["<root>"]  # updated in place: no copy
    with pytest.raises(fs.errors.DonatedStateError, match="donated"):
        fs.compose(awkward_loss)(state, batch)
    with pytest.raises(fs.errors.DonatedStateError):
        fs.full_params(state)


def test_meta_init_materialises_unit_by_unit_and_does_not_depend_on_world_size():
    cfg = GPTConfig.tiny()
    with torch.device("meta"):
        model = GPT(cfg)
    fulls = []
    for n in (1, 2, 3):
        shards = [_state(model, n, r, seed=7).params for r in range(n)]
        fulls.append({u: torch.cat([s[u] for s in shards]) for u in shards[0]})
    for u in fulls[0]:
        used = _state(model, 1, 0).spec.unit(u).used_numel
        assert torch.equal(fulls[0][u][:used], fulls[1][u][:used]) and torch.equal(fulls[0][u][:used], fulls[2][u][:used])
    # GPT-2 init: weights ~ N(0, 0.02), LayerNorm ones, biases zero; and units differ (per-unit seeds)
    state = _state(model, seed=7)
    full = fs.full_params(state)
    assert 0.015 < full["blocks.0.mlp.fc.weight"].std() < 0.025
    assert torch.equal(full["blocks.0.ln1.weight"], torch.ones(cfg.dim))
    assert not torch.equal(full["blocks.0.mlp.fc.weight"], full["blocks.1.mlp.fc.weight"])
    assert all(p.device.type == "cpu" for p in full.values())
    # init_fn gives the same weights as reset_parameters for this model
    via_fn = fs.full_params(_state(model, seed=7, init_fn=init_weights))
    assert all(torch.equal(via_fn[k], full[k]) for k in full)


def test_meta_model_trains():
    cfg = GPTConfig.tiny()
    with torch.device("meta"):
        model = GPT(cfg)
    state = _state(model)
    step = fs.compose(loss_fn)
    losses = []
    for batch in synthetic_batches(cfg, 4, 15, seed=1):
        state, m = step(state, batch)
        losses.append(m["loss"])
    assert losses[-1] < losses[0] - 0.1


def test_units_can_be_chosen():
    model = GPT(GPTConfig.tiny())
    state = _state(model, units=["blocks.0.attn", "blocks.1"])
    assert [u.name for u in state.spec.units] == ["<root>", "blocks.0.attn", "blocks.1"]
    state2, m = fs.compose(loss_fn)(state, next(synthetic_batches(GPTConfig.tiny(), 2, 1)))
    assert m["loss"] > 0


def test_cpu_model_is_not_modified_by_init():
    model = Awkward()
    before = copy.deepcopy(model.state_dict())
    state = _state(model)
    fs.compose(awkward_loss)(state, next(awkward_batches(2, 1)))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_template_has_no_data_and_cannot_be_called_outside_a_step():
    state = _state()
    assert all(p.device.type == "meta" for p in state.spec.template.parameters())
    with pytest.raises(fs.errors.TemplateCallError, match="outside a step"):
        state.spec.template.blocks[0](torch.zeros(1, 8))


def test_memory_bound_on_the_gpt_at_every_rank():
    model = GPT(GPTConfig.tiny())
    for n in (1, 2, 3, 4):
        for r in range(n):
            ft.check_memory_bound(_state(model, n, r))


def test_peak_gathered_bytes_during_a_blocking_step_is_at_most_two_units():
    for model, loss, batch in ((Awkward(), awkward_loss, next(awkward_batches(2, 1))),
                               (GPT(GPTConfig.tiny()), loss_fn, next(synthetic_batches(GPTConfig.tiny(), 2, 1)))):
        state = _state(model)
        _, m = fs.compose(loss)(state, batch)
        sizes = sorted((u.nbytes for u in state.spec.units), reverse=True)
        assert 0 < m["mem/peak_gathered_bytes"] <= sizes[0] + sizes[1]


def test_default_adamw_runs_the_native_kernel_and_says_so():
    import fshard.ops as ops
    state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw())
    before = ops.metrics()
    _, m = fs.compose(awkward_loss)(state, next(awkward_batches(2, 1)))
    after = ops.metrics()
    if ops.native_available():
        assert m["optim/impl"] == "native" and after["native_calls"] > before["native_calls"]
    else:  # no compiler: torch's fused kernel, and the metrics say so
        assert m["optim/impl"] == "fused" and after["native_calls"] == before["native_calls"]


def test_a_finished_step_leaves_nothing_for_the_cycle_collector():
    import gc

    from fshard.run._run import StepRun
    from fshard.run._unit import UnitRun
    state = _state()
    step = fs.compose(awkward_loss)
    gc.collect()
    # runtimes of earlier tests can outlive them in kept tracebacks (closed and empty); count only this test's
    earlier = {id(o) for o in gc.get_objects() if type(o) in (StepRun, UnitRun)}
    gc.disable()
    try:
        for batch in awkward_batches(2, 3):
            state, _ = step(state, batch)
        live = [o for o in gc.get_objects() if type(o) in (StepRun, UnitRun) and id(o) not in earlier]
    finally:
        gc.enable()
    assert live == [], f"{len(live)} step runtimes still alive: they hold gathered buffers and gradient shards"
