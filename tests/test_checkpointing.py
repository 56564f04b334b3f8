"""Activation checkpointing under fshard (fshard/run/_recompute.py): a checkpoint inside a unit (transformers'
``gradient_checkpointing_enable()`` checkpoints each layer's class forward), around a unit, around several units,
reentrant or not, with a buffer read in the recompute: losses and parameters bitwise those of the same model
checkpointed the same way without fshard (DDP at 2 ranks), at world sizes 1 and 2, with the default policies and
with gather_ahead + bucket_reduce (transformers' models without fshard's transforms: tests/test_hf_matrix.py); the
gather_ahead gather order replays with prefetch; the units are freed between uses; misuse gets a clear error."""
from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fshard as fs
from _dist import run_ranks
from models import HF_VOCAB, enable_checkpointing, hf_model, oracle_step, param_diffs

STEPS, D, HP = 3, 12, dict(lr=1e-2, weight_decay=0.01)


class Block(nn.Module):
    """A unit. ``inner``: "plain", its MLP checkpointed inside its own forward; "reentrant", its whole body (every
    parameter of the unit) in a reentrant checkpoint inside its forward; the buffer is read inside the checkpoint."""

    def __init__(self, inner: str | None):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, D))
        self.inner = inner

    def _mlp(self, x):
        return self.b(torch.tanh(self.a(x + self.shift)))

    def _body(self, x):
        return self._mlp(self.norm(x))

    def forward(self, x):
        if self.inner == "reentrant":
            return x + checkpoint(self._body, x, use_reentrant=True)
        h = self.norm(x)
        return x + (checkpoint(self._mlp, h, use_reentrant=False) if self.inner else self._mlp(h))


class Net(nn.Module):
    """Embedding and head in the root unit, four blocks. ``mode`` says how forward runs them: "inner" (each block
    checkpoints its MLP), "inner-reentrant" (each block's body in a reentrant checkpoint: its recompute reads the
    views its forward call bound), "around" / "reentrant" (each block call checkpointed), "pairs" (one checkpoint
    around two blocks). Except with the reentrant ones, the third block runs twice (a unit with two uses). The
    blocks share one buffer (at four paths, read in each recompute)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(17, D)
        inner = {"inner": "plain", "inner-reentrant": "reentrant"}.get(mode)
        self.blocks = nn.ModuleList([Block(inner) for _ in range(4)])
        for blk in self.blocks[1:]:
            blk.shift = self.blocks[0].shift  # (a registered buffer's name: the same tensor under a second path)
        self.head = nn.Linear(D, 17)

    def forward(self, batch):
        x, y = batch
        h = self.emb(x)
        blocks = [self.blocks[i] for i in ((0, 1, 2, 3) if "reentrant" in self.mode else (0, 1, 2, 3, 2))]
        if self.mode == "pairs":
            for a, b in zip(blocks[0:4:2], blocks[1:4:2]):
                h = checkpoint(_two, h, a, b, use_reentrant=False)
            h = blocks[4](h)
        else:
            for blk in blocks:
                h = (checkpoint(blk, h, use_reentrant=self.mode == "reentrant")
                     if self.mode in ("around", "reentrant") else blk(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _two(h, a, b):
    return b(a(h))


def _call(model, batch):
    return model(batch)


def _batches(rank, world_size):
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x, y = torch.randint(0, 17, (2 * world_size, 5), generator=g), torch.randint(0, 17, (2 * world_size, 5),
                                                                                     generator=g)
        yield x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]


def _train(make, loss_fn, batches, policies: str):
    """fshard and the oracle (the same model and checkpointing without fshard; DDP at 2 ranks) on the same
    batches. Returns (losses equal, parameters equal, max gathered bytes / largest unit, replans, prefetched)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    transforms = (fs.gather_ahead(2), fs.bucket_reduce(bucket_mb=0.001)) if policies == "ahead" else ()
    oracle = DDP(ref) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    same_loss, peak, replans, prefetched = True, 0, 0, 0
    with fs.compose(loss_fn, *transforms) as step:
        for batch in batches(mesh.rank, mesh.world_size):
            state, m = step(state, batch)
            same_loss &= m["loss"] == oracle_step(oracle, opt, loss_fn, batch, mesh.world_size)
            peak = max(peak, m["mem/peak_gathered_bytes"])
            replans += m.get("gather/replanned", 0)
            prefetched = m.get("gather/prefetched", 0)
    _, bitwise = param_diffs(fs.full_params(state), ref)
    bufs = all(torch.equal(state.buffers[n], b) for n, b in ref.named_buffers())
    root = sum(u.nbytes for u in state.spec.units if not u.module)
    largest = max(u.nbytes for u in state.spec.units if u.module)
    return same_loss, bitwise and bufs, (peak - root) / largest, replans, prefetched


