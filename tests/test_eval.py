"""step.eval: forward only, with the step's gathers, in eval mode; train/eval mode chosen per call.

The oracle: the same weights (fs.full_params and the state's buffers) loaded into the torch model, ``model.eval()``,
the loss on each rank's batch averaged over ranks in float64: bitwise. An eval pass changes no state, does not
disturb the training gather order, gathers each unit once (gather_ahead prefetching along the forward half of its
gather order), and a training step runs in train mode whatever mode the model was in at fs.init.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import run_ranks


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(F.relu(self.bn(self.lin(x))))


class Net(nn.Module):
    """Dropout and BatchNorm, the two layers whose behaviour depends on the mode, in three block units."""

    def __init__(self, d: int = 12):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x.to(self.inp.weight.dtype))  # the root's own layers see the batch as given (mixed precision)
        for b in self.blocks:
            h = b(h)
        return self.out(h).squeeze(-1).float()


def net_loss(module, batch):
    x, y = batch
    return F.mse_loss(module(x), y)


def _batches(n, rank, world_size):
    for s in range(n):
        g = torch.Generator().manual_seed(50 + s)
        x, y = torch.randn(8 * world_size, 5, generator=g), torch.randn(8 * world_size, generator=g)
        yield x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]


def _oracle_eval(state, batch, world_size, model):
    """The torch model with the state's weights and buffers, in eval mode; the loss averaged over ranks."""
    import fshard as fs
    ref = copy.deepcopy(model)
    ref.load_state_dict({**fs.full_params(state), **dict(state.buffers)}, strict=False)
    ref.eval()
    with torch.no_grad():
        loss = net_loss(ref, batch).double()
    if world_size > 1:
        torch.distributed.all_reduce(loss)
    return loss.item() / world_size


def _run(transforms: str, init_mode: str):
    import fshard as fs
    import fshard.testing as ft
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = Net()
    model.train(init_mode == "train")  # an HF model from from_pretrained comes in eval mode
    ts = {"blocking": (), "ahead": (fs.gather_ahead(1),),
          "ahead+keep": (fs.gather_ahead(1, reshard_after_forward=False),)}[transforms]
    batches = list(_batches(4, mesh.rank, mesh.world_size))
    out = {"evals": [], "oracle": [], "train": []}
    for with_evals in (True, False):
        torch.manual_seed(1)  # dropout's random stream: the same in both runs unless an eval consumed it
        state = fs.init(copy.deepcopy(model), mesh, fs.adamw(lr=1e-2, impl="torch"))
        step = fs.compose(net_loss, *ts)
        losses = []
        for b in batches:
            if with_evals:
                snap = ft.snapshot(state)
                loss, m = step.eval(state, b)
                again, _ = step.eval(state, b)
                ft.check_unchanged(state, snap)  # BatchNorm's running statistics included
                out["evals"].append((loss, again, m["mem/peak_gathered_bytes"], m["comm/gather_bytes"],
                                     m.get("gather/prefetched", 0), state.spec.template.training))
                out["oracle"].append(_oracle_eval(state, b, mesh.world_size, model))
            state, m = step(state, b)
            losses.append((m["loss"], m.get("gather/replanned", 0)))
            out["train_gather_bytes"] = m["comm/gather_bytes"]
        out["train"].append((losses, {n: t.numpy().tobytes() for n, t in fs.full_params(state).items()}))
    out["numel"] = sum(u.numel * 4 for u in state.spec.units)
    return out


@pytest.mark.parametrize("transforms, init_mode", [("blocking", "train"), ("ahead", "eval"),
                                                   ("ahead+keep", "train")])
def test_eval_is_torch_eval_mode_and_changes_nothing(transforms, init_mode):
    for out in run_ranks(_run, 2, transforms, init_mode):
        (with_evals, params), (without, params2) = out["train"]
        assert with_evals == without and params == params2  # evals in between change no step's result
        assert all(r == 0 for _, r in with_evals)  # nor the gather_ahead gather order
        for i, (loss, again, peak, gathered, prefetched, flag) in enumerate(out["evals"]):
            assert loss == again  # dropout off: deterministic
            assert flag == (init_mode == "train")  # the template's flags are restored
            assert gathered == out["numel"]  # each unit gathered once (forward only; no keep for backward)
            if "ahead" in transforms and i > 0:
                assert prefetched > 0  # along the forward half of the gather order the first step recorded
        assert [e[0] for e in out["evals"]] == out["oracle"]  # bitwise torch's eval mode
        # the training step ran in train mode (dropout on) even from a model in eval mode at fs.init: its loss on
        # the same state and batch is not the eval pass's
        assert with_evals[0][0] != out["evals"][0][0]
        # a step re-gathers in backward (unless it keeps units from forward); an eval pass gathers once
        assert out["train_gather_bytes"] == out["evals"][-1][3] if "keep" in transforms else \
            out["train_gather_bytes"] > out["evals"][-1][3]


def test_train_mode_keeps_a_modules_own_train_override():
    """A module that overrides train() to keep a part frozen (a frozen BatchNorm in fine-tuning) keeps it in a
    training step, as under model.train() in torch: the step calls the modules' own train(mode)."""
    import fshard as fs

    class FrozenBN(Net):
        def train(self, mode=True):
            super().train(mode)
            for b in self.blocks:
                b.bn.eval()
            return self

    torch.manual_seed(0)
    model = FrozenBN()
    state = fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(lr=1e-2, impl="torch"))
    before = {k: b.clone() for k, b in state.buffers.items() if "running" in k}
    state, _ = fs.compose(net_loss)(state, next(_batches(1, 0, 1)))
    assert all(torch.equal(state.buffers[k], b) for k, b in before.items())  # running statistics not updated
    plain = fs.init(copy.deepcopy(Net()), fs.Mesh.local(), fs.adamw(lr=1e-2, impl="torch"))
    new, _ = fs.compose(net_loss)(plain, next(_batches(1, 0, 1)))
    assert not torch.equal(new.buffers["blocks.0.bn.running_mean"], plain.buffers["blocks.0.bn.running_mean"])


def _gpt_bf16():
    """The example GPT (no dropout) in bf16 with gather_ahead: an eval pass computes what the training step's
    forward computes on the same state and batch, so its loss is the step's metrics["loss"], bit for bit; it
    gathers each unit once (in bf16), where the step also gathers for backward."""
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    mesh = fs.Mesh.from_env()
    cfg = GPTConfig.tiny(n_layers=3)
    torch.manual_seed(0)
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=3e-3))
    step = fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(0.01), fs.mixed_precision())
    pairs = []
    for b in synthetic_batches(cfg, 4, 3, 0, mesh.rank, mesh.world_size):
        loss, m = step.eval(state, b)
        state, sm = step(state, b)
        once = sum(u.numel * 2 for u in state.spec.units)  # each unit's bf16 bytes, gathered once
        pairs.append((loss, sm["loss"], m["comm/gather_bytes"] == once < sm["comm/gather_bytes"]))
    return pairs


def test_eval_in_bf16_is_the_training_forward():
    for pairs in run_ranks(_gpt_bf16, 2):
        assert all(a == b and once for a, b, once in pairs), pairs
