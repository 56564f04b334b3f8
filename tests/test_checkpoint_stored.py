"""Checkpoints of offloaded optimizer state (fs.offload_state): fs.save streams the moments out of the store and
fs.load streams them into one, chunk by chunk (fshard/checkpoint/_dcp.py).

- Resume with offload_state(NVMeStore) (plus gather_ahead, bucket_reduce, clipping, bf16, a schedule) is bitwise an
  uninterrupted run at world sizes 1 and 2, loading into a fresh fs.init state placed by ``offload=``.
- Reshard and rechunk: saved offloaded at 2 (chunks of 16 elements), loaded at 1 and 3 into stores of other chunk
  sizes, in memory, and placed by a fraction: every moment equals the in-memory load's bitwise.
- Memory: saving and loading a state whose moments are 134 MB holds at most 2 store chunks + 64 MiB more than
  before (peak RSS, reset before each), where holding the moments would add 134 MB.
"""
from __future__ import annotations

import os
import tempfile

import torch

import fshard as fs
from _dist import run_ranks
from _memory import reset_peak as _reset_peak, status as _status
from models import awkward_batches, awkward_loss
from test_checkpoint import STEPS, _model, _numpy, _transforms


def _offload(under: str, chunk_mb: float, fraction: float = 1.0):
    """Moments offloaded to an NVMeStore in a new directory under ``under`` (the test's tmp_path, which pytest
    removes: a store removes its files, never a directory it did not make)."""
    mesh_rank = int(os.environ.get("RANK", "0"))
    store = fs.NVMeStore(tempfile.mkdtemp(prefix=f"fshard-ckpt-r{mesh_rank}-", dir=under))
    return fs.offload_state(store, fraction=fraction, chunk_mb=chunk_mb)


def _run(path: str | None, phase: str, under: str):
    """As test_checkpoint._run with kind "full" and the moments in an NVMeStore (64-element chunks)."""
    mesh = fs.Mesh.from_env()
    opt, extra = _transforms("full")
    off = _offload(under, 64 * 4 / 2**20)
    state = fs.init(_model(), mesh, opt)
    batches = list(awkward_batches(2, STEPS, rank=mesh.rank, world_size=mesh.world_size))
    if phase == "first":
        batches = batches[:3]
    elif phase == "second":
        state = fs.load(path, like=state, offload=off)  # straight into the store: the first step streams
        assert all(isinstance(s.exp_avg, fs.state.Stored) for s in state.opt_state.values() if s is not None)
        batches = batches[3:]
    losses = []
    with fs.compose(awkward_loss, *extra, off) as step:
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
        if phase == "first":
            fs.save(path, state)
            again = fs.load(path, like=state)  # like holds Stored moments: loaded into the same store, new items
            assert all(torch.equal(a.load(), b.load()) for n, s in state.opt_state.items() if s is not None
                       for a, b in [(s.exp_avg, again.opt_state[n].exp_avg),
                                    (s.exp_avg_sq, again.opt_state[n].exp_avg_sq)])
    return losses, _numpy(fs.full_params(state)), int(state.step)


def test_resume_with_offloaded_moments_is_bitwise_an_uninterrupted_run(tmp_path):
    for world_size in (1, 2):
        path = str(tmp_path / f"ckpt{world_size}")
        whole = run_ranks(_run, world_size, None, "all", str(tmp_path))
        first = run_ranks(_run, world_size, path, "first", str(tmp_path))
        second = run_ranks(_run, world_size, path, "second", str(tmp_path))
        for w, a, b in zip(whole, first, second):
            assert w[0] == a[0] + b[0], (world_size, w[0], a[0], b[0])
            assert b[2] == w[2] == STEPS
            assert all((w[1][k] == b[1][k]).all() for k in w[1]), world_size


def _save_offloaded(path: str):
    mesh = fs.Mesh.from_env()
    state = fs.init(_model(), mesh, _transforms("plain")[0])
    with fs.compose(awkward_loss, _offload(os.path.dirname(path), 16 * 4 / 2**20)) as step:
        for b in list(awkward_batches(2, 3, rank=mesh.rank, world_size=mesh.world_size)):
            state, _ = step(state, b)
        fs.save(path, state)