def _custom(mode, policies, frozen=False):
    def make():
        net = Net(mode)
        if frozen:  # a frozen unit, and a unit with a frozen parameter
            net.blocks[1].requires_grad_(False)
            net.blocks[3].a.weight.requires_grad_(False)
        return net
    return _train(make, _call, _batches, policies)


@pytest.mark.parametrize("mode", ["inner", "inner-reentrant", "around", "pairs", "reentrant"])
@pytest.mark.parametrize("frozen", [False, True])
def test_checkpointed_custom_model_is_bitwise_the_oracle(mode, frozen):
    same_loss, same_params, _, _, _ = _custom(mode, "default", frozen)
    assert same_loss and same_params, f"{mode}: fshard differs from the same checkpointed model without it"


@pytest.mark.parametrize("mode", ["inner", "around", "pairs"])
def test_checkpointed_custom_model_at_two_ranks_with_gather_ahead(mode):
    for same_loss, same_params, units, replans, prefetched in run_ranks(_custom, 2, mode, "ahead"):
        assert same_loss and same_params, f"{mode}: fshard differs from DDP on the same checkpointed model"
        assert replans == 0 and prefetched > 0, "the gather order recorded in step 1 did not replay with prefetch"
        assert units <= 2 + 2, f"{mode}: {units:.2f} units gathered at once besides the root (depth 2: at most 4)"


def _hf_loss(module, batch):
    return module(input_ids=batch, labels=batch).loss


def _hf_batches(rank, world_size):
    g = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        rows = torch.randint(3, HF_VOCAB, (2 * world_size, 8), generator=g)
        yield rows[2 * rank:2 * rank + 2]


def _hf(name, reentrant, policies):
    def make():
        model = hf_model(name)
        enable_checkpointing(model, {"use_reentrant": reentrant})
        return model
    return _train(make, _hf_loss, _hf_batches, policies)[:2]


def test_hf_reentrant_checkpointing_is_bitwise_the_oracle():  # the default variant: tests/test_hf_matrix.py
    assert _hf("gpt2", True, "default") == (True, True)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hf_gradient_checkpointing_at_two_ranks_with_gather_ahead(name):
    assert run_ranks(_hf, 2, name, False, "ahead") == [(True, True)] * 2


def _state(model):
    return fs.init(model, fs.Mesh(0, 1, "local", torch.device("cpu")), fs.adamw(**HP))


def test_a_unit_in_two_reentrant_checkpoints_is_refused():
    model = Net("reentrant")
    model.mode = "mixed"

    def loss_fn(model, batch):  # block 2 in two reentrant regions: two separate backward passes reach it
        x, y = batch
        h = model.emb(x)
        for i in (0, 2, 2):
            h = checkpoint(model.blocks[i], h, use_reentrant=True)
        return nn.functional.cross_entropy(model.head(h).flatten(0, 1), y.flatten())
    with fs.compose(loss_fn) as step, pytest.raises(fs.errors.RecomputeError, match="use_reentrant=False"):
        step(_state(model), next(_batches(0, 1)))


def test_a_recompute_that_reads_an_ungathered_root_parameter_names_the_fix():
    class Pre(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.blocks = nn.Linear(D, D), nn.ModuleList([Block(False) for _ in range(2)])

    def loss_fn(model, x):  # the root's only parameters are used inside a checkpoint, between two units
        h = checkpoint(model.pre, model.blocks[0](x), use_reentrant=False)
        return model.blocks[1](h).square().mean()
    with fs.compose(loss_fn) as step, pytest.raises(fs.errors.UnboundParameterError, match="make each checkpointed"):
        step(_state(Pre()), torch.randn(2, D))


class Prompted(nn.Module):
    """Prompt tuning: a trainable embedding in the root, every block frozen; backward runs through the blocks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(17, D)
        self.blocks = nn.ModuleList([Block(False) for _ in range(4)])
        self.blocks.requires_grad_(False)

    def forward(self, batch):
        x, y = batch
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
        return nn.functional.cross_entropy(h.flatten(0, 1), y.flatten() % D)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_frozen_units_are_freed_after_their_backward_use(checkpointed):
    """A frozen unit has no gradient to end its backward use; a node on its call's inputs does, so backward holds
    one block at a time, as for trainable units (it held every block to the end of backward before)."""
    def make():
        net = Prompted()
        for blk in net.blocks:
            blk.inner = checkpointed
        return net
    same_loss, same_params, units, _, _ = _train(make, _call, _batches, "default")
    assert same_loss and same_params
    assert units <= 1.0, f"{units:.2f} frozen units gathered at once besides the root"
