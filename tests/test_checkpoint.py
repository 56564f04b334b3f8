"""fs.save / fs.load / fs.latest (fshard/checkpoint/_save.py) through torch.distributed.checkpoint.

- Resume: 6 steps uninterrupted against 3 steps, save, new processes, load, 3 steps: losses and parameters
  bitwise, at world sizes 1 and 2, with gather_ahead, bucket_reduce, clipping, bf16 mixed precision with param
  copies, fp16 loss scaling and a schedule (the awkward model: tied, frozen, unused, 0-dim, prime, a buffer).
- Reshard: saved at 2, loaded at 1, 3 and 4: fs.full_params bitwise, and training continues.
- Interop: an fshard checkpoint loads into a plain model.state_dict() with dcp.load (FSDP2 and fshard continuing
  each other's checkpoints: tests/test_interop.py).
- Atomic and damaged: a save killed before its rename leaves the previous checkpoint and fs.latest returns it;
  a truncated or corrupted file is an error naming it; keep_last rotates.
- The box tiling of a flat range (property test).
"""
from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fshard as fs
from _dist import run_ranks
from models import Awkward, awkward_batches, awkward_loss

STEPS = 6


def _transforms(kind: str):
    sched = fs.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, STEPS)
    opt = fs.adamw(lr=sched, weight_decay=0.1, impl="torch")
    extra = {"plain": (),
             "full": (fs.gather_ahead(1), fs.bucket_reduce(bucket_mb=0.001), fs.clip_by_global_norm(0.5),
                      fs.mixed_precision(torch.bfloat16)),
             "fp16": (fs.mixed_precision(torch.float16), fs.clip_by_global_norm(0.5))}[kind]
    return opt, extra


def _model():
    torch.manual_seed(0)
    return Awkward()


def _run(kind: str, path: str | None, phase: str):
    """phase "all": 6 steps; "first": 3 steps then save; "second": load, 3 steps. Returns losses and params."""
    mesh = fs.Mesh.from_env()
    opt, extra = _transforms(kind)
    state = fs.init(_model(), mesh, opt)
    batches = list(awkward_batches(2, STEPS, rank=mesh.rank, world_size=mesh.world_size))
    if phase == "first":
        batches = batches[:3]
    elif phase == "second":
        state = fs.load(path, like=state)
        batches = batches[3:]
    losses = []
    with fs.compose(awkward_loss, *extra) as step:
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
    if phase == "first":
        fs.save(path, state)
    return losses, _numpy(fs.full_params(state)), int(state.step)


def _numpy(params: dict) -> dict:
    """Tensors as numpy arrays: a tensor returned from a rank's process is shared memory that dies with it."""
    return {k: v.detach().float().numpy().copy() for k, v in params.items()}


