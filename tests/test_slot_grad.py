"""A one-rank unit's gradient kept per slot (fshard/state/_slot_grad.py): the same values as split's concatenated
gradient, read through slices without assembling it, and never handed to a native kernel as memory it lacks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fshard.testing as ft
from fshard.errors import ArgumentTypeError
from fshard.state._flat import flatten, views
from fshard.state._slot_grad import SlotGrad, slot_views


def _grads_both_ways(tree, data):
    """The unit's flat gradient through split's backward and through SlotViews', for a loss that uses a drawn
    subset of the slots (some twice, some not at all)."""
    layout = ft.layout_of({n: t.float() for n, t in tree.items()}, 1)
    flat = flatten(layout, {n: t.float() for n, t in tree.items()})
    uses = {s.name: data.draw(st.integers(0, 2), label=f"uses of {s.name}") for s in layout.slots}
    out = []
    for make in (views, slot_views):
        leaf = flat.clone().requires_grad_()
        vs = make(leaf, layout)
        loss = sum((vs[n] * (k + 1.5)).sum() for n, k in uses.items() for _ in range(k))
        # (the gradient autograd hands the leaf, not accumulated into .grad: a SlotGrad for SlotViews)
        out.append(torch.autograd.grad(loss, leaf)[0] if isinstance(loss, torch.Tensor) else None)
    return layout, uses, out


@given(ft.param_trees(dtype=torch.float32), st.data())
def test_a_slot_gradient_holds_the_values_of_splits_concatenated_one(tree, data):
    layout, uses, (want, got) = _grads_both_ways(tree, data)
    if want is None:
        assert got is None
        return
    assert isinstance(got, SlotGrad) and got._flat is None  # nothing assembled it
    n = layout.numel
    lo = data.draw(st.integers(0, n), label="lo")
    hi = data.draw(st.integers(lo, n), label="hi")
    parts = got.parts(lo, hi)  # (before anything assembles it)
    assert [a for a, _, _ in parts][:1] == ([lo] if lo < hi else [])
    assert all(b == a2 for (_, b, _), (a2, _, _) in zip(parts, parts[1:]))  # they tile [lo, hi) in order
    assert (parts[-1][1] if parts else lo) == (hi if lo < hi else lo)
    for a, b, t in parts:
        assert type(t) is torch.Tensor and t.numel() == b - a
        assert torch.equal(t, want[a:b])
    sliced = got[lo:hi]
    assert torch.equal(sliced.reshape(-1) if sliced.numel() else sliced, want[lo:hi])
    assert torch.equal(got.flat(), want)  # every element, padding and unused slots zero
    assert torch.equal(got * 2, want * 2) and float(got.sum()) == float(want.sum())


def test_a_slice_within_a_slot_is_a_view_of_its_gradient_and_in_place_ops_write_the_assembled_one():
    tree = {"a": torch.randn(3, 5), "b": torch.randn(7)}
    layout = ft.layout_of(tree, 1)
    g = {0: torch.randn(3, 5), 1: torch.randn(7)}
    sg = SlotGrad(layout, dict(g), torch.float32, torch.device("cpu"))
    b = layout.slots[1]
    view = sg[b.offset:b.offset + 7]
    assert view.data_ptr() == g[1].data_ptr()  # no copy
    assert type(sg.detach()) is SlotGrad and type(sg.view_as(sg)) is SlotGrad  # autograd's same-shape views
    low = SlotGrad(layout, {0: g[0].bfloat16()}, torch.bfloat16, torch.device("cpu"))
    wide = low.to(torch.float32)  # mixed precision's cast to the reduce dtype: slot by slot
    assert type(wide) is SlotGrad and wide._flat is None and low._flat is None
    assert torch.equal(wide.flat(), low.flat().float())
    sg.mul_(2.0)  # assembles, then every later read sees the assembled tensor
    assert torch.equal(sg[b.offset:b.offset + 7], g[1] * 2) and torch.equal(g[1] * 2, view * 2)
    assert sg.parts(0, 4)[0][2].data_ptr() == sg.flat().data_ptr()


def test_native_kernels_read_a_slot_gradient_through_torch_and_refuse_one_to_write_into():
    ops = pytest.importorskip("fshard.ops")
    tree = {"a": torch.randn(40), "b": torch.randn(9)}
    layout = ft.layout_of(tree, 1)
    sg = SlotGrad(layout, {0: torch.randn(40), 1: torch.randn(9)}, torch.float32, torch.device("cpu"))
    assert ops.sq_norm(sg) == ops.sq_norm(sg.flat().clone())
    p, m, v = (torch.zeros(layout.numel) for _ in range(3))
    p2, m2, v2 = (torch.zeros(layout.numel) for _ in range(3))
    hp = dict(step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    ops.adamw_(p, sg, m, v, **hp)
    ops.adamw_(p2, sg.flat().clone(), m2, v2, **hp)
    assert torch.equal(p, p2) and torch.equal(m, m2) and torch.equal(v, v2)
    with pytest.raises(ArgumentTypeError, match="holds no memory of its own"):
        ops.adamw_(SlotGrad(layout, {}, torch.float32, torch.device("cpu")), sg, m, v, **hp)


@pytest.mark.parametrize("make", [
    lambda fs: fs.adamw(lr=1e-2, weight_decay=0.1), lambda fs: fs.optim.adam(lr=1e-2, weight_decay=0.1),
    lambda fs: fs.optim.sgd(lr=1e-2, momentum=0.9, weight_decay=0.1), lambda fs: fs.optim.adagrad(lr=1e-2),
    lambda fs: fs.optim.rmsprop(lr=1e-2, momentum=0.5), lambda fs: fs.optim.lion(lr=1e-3, weight_decay=0.1),
    lambda fs: fs.optim.from_torch(torch.optim.NAdam, lr=1e-2, weight_decay=0.1)],
    ids=["adamw", "adam", "sgd", "adagrad", "rmsprop", "lion", "from_torch"])
def test_a_one_rank_update_through_slot_gradients_is_bitwise_the_flat_ones_and_leaves_padding_zero(make, monkeypatch):
    """The update reads each parameter's gradient where autograd left it and skips the padding between parameters;
    split's flat gradient gives the same bits (within an ulp for torch's fused kernels, whose runs are then cut
    where torch cuts them, at each parameter), and every padding element stays zero."""
    import fshard as fs
    from models import oracle_model
    from fshard.run import _unit

    def run(slots: bool):
        model, loss_fn, batches = oracle_model("awkward", 3)
        state = fs.init(model, fs.Mesh.local(), make(fs))
        if not slots:  # the same step with split's flat gradient
            monkeypatch.setattr(_unit, "slot_views", _split_views)
        with fs.compose(loss_fn) as step:
            for b in batches(0, 1):
                state, _ = step(state, b)
        monkeypatch.undo()
        return state

    a, b = run(True), run(False)
    fused = "fused" in a.spec.optimizer.resolved_impl(torch.device("cpu"))
    for u in a.spec.units:
        pad = torch.ones(u.numel, dtype=torch.bool)
        for s in u.slots:
            pad[s.offset:s.offset + s.numel] = False
        for x, y in [(a.params[u.name], b.params[u.name])] + list(zip(a.opt_state[u.name].rows,
                                                                      b.opt_state[u.name].rows)):
            if fused:  # torch's fused kernels round a run's vector body and its scalar tail apart (an FMA or not):
                # per parameter, as torch runs them on .grad, the tail moves by an ulp from the padded run's
                assert torch.allclose(x, y, rtol=1e-6, atol=1e-7), u.name
            else:
                assert torch.equal(x, y), u.name
            n = min(x.numel(), u.numel)
            assert not x[:n][pad[:n]].any(), u.name  # (rows cover the trainable prefix)


def _split_views(flat, layout, got=None):
    """``slot_views``' stand-in with split's flat gradient (its backward ``cat``s the slots'), telling ``got`` of
    each slot's gradient through a hook on its view, as SlotViews' backward tells it."""
    out = views(flat, layout)
    for i, s in enumerate(layout.slots):
        v = out[s.name]
        if got is not None and v.requires_grad:
            v.register_hook(lambda g, i=i: None if g is None else got({i: g}))
    return out


def _bucketed(slots: bool, low: bool):
    """Three steps of the awkward model with gather_ahead + bucket_reduce (bf16 compute with fp32 reduces where
    ``low``), the unit gradients per slot or through split's ``cat``; returns the params and the units whose
    flat gradient was assembled."""
    import fshard as fs
    from models import oracle_model
    from fshard.run import _unit

    assembled, flat = [], SlotGrad.flat
    if slots:
        SlotGrad.flat = lambda self: (assembled.append(self._layout.name), flat(self))[1]
    else:  # (a forked rank of its own: nothing to undo)
        _unit.slot_views = _split_views
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = oracle_model("awkward", 3)
    state = fs.init(model, mesh, fs.adamw(lr=1e-2, weight_decay=0.1))
    low = [fs.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32)] if low else []
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(0.0005), *low) as step:
        for b in batches(mesh.rank, mesh.world_size):
            state, _ = step(state, b)
    return {u: t.numpy().copy() for u, t in state.params.items()}, sorted(set(assembled))  # (pickled, not shared)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("low", [False, True], ids=["fp32", "bf16"])
def test_bucket_reduce_copies_slot_gradients_into_its_buckets_bitwise_and_never_assembles_them(world_size, low):
    """At N > 1 bucket_reduce (``per_slot``) takes each unit's gradient per slot and copies the slots into their
    buckets' pieces (zeros between them): the same bits as split's ``cat`` then a copy, and no flat gradient is
    assembled except for blocks.0, which the model applies twice (autograd adds its two uses' gradients)."""
    from _dist import run_ranks
    ours = run_ranks(_bucketed, world_size, True, low)
    theirs = run_ranks(_bucketed, world_size, False, low)
    for (a, assembled), (b, _) in zip(ours, theirs):
        assert a.keys() == b.keys() and all((a[u].view("u1") == b[u].view("u1")).all() for u in a)  # bitwise
        assert assembled == ["blocks.0"], assembled