def _moments(state) -> dict:
    out = {}
    for n, s in state.opt_state.items():
        if s is not None:
            rows = [m.load() if isinstance(m, fs.state.Stored) else m for m in (s.exp_avg, s.exp_avg_sq)]
            out[n] = [r.numpy().copy() for r in rows] + [s.count.numpy().copy()]
    return out


def _load_placed(path: str):
    """The checkpoint loaded in memory, into stores of 3 chunk sizes, and half offloaded: the same moments."""
    mesh = fs.Mesh.from_env()
    like = fs.init(_model(), mesh, _transforms("plain")[0])
    ref = _moments(fs.load(path, like=like))
    for chunk_mb, fraction in ((32 * 4 / 2**20, 1.0), (48 * 4 / 2**20, 1.0), (4, 1.0), (16 * 4 / 2**20, 0.5)):
        state = fs.load(path, like=like, offload=_offload(os.path.dirname(path), chunk_mb, fraction))
        stored = sum(isinstance(s.exp_avg, fs.state.Stored) for s in state.opt_state.values() if s is not None)
        assert stored == len(ref) if fraction == 1 else 0 < stored < len(ref), (stored, fraction)
        got = _moments(state)
        assert all((a == b).all() for n in ref for a, b in zip(ref[n], got[n])), (chunk_mb, fraction)
    return {n: [float(abs(x).sum()) for x in v[:2]] for n, v in ref.items()}


def test_offloaded_moments_reshard_and_rechunk(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_offloaded, 2, path)
    for n in (1, 3):
        sums = run_ranks(_load_placed, n, path)
        assert any(v[0] > 0 for r in sums for v in r.values())  # the moments are not all zero


def _memory(d: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 8))  # one unit of 16.8M
    state = fs.init(model, fs.Mesh.from_env(), fs.adamw(lr=1e-3), units=["0", "1"])
    off = fs.offload_state(fs.NVMeStore(os.path.join(d, "store")), chunk_mb=4)
    x, y = torch.randn(4, 4096), torch.randn(4, 8)
    with fs.compose(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), off) as step:
        _reset_peak()
        for _ in range(2):
            state, _ = step(state, (x, y))
        train_peak = _status("VmHWM:")
        before = _reset_peak()
        fs.save(os.path.join(d, "ckpt"), state)
        save_growth = _status("VmHWM:") - before
        before = _reset_peak()
        loaded = fs.load(os.path.join(d, "ckpt"), like=state)
        load_growth = _status("VmHWM:") - before
        same = all(torch.equal(a.load(), b.load()) for n, s in state.opt_state.items() for a, b in
                   [(s.exp_avg, loaded.opt_state[n].exp_avg), (s.exp_avg_sq, loaded.opt_state[n].exp_avg_sq)])
    moments = sum(2 * s.exp_avg.nbytes for s in state.opt_state.values())
    params = sum(p.nbytes for p in state.params.values())
    largest = max(p.nbytes for p in model.parameters())  # (DCP reads a saved tensor whole before copying it)
    return train_peak, save_growth, load_growth, moments, params, same, largest


def test_save_and_load_of_offloaded_moments_never_hold_them(tmp_path):
    train_peak, save_growth, load_growth, moments, params, same, largest = run_ranks(_memory, 1, str(tmp_path))[0]
    chunk = 2 * 4 * 2**20  # a store item: both moments of 1M elements
    assert same and moments > 130e6
    assert save_growth <= 2 * chunk + 64 * 2**20, (save_growth, moments)
    # Loading holds the new parameters, DCP's read of the largest saved tensor (its bytes, before the copy into
    # the parameter: this bound's "64 MiB slack" before, the size of that tensor), and the chunk window that every
    # chunk reuses (a fresh one a chunk once left 24 MiB more in glibc's heap). Not the moments: they would add 128.
    assert load_growth <= params + largest + 2 * chunk, (load_growth, params, largest, moments)