@pytest.mark.parametrize("kind", ["plain", "full", "fp16"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_bitwise_an_uninterrupted_run(tmp_path, kind, world_size):
    path = str(tmp_path / "ckpt")
    whole = run_ranks(_run, world_size, kind, None, "all")
    first = run_ranks(_run, world_size, kind, path, "first")
    second = run_ranks(_run, world_size, kind, path, "second")
    for w, a, b in zip(whole, first, second):
        assert w[0] == a[0] + b[0], (w[0], a[0], b[0])
        assert b[2] == w[2]  # updates applied (fp16 skips its overflowing steps in both)
        for k in w[1]:
            assert (w[1][k] == b[1][k]).all(), k


def _reshard(path: str, again: str):
    """Load at this world size, save again, and train on (the global batch differs with the world size here)."""
    mesh = fs.Mesh.from_env()
    opt, _ = _transforms("plain")
    state = fs.load(path, like=fs.init(_model(), mesh, opt))
    full = _numpy(fs.full_params(state))
    fs.save(again, state)
    losses = []
    with fs.compose(awkward_loss) as step:
        for b in list(awkward_batches(2, STEPS, rank=mesh.rank, world_size=mesh.world_size))[3:]:
            state, m = step(state, b)
            losses.append(m["loss"])
    return full, losses


def test_reshard_from_2_to_1_3_and_4(tmp_path):
    """Saved at 2 and loaded at n: the parameters are the saved ones. Saved again at n and loaded at 2: the run
    continues bitwise as from the original checkpoint, so the moments and counts went through n-rank shards
    intact too."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_run, 2, "plain", path, "first")[0][1]
    continued = run_ranks(_run, 2, "plain", path, "second")[0]
    for n in (1, 3, 4):
        again = str(tmp_path / f"at{n}")
        for full, losses in run_ranks(_reshard, n, path, again):
            assert all((saved[k] == full[k]).all() for k in saved), n
            assert all(math.isfinite(x) for x in losses)
        back = run_ranks(_run, 2, "plain", again, "second")[0]
        assert back[0] == continued[0] and all((back[1][k] == continued[1][k]).all() for k in saved), n


def test_a_plain_model_loads_an_fshard_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_run, 2, "plain", path, "first")[0][1]
    model = Awkward()
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path)
    model.load_state_dict(sd)
    for k, v in saved.items():
        assert (dict(model.named_parameters())[k].detach().numpy() == v).all(), k
    assert torch.equal(model.head.weight, model.emb.weight)  # the tie survives (both keys hold the same values)


def test_a_damaged_file_is_named_and_latest_keeps_the_complete_one(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    mesh = fs.Mesh.from_env()
    opt, _ = _transforms("plain")
    state = fs.init(_model(), mesh, opt)
    with fs.compose(awkward_loss) as step:
        batches = awkward_batches(2, 3)
        state, _ = step(state, next(batches))
        fs.save(d / "step1", state)
        state, _ = step(state, next(batches))
        fs.save(d / "step2", state)
    assert fs.latest(d) == str(d / "step2")
    (d / "step3.partial").mkdir()  # a save killed before its rename
    (d / "step3.partial" / ".metadata").write_bytes(b"")
    assert fs.latest(d) == str(d / "step2")
    data = next(p for p in (d / "step2").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(fs.CheckpointError, match=f"{data.name}.*corrupted"):
        fs.load(d / "step2", like=state)
    data.write_bytes(bytes(raw[:100]))
    with pytest.raises(fs.CheckpointError, match=f"{data.name}.*truncated"):
        fs.load(d / "step2", like=state)
    one = fs.load(d / "step1", like=state)
    assert int(one.step) == 1
    with pytest.raises(fs.CheckpointError, match="not a complete"):
        fs.load(d / "step3", like=state)
    fs.save(d / "step4", state.replace(step=torch.tensor(4)), keep_last=2)
    assert sorted(p.name for p in d.iterdir() if not p.name.endswith(".partial")) == ["step2", "step4"]


@given(shape=st.lists(st.integers(1, 5), max_size=4), data=st.data())
def test_boxes_tile_a_flat_range_in_order(shape, data):
    from fshard.checkpoint._dcp import _boxes
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    covered = []
    for offsets, sizes, start in _boxes(tuple(shape), lo, hi):
        idx = [sum(i * math.prod(shape[d + 1:]) for d, i in enumerate(t))
               for t in itertools.product(*[range(o, o + s) for o, s in zip(offsets, sizes)])]
        assert idx == list(range(start, start + len(idx)))  # contiguous: a view of the flat range
        covered += idx
    assert covered == list(range(lo, hi))
    assert len(_boxes(tuple(shape), lo, hi)) <= max(1, 2 * len(shape) - 1)


def _killed_save(d: str, where: str):
    """Save step 1, then die by SIGKILL in the middle of saving step 2: after DCP wrote everything but before the
    rename ("before_rename"), or while DCP writes the data files ("writing")."""
    import signal

    import torch.distributed.checkpoint.filesystem as fsys

    import fshard.checkpoint._files as ck
    mesh = fs.Mesh.from_env()
    state = fs.init(_model(), mesh, _transforms("plain")[0])
    with fs.compose(awkward_loss) as step:
        batches = awkward_batches(2, 3, rank=mesh.rank, world_size=mesh.world_size)
        state, _ = step(state, next(batches))
        fs.save(os.path.join(d, "ckpt"), state)
        state, _ = step(state, next(batches))
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if where == "before_rename":
        ck._write_json = die
    else:
        fsys._write_item = die
    fs.save(os.path.join(d, "ckpt"), state)  # the same path: replaced only once complete


def _disk_full(d: str, blocking: bool = True):
    """A full disk while DCP writes the second save (in the background with ``blocking=False``, raising from
    wait()): the first checkpoint stays the latest, and loads."""
    import errno

    import torch.distributed.checkpoint.filesystem as fsys
    mesh = fs.Mesh.from_env()
    state = fs.init(_model(), mesh, _transforms("plain")[0])
    fs.save(os.path.join(d, "a"), state)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    fsys._write_item = full
    with pytest.raises(fs.CheckpointError, match="No space left.*is unchanged"):
        handle = fs.save(os.path.join(d, "a"), state.replace(step=torch.tensor(7)), blocking=blocking)
        if not blocking:
            handle.wait()
    assert not state.donation.saves  # a failed save is no longer registered
    return fs.latest(d), int(fs.load(fs.latest(d), like=state).step)


@pytest.mark.parametrize("where", ["before_rename", "writing"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, where, world_size):
    from _dist import spawn
    out = spawn(_killed_save, world_size, str(tmp_path), where, timeout_s=120, collective_timeout_s=20)
    assert any(s == "died" for s, _ in out.values()), out
    assert fs.latest(tmp_path) == str(tmp_path / "ckpt")
    state = fs.load(tmp_path / "ckpt", like=fs.init(_model(), fs.Mesh.from_env(), _transforms("plain")[0]))
    assert int(state.step) == 1


def test_a_full_disk_fails_the_save_and_keeps_the_previous(tmp_path):
    assert run_ranks(_disk_full, 2, str(tmp_path)) == [(str(tmp_path / "a"), 0)] * 2


def test_a_checkpoint_of_another_model_names_the_entry(tmp_path):
    state = fs.init(_model(), fs.Mesh.from_env(), _transforms("plain")[0])
    fs.save(tmp_path / "c", state)
    other = fs.init(torch.nn.Sequential(torch.nn.Linear(8, 3)), fs.Mesh.from_env(), fs.adamw())
    with pytest.raises(fs.CheckpointError, match="no parameter '0.weight'"):
        fs.load(tmp_path / "c", like=other)
    smaller = Awkward()
    smaller.up = torch.nn.Linear(8, 5, bias=False)
    with pytest.raises(fs.CheckpointError, match=r"model.up.weight .* shape \(37, 8\).* \(5, 8\)"):
        fs.load(tmp_path / "c", like=fs.init(smaller, fs.Mesh.from_env(), fs.adamw()))


# --- checkpoints written before the package layout (issue #39) ---

def test_a_byte_entry_pickled_under_the_modules_before_the_package_layout_loads():
    """fshard pickled its transform-state classes (byte entries of a checkpoint) as fshard._mixed_precision and
    fshard._loss_scale before issue #39 moved them into fshard/transforms/: such a checkpoint still loads, and an
    unknown class is still refused."""
    import io
    import sys
    import types

    from fshard.checkpoint._read import load_bytes
    from fshard.transforms._loss_scale import LossScaleState
    from fshard.transforms._mixed_precision import MixedPrecisionState
    value = MixedPrecisionState(torch.float16, torch.float32, LossScaleState.initial(1024.0))
    saved = {c: c.__module__ for c in (MixedPrecisionState, LossScaleState)}
    try:
        for c, old in ((MixedPrecisionState, "fshard._mixed_precision"), (LossScaleState, "fshard._loss_scale")):
            sys.modules[old] = types.ModuleType(old)
            setattr(sys.modules[old], c.__name__, c)
            c.__module__ = old
        buf = io.BytesIO()
        torch.save({"mixed_precision": value}, buf)
    finally:
        for c, m in saved.items():
            sys.modules.pop(c.__module__, None)
            c.__module__ = m
    assert b"fshard._mixed_precision" in buf.getvalue() and b"fshard._loss_scale" in buf.getvalue()
    buf.seek(0)
    got = load_bytes(buf)["mixed_precision"]
    assert isinstance(got, MixedPrecisionState) and got.param_dtype == torch.float16
    assert float(got.loss_scale.scale) == 1024.0

    buf = io.BytesIO()
    torch.save(_Unknown(), buf)
    buf.seek(0)
    with pytest.raises(fs.CheckpointError, match="add_safe_globals"):
        load_bytes(buf)


class _Unknown:
    """A class no checkpoint of fshard's holds."""
