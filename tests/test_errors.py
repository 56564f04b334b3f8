"""Bad input gets a clear error that names the misuse and the fix, and loses nothing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fshard as fs
import fshard.testing as ft
from models import Awkward, awkward_batches, awkward_loss


def _init(model, **kw):
    return fs.init(model, fs.Mesh.local(), fs.adamw(), **kw)


def test_parameters_on_mixed_devices():
    model = Awkward()
    model.down = nn.Linear(37, 8, device="meta")
    with pytest.raises(fs.InitError, match=r"mixed devices .*'down.weight' on meta.*model.to\(device\)"):
        _init(model)


def test_a_buffer_that_is_a_parameter():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_buffer("w", model[0].weight)  # one tensor, registered as a parameter and as a buffer
    with pytest.raises(fs.InitError, match=r"buffer '1.w' is the tensor of parameter '0.weight'.*detach\(\)"):
        fs.init(model, fs.Mesh.local(), fs.adamw())


def test_loss_fn_returning_a_non_scalar():
    state = _init(Awkward())
    snap = ft.snapshot(state)
    per_token = lambda m, b: nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten(), reduction="none")  # noqa
    with pytest.raises(fs.errors.LossError, match=r"shape \(12,\).*loss.mean\(\)"):
        fs.compose(per_token)(state, next(awkward_batches(2, 1)))
    with pytest.raises(fs.errors.LossError, match="returned int"):
        fs.compose(lambda m, b: 3)(state, next(awkward_batches(2, 1)))
    ft.check_unchanged(state, snap)  # nothing lost: the state still trains
    fs.compose(awkward_loss)(state, next(awkward_batches(2, 1)))


def test_unit_mixing_dtypes():
    model = Awkward()
    model.blocks[1].ln.to(torch.float64)
    with pytest.raises(fs.InitError, match=r"unit 'blocks.1' mixes parameter dtypes.*units=\[\.\.\.\]"):
        _init(model)


def test_meta_module_without_reset_parameters():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        model = nn.Sequential(Bare())
    with pytest.raises(fs.InitError, match=r"'0' \(Bare\) is on the meta device.*init_fn=fn"):
        _init(model)
    state = _init(model, init_fn=lambda m: nn.init.ones_(m.w) if isinstance(m, Bare) else None)
    assert torch.equal(fs.full_params(state)["0.w"], torch.ones(3))


def test_units_that_are_not_submodules():
    with pytest.raises(fs.InitError, match="not a submodule"):
        _init(Awkward(), units=[nn.Linear(2, 2)])


def test_step_arguments():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        fs.compose("loss")
    with pytest.raises(TypeError, match="not an fshard transform"):
        fs.compose(awkward_loss, torch.optim.AdamW)
    with pytest.raises(TypeError, match="state must be the fs.TrainState"):
        fs.compose(awkward_loss)({"params": 1}, None)


def test_optimizer_arguments():
    with pytest.raises(ValueError, match="impl='cuda'"):
        fs.adamw(impl="cuda")
    with pytest.raises(ValueError, match="betas"):
        fs.adamw(betas=(0.9, 1.5))


def test_a_torch_older_than_the_tested_floor_is_refused_at_import():
    import subprocess
    import sys
    code = "import torch; torch.__version__ = '2.10.1+cu128'; import fshard"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "fshard needs torch >= 2.11; this is torch 2.10.1+cu128" in r.stderr, r.stderr
