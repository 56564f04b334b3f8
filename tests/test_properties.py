"""Sharding invariants, property-tested in one process (no communication needed)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard as fs
import fshard.testing as ft
from fshard.state._flat import flatten, shard, unshard


@given(ft.param_trees(), ft.world_sizes())
def test_unshard_of_shard_is_identity(tree, n):
    ft.check_roundtrip(tree, n)


@given(ft.param_trees(), ft.world_sizes(), st.data())
def test_shards_tile_the_flat_buffer_and_padding_is_zero(tree, n, data):
    frozen = data.draw(st.sets(st.sampled_from(sorted(tree))))
    layout = ft.layout_of(tree, n, frozen)
    flat = flatten(layout, tree)
    ft.check_tiling(layout, flat)
    assert all(shard(layout, tree, r).numel() == layout.shard_numel for r in range(n))
    # trainable parameters form a prefix, so optimizer state is a prefix of each shard
    assert all(s.offset + s.numel <= layout.trainable_numel for s in layout.trainable)
    assert all(s.offset >= layout.trainable_numel for s in layout.slots if not s.requires_grad)
    assert sum(layout.opt_numel(r) for r in range(n)) == layout.trainable_numel


@given(ft.param_trees(dtype=torch.float32), ft.world_sizes())
def test_shards_own_their_memory(tree, n):
    layout = ft.layout_of(tree, n)
    want = flatten(layout, tree)
    shards = [shard(layout, tree, r) for r in range(n)]
    for t in tree.values():
        t.fill_(1.0)  # a shard must never alias the tensors it came from
    assert torch.equal(unshard(shards), want)


def _model_state(module, n=1, rank=0):
    mesh = fs.Mesh(rank, n, "local", torch.device("cpu"))
    return fs.init(module, mesh, fs.adamw(lr=1e-2, impl="torch"))


@settings(max_examples=100, deadline=None)
@given(ft.modules())
def test_step_preserves_structure_and_never_mutates_its_input(module):
    state = _model_state(module)
    step = fs.compose(ft.module_loss)
    x = torch.randn(3, 2)
    before = ft.snapshot(state)
    new, metrics = step(state, x)
    ft.check_same_structure(state, new)
    ft.check_unchanged(state, before)
    new2, _ = step(new, x)  # and again from a stepped state (moments now non-zero)
    ft.check_same_structure(new, new2)
    assert int(new2.step) == 2 and int(state.step) == 0
    assert metrics["mem/peak_gathered_bytes"] <= 2 * max(u.nbytes for u in state.spec.units)


@settings(max_examples=100, deadline=None)
@given(ft.modules(dtype=torch.float32), ft.world_sizes(4))
def test_per_rank_bytes_within_total_over_n_plus_padding(module, n):
    for p in module.parameters():
        p.requires_grad_(True)  # the bound is for models without frozen parameters (see check_memory_bound)
    for rank in range(n):
        ft.check_memory_bound(_model_state(module, n, rank))


@given(ft.param_trees(), ft.world_sizes(), st.data())
def test_a_shard_is_the_slice_of_the_flat_buffer(tree, n, data):
    """fs.init cuts each rank's shard straight from the values instead of building the flat buffer."""
    frozen = data.draw(st.sets(st.sampled_from(sorted(tree))))
    layout = ft.layout_of(tree, n, frozen)
    flat = flatten(layout, tree)
    for r in range(n):
        lo, hi = layout.shard_range(r)
        got, want = shard(layout, tree, r), flat[lo:hi]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
