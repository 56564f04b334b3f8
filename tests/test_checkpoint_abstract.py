"""fs.init(..., abstract=True): a state of shapes and dtypes only, the ``like`` of fs.load (issue #21).

- Loading into an abstract like gives bitwise the state a concrete like gives (parameters, moments, counts,
  buffers, step), at world sizes 1 and 2, and training goes on from it identically.
- It materialises nothing: fs.init of a 67 MB model on the meta device grows RSS by a few MB; a step, fs.save and
  fs.full_params refuse it with AbstractStateError.
- A buffer the checkpoint lacks (a non-persistent one, from a plain DCP save) is an error naming it.
"""
from __future__ import annotations

import pytest
import torch

import fshard as fs
from _dist import run_ranks
from _memory import reset_peak as _reset_peak, status as _status
from models import Awkward, awkward_batches, awkward_loss
from test_checkpoint import _model, _numpy, _run, _transforms


def _meta_awkward():
    with torch.device("meta"):
        return Awkward()


def _both(path: str):
    mesh = fs.Mesh.from_env()
    opt, extra = _transforms("full")
    concrete = fs.load(path, like=fs.init(_model(), mesh, opt))
    abstract_like = fs.init(_meta_awkward(), mesh, opt, abstract=True)
    assert abstract_like.abstract and all(p.is_meta for p in abstract_like.params.values())
    loaded = fs.load(path, like=abstract_like)
    assert not loaded.abstract
    same = [torch.equal(a, b) for a, b in zip(
        [*concrete.params.values(), *concrete.buffers.values(), concrete.step, concrete.skipped],
        [*loaded.params.values(), *loaded.buffers.values(), loaded.step, loaded.skipped])]
    for n, s in concrete.opt_state.items():
        t = loaded.opt_state[n]
        same += [torch.equal(s.count, t.count), torch.equal(s.exp_avg, t.exp_avg),
                 torch.equal(s.exp_avg_sq, t.exp_avg_sq)]
    losses = []
    for state in (concrete, loaded):
        with fs.compose(awkward_loss, *extra) as step:
            for b in list(awkward_batches(2, 6, rank=mesh.rank, world_size=mesh.world_size))[3:]:
                state, m = step(state, b)
        losses.append((m["loss"], _numpy(fs.full_params(state))))
    (la, pa), (lb, pb) = losses
    return all(same), la == lb and all((pa[k] == pb[k]).all() for k in pa)


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_abstract_like_loads_what_a_concrete_one_does(tmp_path, world_size):
    path = str(tmp_path / "ckpt")
    run_ranks(_run, 2, "full", path, "first")
    assert run_ranks(_both, world_size, path) == [(True, True)] * world_size


def test_an_abstract_state_holds_nothing_and_is_refused_where_values_are_needed(tmp_path):
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])  # 67 MB of fp32
    before = _reset_peak()
    state = fs.init(model, fs.Mesh.from_env(), fs.adamw(), abstract=True)
    assert _status("VmHWM:") - before < 8 * 2**20
    assert state.nbytes()["params"] == 0 or all(p.is_meta for p in state.params.values())
    with pytest.raises(fs.errors.AbstractStateError, match=r"fs.load\(path, like=state\)"):
        fs.full_params(state)
    with pytest.raises(fs.errors.AbstractStateError, match="abstract"):
        fs.save(tmp_path / "c", state)
    with fs.compose(lambda m, b: m(b).sum()) as step:
        with pytest.raises(fs.errors.AbstractStateError, match="abstract"):
            step(state, torch.ones(2, 2048))


class _Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.inv_freq


def test_a_buffer_the_checkpoint_lacks_is_named_for_an_abstract_like(tmp_path):
    import torch.distributed.checkpoint as dcp
    model = _Rotary()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "plain"))  # as FSDP2 + DCP would
    mesh = fs.Mesh.from_env()
    loaded = fs.load(tmp_path / "plain", like=fs.init(_Rotary(), mesh, fs.adamw()))  # keeps like's buffer
    assert torch.equal(loaded.buffers["inv_freq"], model.inv_freq)
    with torch.device("meta"):
        meta = _Rotary()
    with pytest.raises(fs.CheckpointError, match="no value for the buffer.*inv_freq.*abstract"):
        fs.load(tmp_path / "plain", like=fs.init(meta, mesh, fs.adamw(), abstract=True))
