"""fs.offload_state: bitwise the same training with the moments in a CPUStore or an NVMeStore, at any fraction and
with the other transforms; a pure step; stored leaves visible in the state; clear errors that lose nothing."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import torch

from _dist import run_ranks

STEPS = 5


def _model():
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(n_layers=3)
    return GPT(cfg), loss_fn, lambda r, n: synthetic_batches(cfg, 2, STEPS, seed=4, rank=r, world_size=n)


def _moments(state):
    import fshard as fs
    out = {}
    for name, s in state.opt_state.items():
        if s is not None:
            for f in ("exp_avg", "exp_avg_sq"):
                v = getattr(s, f)
                out[f"{name}.{f}"] = (v.load() if isinstance(v, fs.state.Stored) else v).numpy().tobytes()
    return out


def _train(directory, with_transforms, donate=False):
    """Per config: losses, full params and moments (as bytes), and the last metrics."""
    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _model()
    extra = (fs.gather_ahead(2), fs.bucket_reduce(bucket_mb=0.02)) if with_transforms else ()
    configs = {"none": None}
    for frac in (0.0, 0.5, 1.0):
        configs[f"cpu/{frac}"] = (lambda: fs.CPUStore(), frac)
        configs[f"nvme/{frac}"] = (lambda: fs.NVMeStore(f"{directory}/r{mesh.rank}"), frac)
    out = {}
    for key, cfg in configs.items():
        store = None if cfg is None else cfg[0]()
        ts = extra + (() if store is None else (fs.offload_state(store, fraction=cfg[1], chunk_mb=0.01),))
        state = fs.init(model, mesh, fs.adamw(lr=3e-3, weight_decay=0.1))
        step = fs.compose(loss_fn, *ts, donate=donate)
        losses = []
        for b in batches(mesh.rank, mesh.world_size):
            state, m = step(state, b)
            losses.append(m["loss"])
        stored = sum(isinstance(getattr(s, "exp_avg", None), fs.state.Stored) for s in state.opt_state.values())
        params = {n: p.numpy().tobytes() for n, p in fs.full_params(state).items()}
        out[key] = (losses, params, _moments(state), stored,
                    {k: v for k, v in m.items() if k.startswith(("io/", "update/"))})
        del state, step
        if store is not None:
            store.close()
    return out


@pytest.mark.parametrize("world_size,with_transforms", [(1, False), (2, False), (2, True)])
def test_training_is_bitwise_identical_with_offload(tmp_path, world_size, with_transforms):
    args = (str(tmp_path), with_transforms)
    ranks = run_ranks(_train, world_size, *args) if world_size > 1 else [_train(*args)]
    for r, res in enumerate(ranks):
        ref = res["none"]
        for key, (losses, params, moments, stored, io) in res.items():
            assert losses == ref[0], f"rank {r} {key}: losses differ"
            assert params == ref[1], f"rank {r} {key}: parameters differ"
            assert moments == ref[2], f"rank {r} {key}: moments differ"
            frac = None if key == "none" else float(key.split("/")[1])
            n_units = 4  # root + 3 blocks
            if frac is not None:  # the fraction really moved state, and the update really streamed it
                assert stored == 0 if frac == 0 else (stored == n_units if frac == 1 else 0 < stored < n_units)
                assert (io["io/read_bytes"] > 0) == (frac > 0)
                # every unit got a gradient, so every stored unit was updated while backward ran (by default on
                # NVMe only: a CPUStore's update is CPU work that would compete with backward)
                assert io["update/overlapped_units"] == (stored if key.startswith("nvme") else 0)


def test_donated_offloaded_training_is_bitwise_identical(tmp_path):
    out = _train(str(tmp_path), False, donate=True)
    for key, res in out.items():
        assert res[:3] == out["none"][:3], key


def test_a_step_is_pure_and_old_versions_are_freed(tmp_path):
    import fshard as fs
    import fshard.testing as ft
    model, loss_fn, batches = _model()
    bs = list(batches(0, 1))
    with fs.NVMeStore(str(tmp_path)) as store:
        step = fs.compose(loss_fn, fs.offload_state(store, chunk_mb=0.01))
        s0 = fs.init(model, fs.Mesh.local(), fs.adamw())
        s1, _ = step(s0, bs[0])  # moves the moments into the store
        s2, _ = step(s1, bs[1])
        ft.check_same_structure(s1, s2)
        snap = ft.snapshot(s1)
        a, _ = step(s1, bs[2])
        ft.check_unchanged(s1, snap)  # the stored moments of s1 are still its own
        b, _ = step(s1, bs[2])  # the same step from the same state: the same result
        assert _moments(a) == _moments(b)
        text = repr(b)
        assert "Stored(" in text and "exp_avg_sq" in text and "nvme:" in text and "in a store" in text
        keys_per_version = len(store.keys())
        del s0, s1, s2, a, snap
        gc.collect()
        for x in bs[3:]:
            b, m = step(b, x)
        # only the live state's items remain (plus at most the version the last step replaced)
        assert len(store.keys()) <= keys_per_version
        assert m["io/read_bytes"] == m["io/write_bytes"] > 0 and m["store/resident_bytes"] > 0
        assert m["io/gbps"] > 0 and m["time/io_wait"] >= 0


def test_a_missing_or_unwritable_directory_fails_at_init(tmp_path):
    import fshard as fs
    with pytest.raises(fs.store.StoreDirectoryError, match="does not exist"):
        fs.NVMeStore(str(tmp_path / "missing"), create=False)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(fs.store.StoreDirectoryError, match="not a directory"):
        fs.NVMeStore(str(afile))
    with pytest.raises(TypeError, match="CPUStore"):
        fs.offload_state(object())
    with pytest.raises(ValueError, match="fraction"):
        fs.offload_state(fs.CPUStore(), fraction=1.5)
    with fs.NVMeStore(str(tmp_path), max_buffers=4) as small:  # a stream deeper than the pool: refused up front
        with pytest.raises(ValueError, match=r"offload_state\(depth=4\) needs 6 pool buffers.*max_buffers >= 6"):
            fs.offload_state(small, depth=4)


def test_an_unwritable_directory_fails_at_init(tmpfs):
    import fshard as fs
    ro = tmpfs("ro,size=1m")
    with pytest.raises(fs.store.StoreDirectoryError, match="not writable"):
        fs.NVMeStore(str(ro))


def test_a_full_directory_fails_on_the_first_step_and_loses_nothing(tmpfs):
    import fshard as fs
    small = tmpfs("size=64k")  # far less than the moments need
    model, loss_fn, batches = _model()
    bs = list(batches(0, 1))
    state = fs.init(model, fs.Mesh.local(), fs.adamw())
    with fs.NVMeStore(str(small)) as store:
        step = fs.compose(loss_fn, fs.offload_state(store, chunk_mb=0.01))
        with pytest.raises(fs.errors.OffloadError, match="input state is unchanged"):
            step(state, bs[0])
        assert store.keys() == []  # what the failed step had written is gone again
    # the input state is intact: training on without offload gives what training without offload gives
    plain = fs.compose(loss_fn)
    s, ref = state, fs.init(model, fs.Mesh.local(), fs.adamw())
    for b in bs:
        s, m1 = plain(s, b)
        ref, m2 = plain(ref, b)
    assert m1["loss"] == m2["loss"]


def _awkward_run(store, transforms=(), overlap=True, world_size=1, rank=0):
    """5 steps of the awkward model (tied, frozen and unused parameters, a unit used twice, one never called)."""
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    torch.manual_seed(0)
    ts = tuple(transforms)
    if store is not None:
        ts += (fs.offload_state(store, chunk_mb=0.0001, overlap_backward=overlap),)
    state = fs.init(Awkward(), fs.Mesh.local() if world_size == 1 else fs.Mesh.from_env(), fs.adamw(lr=3e-3))
    step = fs.compose(awkward_loss, *ts)
    losses, overlapped = [], []
    for b in awkward_batches(2, STEPS, rank=rank, world_size=world_size):
        state, m = step(state, b)
        losses.append(m["loss"])
        overlapped.append(m.get("update/overlapped_units", 0))
    return losses, {n: p.numpy().tobytes() for n, p in fs.full_params(state).items()}, _moments(state), overlapped


def _awkward_configs(directory):
    import fshard as fs
    mesh = fs.Mesh.from_env()
    ref = _awkward_run(None, world_size=mesh.world_size, rank=mesh.rank)
    out = {}
    for name, overlap, ts in (("overlap", True, ()), ("after", False, ()),
                              ("clip", True, (fs.clip_by_global_norm(1e9),))):
        with fs.NVMeStore(f"{directory}/{name}{mesh.rank}") as store:
            out[name] = _awkward_run(store, ts, overlap, mesh.world_size, mesh.rank)
    return ref, out


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_update_during_backward_is_bitwise_and_takes_only_units_it_may(tmp_path, world_size):
    """Units whose parameters all got a gradient are updated while backward runs; the root (an unused parameter:
    another rank could still give it a gradient) and the never-called unit wait for the agreement; a clipped step
    updates nothing early (the norm is global). Every way gives the same bits as no offload."""
    args = (str(tmp_path),)
    ranks = run_ranks(_awkward_configs, world_size, *args) if world_size > 1 else [_awkward_configs(*args)]
    for ref, out in ranks:
        for name, res in out.items():
            assert res[:3] == ref[:3], name
        assert out["overlap"][3] == [0] + [2] * (STEPS - 1)  # blocks.0 (used twice) and blocks.1
        assert out["after"][3] == [0] * STEPS and out["clip"][3] == [0] * STEPS


def _failing_model(begun=()):
    model, loss_fn, batches = _model()
    fail = {"on": False}

    def boom(grad):
        for work in begun:  # let the worker finish (and write) what it began, however the threads are scheduled
            work.future.exception()
        raise RuntimeError("injected failure in backward")

    # blocks.0's output: its hook runs in backward after the later blocks' gradients are final (and their updates
    # have begun in the worker), before blocks.0 and the root are done
    def arm(mod, inputs, out):
        if fail["on"]:
            out.register_hook(boom)

    model.blocks[0].register_forward_hook(arm)
    return model, loss_fn, batches, fail


def test_a_step_that_fails_in_backward_drops_the_updates_it_began(tmp_path, monkeypatch):
    import fshard as fs
    from fshard.offload import _update as _offload
    abandoned = []
    keep = _offload._Early.abandon
    monkeypatch.setattr(_offload._Early, "abandon", lambda w: (abandoned.append((w.name, len(w.created))), keep(w)))
    begun, init = [], _offload._Early.__init__
    monkeypatch.setattr(_offload._Early, "__init__", lambda w, *a, **k: (init(w, *a, **k), begun.append(w))[0])
    model, loss_fn, batches, fail = _failing_model(begun)
    bs = list(batches(0, 1))
    with fs.NVMeStore(str(tmp_path)) as store:
        step = fs.compose(loss_fn, fs.offload_state(store, chunk_mb=0.01))
        s = fs.init(model, fs.Mesh.local(), fs.adamw())
        for b in bs[:2]:
            s, _ = step(s, b)
        ref, m = step(s, bs[2])
        assert m["update/overlapped_units"] == 4
        keys = set(store.keys())
        fail["on"] = True
        with pytest.raises(RuntimeError, match="injected failure"):
            step(s, bs[2])
        fail["on"] = False
        # blocks.2 and blocks.1 were updated (and written) in the worker before the failure
        assert sorted(n for n, _ in abandoned) == ["blocks.1", "blocks.2"] and all(k > 0 for _, k in abandoned)
        assert set(store.keys()) == keys  # what the worker wrote for the failed step is gone again
        again, _ = step(s, bs[2])  # the input state is intact
        assert _moments(again) == _moments(ref)


class _FlakyStore:
    """A CPUStore whose puts fail once ``fail`` is set (a disk error in the middle of the update)."""

    def __init__(self):
        import fshard as fs
        self.inner, self.fail = fs.CPUStore(), False
        self.streams = {"opened": 0, "closed": 0}

    def put(self, key, t):  # fail: True, or a unit's name: the puts of its items fail
        if self.fail is True or (self.fail and str(key).startswith(f"('{self.fail}@")):
            raise OSError(28, "No space left on device (injected)")
        return self.inner.put(key, t)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stream(self, keys, depth=2, writeback=False, max_writes=None):
        from fshard.store._stream import Stream
        s, counts = Stream(self, keys, depth=depth, writeback=writeback, max_writes=max_writes), self.streams
        counts["opened"] += 1
        close = s.close

        def counted():
            counts["closed"] += 1
            return close()
        s.close = counted
        return s


def _a_failed_write_loses_nothing(fail, **kw) -> dict:
    """A step through a ``_FlakyStore`` whose writes fail as ``fail`` says raises OffloadError, leaves the store's
    keys as they were and the input usable: the next step is bitwise the step that never failed (its metrics
    returned)."""
    import fshard as fs
    model, loss_fn, batches = _model()
    bs = list(batches(0, 1))
    store = _FlakyStore()
    step = fs.compose(loss_fn, fs.offload_state(store, chunk_mb=0.01, **kw))
    s = fs.init(model, fs.Mesh.local(), fs.adamw(weight_decay=0.1))
    s, _ = step(s, bs[0])
    ref, _ = step(s, bs[1])
    ref = {n: p.clone() for n, p in fs.full_params(ref).items()}
    gc.collect()
    step(s, bs[1])  # empties the trash of the freed versions
    gc.collect()
    keys = set(store.keys())
    store.fail = fail
    with pytest.raises(fs.errors.OffloadError, match="input state is unchanged"):
        step(s, bs[1])
    store.fail = False
    assert set(store.keys()) == keys
    assert store.streams["opened"] == store.streams["closed"] > 0, store.streams  # (every stream ended)
    again, m = step(s, bs[1])
    assert all(torch.equal(p, ref[n]) for n, p in fs.full_params(again).items())
    return m


def test_a_write_that_fails_in_the_worker_raises_and_loses_nothing():
    assert _a_failed_write_loses_nothing(True, overlap_backward=True)["update/overlapped_units"] == 4


def _device_runs(directory, monkeypatch):
    """Per config (update_on="device" unless named "host"): losses, full params, moments, the chunks that went up
    and came back (DeviceChunks' calls), and the units updated during backward."""
    import fshard as fs
    from fshard.offload import _staging
    calls = {"up": 0, "down": 0}  # tensors copied up, and back
    up, down = _staging.DeviceChunks.up, _staging.DeviceChunks.down

    def spy_up(self, host):
        calls["up"] += 1
        return up(self, host)

    def spy_down(self, pairs):  # (one call a chunk, its tensors together)
        pairs = list(pairs)
        calls["down"] += len(pairs)
        return down(self, pairs)
    monkeypatch.setattr(_staging.DeviceChunks, "up", spy_up)
    monkeypatch.setattr(_staging.DeviceChunks, "down", spy_down)
    model, loss_fn, batches = _model()
    out = {}
    for key, kw, donate in (("none", None, False), ("host", dict(update_on="host"), True),
                            ("cpu", {}, False), ("cpu+donate", {}, True), ("half", dict(fraction=0.5), False),
                            ("params", dict(params=True), False), ("params+donate", dict(params=True), True),
                            ("nvme+params", dict(params=True, nvme=True), False),
                            ("nvme+donate", dict(nvme=True), True),
                            # the device takes the first share of the units, the host's cores the rest meanwhile
                            ("split", dict(update_on=0.5), False), ("split+donate", dict(update_on=0.2), True),
                            ("split params", dict(update_on=0.5, params=True), False),
                            ("split nvme+params+donate", dict(update_on=0.5, params=True, nvme=True), True)):
        store = None
        ts = (fs.gather_ahead(2),)
        if kw is not None:
            kw = {"update_on": "device", **kw}
            store = fs.NVMeStore(f"{directory}/{key}") if kw.pop("nvme", False) else fs.CPUStore()
            ts += (fs.offload_state(store, chunk_mb=0.01, **kw),)
        calls.update(up=0, down=0)
        state = fs.init(model, fs.Mesh.local(), fs.adamw(lr=3e-3, weight_decay=0.1))
        with fs.compose(loss_fn, *ts, donate=donate) as step:
            losses, overlapped = [], 0
            for b in batches(0, 1):
                state, m = step(state, b)
                losses.append(m["loss"])
                overlapped += m.get("update/overlapped_units", 0)
        params = {n: p.numpy().tobytes() for n, p in fs.full_params(state).items()}
        out[key] = (losses, params, _moments(state), dict(calls), overlapped)
        del state
        if store is not None:
            store.close()
    return out


def test_the_update_on_the_device_is_bitwise_the_same_and_moves_each_chunk_up_and_back(tmp_path, monkeypatch):
    """offload_state(update_on="device"): each stored chunk goes to the mesh's device for the update and comes back
    (on a CPU mesh a working copy, the same path as on a GPU: tests/test_cuda.py runs it there), after backward,
    bitwise the update without offload: CPUStore and NVMeStore, in place (donate) and into new versions, half the
    units, parameters in the store too (their head chunks go up beside the rows)."""
    out = _device_runs(str(tmp_path), monkeypatch)
    ref = out["none"]
    for key, (losses, params, moments, calls, overlapped) in out.items():
        assert (losses, params, moments) == ref[:3], f"{key}: differs from the update without offload"
        assert overlapped == 0, f"{key}: {overlapped} units updated during backward"
        if key in ("none", "host"):
            assert calls == {"up": 0, "down": 0}, f"{key}: {calls}"
        else:  # every stored chunk up and back, the first step's excepted (it puts the moments in the store)
            assert calls["up"] == calls["down"] > 0, f"{key}: {calls}"
    # with the parameters' heads beside the rows, twice the chunks go up
    assert out["params"][3]["up"] == 2 * out["cpu"][3]["up"]
    assert out["half"][3]["up"] < out["cpu"][3]["up"]
    # a split: the device's share of the chunks went up, the host's cores updated the rest
    assert out["split+donate"][3]["up"] < out["split"][3]["up"] < out["cpu"][3]["up"]
    assert out["split params"][3]["up"] == 2 * out["split"][3]["up"]


@pytest.mark.parametrize("unit", ["blocks.0", "blocks.2"], ids=["device", "host"])
def test_a_split_update_that_fails_on_either_side_loses_nothing(unit):
    """offload_state(update_on=0.5): a write that fails in the device's part (<root> and blocks.0) or in the host's
    part (blocks.1 and blocks.2) raises OffloadError with the other part's streams closed, deletes what both wrote,
    and leaves the input usable."""
    m = _a_failed_write_loses_nothing(unit, update_on=0.5)
    assert m["update/device_units"] == 2 and m["time/split_host"] > 0


def test_the_updates_own_error_is_raised_not_a_later_one_from_closing_its_streams(monkeypatch):
    """A stream update that fails (here its kernel) raises its own error; a stream that then fails to close (a
    write-back that cannot complete) does not hide it."""
    import fshard as fs
    from fshard.offload import _pipeline
    from fshard.store import _stream
    model, loss_fn, batches = _model()
    bs = list(batches(0, 1))
    store = fs.CPUStore()
    step = fs.compose(loss_fn, fs.offload_state(store, chunk_mb=0.01))
    s = fs.init(model, fs.Mesh.local(), fs.adamw())
    s, _ = step(s, bs[0])  # (the first step puts the moments in the store; the next one streams them)
    close = _stream.Stream.close

    def failing_close(self):
        close(self)
        raise OSError(5, "Input/output error (injected at close)")

    def failing_kernel(opt, runs):
        raise RuntimeError("the kernel failed (injected)")
    monkeypatch.setattr(_stream.Stream, "close", failing_close)
    monkeypatch.setattr(_pipeline, "apply_runs", failing_kernel)
    with pytest.raises(fs.errors.OffloadError, match="the kernel failed") as got:
        step(s, bs[1])
    assert "at close" not in str(got.value)


def test_update_on_is_checked_by_name():
    import fshard as fs
    for bad in ("gpu", 1.5, -0.1, True, None):
        with pytest.raises(ValueError, match="update_on must be 'host'"):
            fs.offload_state(fs.CPUStore(), update_on=bad)
    with pytest.raises(ValueError, match="overlap_backward=True cannot hold"):
        fs.offload_state(fs.CPUStore(), update_on=0.4, overlap_backward=True)
    with pytest.raises(ValueError, match=r"update_on=0.4\) needs 16 pool buffers"):  # two sides, two streams each
        fs.offload_state(fs.CPUStore(max_buffers=15), update_on=0.4, params=True, depth=2)
    assert fs.offload_state(fs.CPUStore(), update_on=0.0).overlap_backward is None  # (0.0 is "host")
    assert "update_on=0.4" in repr(fs.offload_state(fs.CPUStore(), update_on=0.4))
    with pytest.raises(ValueError, match="overlap_backward=True cannot hold"):
        fs.offload_state(fs.CPUStore(), update_on="device", overlap_backward=True)
    off = fs.offload_state(fs.CPUStore(), update_on="device")
    assert off.overlap_backward is False and "update_on='device'" in repr(off) and "update_on" in off.fingerprint()
    # the same placement and update, the same fingerprint; any real number is a share
    assert off.fingerprint() == fs.offload_state(fs.CPUStore(), update_on=1).fingerprint()
    assert fs.offload_state(fs.CPUStore(), update_on=np.float32(0.5)).device_share == 0.5


def test_the_worker_runs_at_a_lower_priority_than_the_caller():
    """worker_nice lowers only the worker thread's priority (Linux nice is per thread), so backward keeps the cores;
    a value outside 0-19 is refused by name."""
    import os

    import fshard as fs
    model, loss_fn, batches = _model()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    store = fs.CPUStore()
    step = fs.compose(loss_fn, fs.offload_state(store, chunk_mb=0.01, overlap_backward=True, worker_nice=3))
    s = fs.init(model, fs.Mesh.local(), fs.adamw())
    for b in list(batches(0, 1))[:2]:
        s, m = step(s, b)
    assert m["update/overlapped_units"] > 0  # the worker did run
    worker = step.policy.update.worker
    assert worker.submit(os.getpriority, os.PRIO_PROCESS, 0).result() == min(19, base + 3)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's threads keep theirs
    store.close()
    for bad in (-1, 20, 2.5):
        with pytest.raises(ValueError, match="worker_nice must be an int in"):
            fs.offload_state(fs.CPUStore(), worker_nice=bad)


def test_with_bucket_reduce_units_begin_their_update_during_backward(tmp_path, monkeypatch):
    """bucket_reduce hands a unit its gradient shard once its buckets have landed, while backward goes on, so
    offload_state begins its update before the last gradient has arrived; the result is bitwise the same."""
    import fshard as fs
    from fshard.offload import _transform as _offload
    from fshard.transforms import _bucket_reduce
    events = []
    reduce, overlap = _bucket_reduce.BucketReduce.reduce, _offload.OffloadUpdate.overlap
    monkeypatch.setattr(_bucket_reduce.BucketReduce, "reduce",
                        lambda self, run, unit, g: (events.append(("arrive", unit.layout.name)),
                                                    reduce(self, run, unit, g))[1])
    monkeypatch.setattr(_offload.OffloadUpdate, "overlap",
                        lambda self, run, unit: (events.append(("final", unit.layout.name)), overlap(self, run, unit))[1])
    model, loss_fn, batches = _model()
    out = {}
    for name, ts in (("plain", ()), ("offload", (fs.offload_state(fs.NVMeStore(str(tmp_path)), chunk_mb=0.01),))):
        state = fs.init(model, fs.Mesh.local(), fs.adamw(lr=3e-3))
        step = fs.compose(loss_fn, fs.bucket_reduce(bucket_mb=0.05), *ts)
        for b in batches(0, 1):
            events.clear()
            state, m = step(state, b)
        out[name] = ({n: p.numpy().tobytes() for n, p in fs.full_params(state).items()}, _moments(state))
    assert out["offload"] == out["plain"]
    assert m["update/overlapped_units"] == 4
    last_arrival = max(i for i, (kind, _) in enumerate(events) if kind == "arrive")
    began = [n for i, (kind, n) in enumerate(events) if kind == "final" and i < last_arrival]
    assert "blocks.2" in began, events  # the last block's buckets landed before the root's gradient arrived


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_init_puts_the_moments_in_the_store_and_trains_bitwise_the_same(tmp_path, fraction):
    """fs.init(..., offload=): the chosen units' moments are in the store from the start (the device never holds
    them all), at the places the step would have moved them to, and training is bitwise the same."""
    import fshard as fs
    from fshard.offload._tiers import choose_stores
    model, loss_fn, batches = _model()
    runs = {}
    for where in ("init", "step"):
        with fs.NVMeStore(str(tmp_path / where)) as store:
            off = fs.offload_state(store, fraction=fraction, chunk_mb=0.01)
            state = fs.init(model, fs.Mesh.local(), fs.adamw(lr=3e-3, weight_decay=0.1),
                            offload=off if where == "init" else None)
            stored = {n for n, s in state.opt_state.items() if isinstance(s.exp_avg, fs.state.Stored)}
            with fs.compose(loss_fn, off) as step:
                for b in batches(0, 1):
                    state, m = step(state, b)
            runs[where] = (stored, m["loss"], {n: p.numpy().tobytes() for n, p in fs.full_params(state).items()},
                           _moments(state))
    chosen = choose_stores(state.spec, state.opt_state, (None,), (fraction,))  # (the placement's unit names)
    assert runs["init"][0] == set(chosen) and not runs["step"][0]
    assert runs["init"][1:] == runs["step"][1:]
    with pytest.raises(fs.ArgumentTypeError, match="offload="):
        fs.init(model, fs.Mesh.local(), fs.adamw(), offload=fs.CPUStore())


def test_a_cpu_store_takes_no_checksum_in_init_or_in_steps(monkeypatch):
    """A CPUStore's checksums are for ``meta()`` callers only: fs.init's puts take none, and a step's stream reads
    items by ``layout`` (dtype, shape, size), so neither a donated nor a fresh-version step sweeps the stored bytes
    (each sweep is single-threaded: at 6.3B parameters about 8 s of init, and as much again per step)."""
    import fshard as fs
    import fshard.store._cpu as cpu
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    calls = []
    monkeypatch.setattr(cpu, "checksum", lambda u8, *a: calls.append(u8.numel()) or 0)
    for donate in (False, True):
        torch.manual_seed(0)
        cfg = GPTConfig.tiny(n_layers=2)
        store = fs.CPUStore(pin=False)
        off = fs.offload_state(store, chunk_mb=0.01, params=True)
        state = fs.init(GPT(cfg), fs.Mesh.local("cpu"), fs.adamw(lr=1e-3), offload=off)
        assert calls == [], f"fs.init took {len(calls)} checksums"
        with fs.compose(loss_fn, off, donate=donate) as step:
            for b in synthetic_batches(cfg, 2, 2, seed=0):
                state, _ = step(state, b)
        assert calls == [], f"donate={donate}: the steps took {len(calls)} checksums"
        key = next(iter(store.keys()))
        store.meta(key)  # a caller that asks gets one
        assert len(calls) == 1
        calls.clear()
        store.close()


def test_a_split_gives_the_host_its_turn_while_the_devices_copies_are_full(monkeypatch):
    """split_update: with no room for the device's next chunk (its copies down in flight), the host's part takes
    the turn, whichever is ahead; the result is the same bits."""
    import fshard as fs
    from fshard.offload import _staging
    order = []
    up, host = _staging.DeviceChunks.up, _staging.HostStaging.host
    monkeypatch.setattr(_staging.DeviceChunks, "up", lambda self, t: (order.append("D"), up(self, t))[1])
    monkeypatch.setattr(_staging.HostStaging, "host", lambda self, i: (order.append("H"), host(self, i))[1])
    runs = {}
    for room in (True, False):
        monkeypatch.setattr(_staging.DeviceChunks, "has_room", lambda self, room=room: room)
        model, loss_fn, batches = _model()
        state = fs.init(model, fs.Mesh.local(), fs.adamw(weight_decay=0.1))
        with fs.compose(loss_fn, fs.offload_state(fs.CPUStore(), chunk_mb=0.01, update_on=0.5)) as step:
            for b in batches(0, 1):
                order.clear()
                state, _ = step(state, b)
        runs[room] = ("".join(order), {n: p.clone() for n, p in fs.full_params(state).items()})
    turns, full = runs[True]
    assert "DH" in turns and "HD" in turns  # room: the parts alternate
    turns, full_no_room = runs[False]
    assert turns == "H" * turns.count("H") + "D" * turns.count("D"), turns  # none: the host's part first, whole
    assert all(torch.equal(p, full[n]) for n, p in full_no_room.items())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10**6), max_size=12), st.floats(-0.5, 1.5))
def test_a_split_gives_the_device_the_prefix_nearest_its_share(numels, share):
    """device_cut (offload_state(update_on=<share>)): nothing for a share of 0 or less, everything for 1 or more,
    else at least one unit and the prefix whose elements come nearest the share (no other prefix nearer)."""
    from fshard.offload._pipeline import device_cut
    cut = device_cut(numels, share)
    if share <= 0 or not numels:
        assert cut == 0
    elif share >= 1:
        assert cut == len(numels)
    else:
        assert 1 <= cut <= len(numels)
        gap = lambda k: abs(sum(numels[:k]) - share * sum(numels))  # noqa: E731
        assert all(gap(cut) <= gap(k) for k in range(1, len(numels) + 1))
