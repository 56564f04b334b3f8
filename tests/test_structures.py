"""Model structures that stress unit assignment and binding, each checked bitwise against plain torch AdamW."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fshard as fs


def _trains_like_torch(model, loss_fn, batches, dtype=torch.float32, steps=4):
    ref = copy.deepcopy(model)
    # eps 1e-8 underflows in fp16 and torch itself produces NaN there; 1e-4 is representable in both halves
    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8 if dtype == torch.float32 else 1e-4)
    state = fs.init(model, fs.Mesh.local(), fs.adamw(**hp, impl="torch"))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **hp)
    step = fs.compose(loss_fn)
    for batch in batches[:steps]:
        state, m = step(state, batch)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ref, batch)
        loss.backward()
        opt.step()
        assert m["loss"] == loss.item() and loss.isfinite()
    full = fs.full_params(state)
    assert list(full) == [n for n, _ in ref.named_parameters()]
    for n, p in ref.named_parameters():
        assert full[n].dtype == dtype and torch.equal(full[n], p.detach()), n
    assert list(state.buffers) == [n for n, _ in ref.named_buffers()]
    for n, b in ref.named_buffers():  # (a buffer forward updates, as BatchNorm's statistics)
        assert torch.equal(state.buffers[n], b), n
    return state


def _batches(n=4, d=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, d, generator=g) for _ in range(n)]


def _mse(m, x):
    return m(x).float().square().mean()


class TiedAcrossUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x):
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


def test_weight_tied_across_units_lives_in_the_root():
    state = _trains_like_torch(TiedAcrossUnits(), _mse, _batches())
    root = state.spec.unit("<root>")
    assert [s.aliases for s in root.slots] == [("blocks.0.weight", "blocks.1.weight")]
    assert [s.name for s in state.spec.unit("blocks.1").slots] == ["blocks.1.bias"]


class SharedModule(nn.Module):
    """One module object at two paths: one unit, called twice."""

    def __init__(self):
        super().__init__()
        blk = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.layers = nn.ModuleList([blk, blk])
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_module_shared_at_two_paths_is_one_unit():
    state = _trains_like_torch(SharedModule(), _mse, _batches())
    # the block is itself a Sequential, so its Linear is the unit; its two paths give one unit, not two
    assert [u.name for u in state.spec.units] == ["<root>", "layers.0.0"]
    assert state.spec.unit("layers.0.0").slots[0].aliases == ("layers.0.0.weight", "layers.1.0.weight")


class SharedBuffer(nn.Module):
    """One buffer at three paths: two units' and the root's (a step binds it under every name, as functional_call's
    tie_weights does), and a BatchNorm whose running statistics forward updates in place."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.norm = nn.BatchNorm1d(6)
        self.register_buffer("shift", torch.linspace(-1, 1, 6))
        for b in self.blocks:
            b.register_buffer("shift", self.shift)

    def forward(self, x):
        x = self.norm(x) + self.shift
        for b in self.blocks:
            x = torch.tanh(b(x) * b.shift)
        return x


def test_buffer_at_three_paths_and_running_statistics():
    torch.manual_seed(0)
    state = _trains_like_torch(SharedBuffer(), _mse, _batches())  # buffers equal torch's too
    assert list(state.buffers) == ["shift", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert int(state.buffers["norm.num_batches_tracked"]) == 4


def test_top_level_sequential_without_root_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 6), nn.LayerNorm(6))
    state = _trains_like_torch(model, _mse, _batches())
    assert [u.name for u in state.spec.units] == ["0", "2", "3"]


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(6))
        self.inner = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])

    def forward(self, x):
        x = x * torch.sigmoid(self.gate)
        for lin in self.inner:
            x = torch.tanh(lin(x))
        return x


class Nested(nn.Module):
    """Units inside units: outer.i owns its gate; outer.i.inner.j are units of their own."""

    def __init__(self):
        super().__init__()
        self.outer = nn.ModuleList([Outer() for _ in range(2)])

    def forward(self, x):
        for b in self.outer:
            x = b(x)
        return x


def test_units_nested_in_units():
    torch.manual_seed(0)
    state = _trains_like_torch(Nested(), _mse, _batches())
    assert sorted(u.name for u in state.spec.units) == ["outer.0", "outer.0.inner.0", "outer.0.inner.1", "outer.1",
                                                        "outer.1.inner.0", "outer.1.inner.1"]
    assert [s.name for s in state.spec.unit("outer.0").slots] == ["outer.0.gate"]


def test_reaching_into_a_unit_is_a_clear_error():
    torch.manual_seed(0)
    state = fs.init(Nested(), fs.Mesh.local(), fs.adamw())
    reach_in = lambda m, x: (x * m.outer[0].gate).sum()  # noqa: E731 - uses a unit's param without calling it
    with pytest.raises(fs.errors.UnboundParameterError, match=r"reaches into a unit.*units=\[\.\.\.\]"):
        fs.compose(reach_in)(state, torch.randn(2, 6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_params(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).to(dtype)
    _trains_like_torch(model, _mse, [b.to(dtype) for b in _batches()], dtype=dtype)


def test_loss_fn_may_run_parts_under_no_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))

    def loss(m, x):
        with torch.no_grad():
            target = m[0](x)  # a unit called without autograd: no gradient for that use
        return (m(x) - target).square().mean()

    _trains_like_torch(model, loss, _batches())
