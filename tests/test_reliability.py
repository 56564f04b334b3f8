"""Reliability (issue #24): misuse and faults, each an fshard error that names the fix, and never a hang.

The table below grows with the issue; each row is one case: what is done, the error type and a fragment of its
message (the fix it names), run under a timeout. Cases so far:

- A native build killed halfway leaves torch's lock file in the kernel cache; the next build must not wait for it
  forever (fshard/ops/_build.py: fshard's flock, released by the kernel when its holder dies, then the stale file
  cleared). End to end through ``fshard.ops`` in a fresh process, and the lock's three situations directly.
- ``FSHARD_TIMEOUT_S`` that is not a positive number is an ``ArgumentError`` naming the variable when a mesh is
  made, not a broken ``import fshard``; ``Mesh.from_env(timeout_s=...)`` is checked the same way.
- ``state.replace(...)`` checks what it is given against the state's spec: a fractional step, a shard one element
  short, a missing unit, a moment of the wrong dtype each name the field and the fix.
- Hyperparameters that cannot train (``fs.adamw(lr=nan)``, ``eps=nan``, ``weight_decay=inf``, malformed betas) are an
  ``ArgumentError`` or ``ArgumentTypeError`` naming the argument.
- Each ``fs.init`` argument of the wrong kind (``INIT_MISUSE``: a model that is no module, no mesh, a torch.optim
  optimizer, units as a string or naming no submodule, init_fn, seed, align_bytes, a model without parameters,
  lazy parameters) is an fshard error naming what it takes.
- A loss with no path to any parameter (detached, a constant, computed under no_grad) is a ``LossError`` naming
  ``step.eval`` for evaluation; a parameter created in forward is an ``InitError``; the state is unchanged and
  still trains.
- A second step while one runs, on the same step function, on a state of the same ``fs.init``, or an eval pass, is
  a ``ConcurrentStepError``; the running step's result is bitwise what it is alone. States of separate ``fs.init``
  calls step in parallel, bitwise.
- Checkpoints (issue #37): ``fs.save`` to a path that exists and is not an fshard checkpoint (a run directory, a
  file, a ``.partial`` or ``.old`` not fshard's) is a ``CheckpointError`` naming the path and the fix, every file
  left as it was; ``keep_last`` keeps the checkpoint just written and rotates only its own series (``step5b`` and a
  user's ``step7`` stay), ``fs.latest`` is the one committed last; a crafted ``.metadata`` (no manifest, a
  recomputed CRC, an empty file list, an FSDP2-style checkpoint) or byte entry is a ``CheckpointError`` and runs
  nothing (a marker file stays absent); a full disk (data or manifest) removes the ``.partial`` and the previous
  checkpoint loads; a newer format, a manifest whose world size or shapes contradict the metadata, and
  ``fs.load(None)`` are refused by name; differing hyperparameters are a warning naming each, like's kept.

The multi-rank cases (divergence, failures on one rank, a hung rank, Ctrl-C) are tests/test_reliability_ranks.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import fshard as fs
import fshard.testing as ft
from models import Awkward, awkward_batches, awkward_loss


def _python(code: str, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


# --- the native build's lock ------------------------------------------------------------------------------------

def test_a_build_killed_halfway_leaves_no_lock_that_blocks_the_next():
    from fshard.ops import _build
    _build.build()  # built once (the suite's ops tests have built it already); BuildError without a compiler
    cuda = _build.want_cuda()
    d = _build.cache_root() / f"fshard_ops_{_build._hash(cuda)}"
    (d / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    out = _python("from fshard.ops import _build; _build.build(); print('loaded')", timeout=120)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]  # (the message: the test below)
    assert not (d / "lock").exists()


def test_the_build_lock_is_released_by_a_killed_holder_and_waited_for_while_held(tmp_path, capsys):
    from fshard.ops._build import _exclusive
    (tmp_path / "lock").write_text("")
    with _exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "left by a build that was killed halfway" in capsys.readouterr().err
    holder = ("import os, signal, sys, time; from pathlib import Path; from fshard.ops._build import _exclusive\n"
              "with _exclusive(Path(sys.argv[1])):\n"
              "    print('held', flush=True)\n"
              "    time.sleep(float(sys.argv[2]))\n"
              "    os.kill(os.getpid(), signal.SIGKILL) if sys.argv[3] == 'die' else None\n")
    dead = subprocess.run([sys.executable, "-c", holder, str(tmp_path), "0", "die"], capture_output=True, timeout=60)
    assert dead.returncode == -signal.SIGKILL
    t0 = time.monotonic()
    with _exclusive(tmp_path):  # the dead holder's flock went with it
        pass
    assert time.monotonic() - t0 < 5
    live = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path), "3", "live"], stdout=subprocess.PIPE,
                            text=True)
    assert live.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with _exclusive(tmp_path):  # waits for the live holder, then takes it
        waited = time.monotonic() - t0
    live.wait(timeout=60)
    assert waited > 1.0, waited


# --- timeouts -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan"])
def test_a_bad_timeout_variable_is_named_when_a_mesh_is_made(value):
    out = _python("import fshard as fs\n"
                  "try:\n    fs.Mesh.from_env()\nexcept fs.ArgumentError as e:\n    print('ERR', e)\n",
                  timeout=60, FSHARD_TIMEOUT_S=value, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="1")
    assert out.returncode == 0, out.stderr[-2000:]  # import fshard itself works
    assert "ERR" in out.stdout and "FSHARD_TIMEOUT_S" in out.stdout and repr(value) in out.stdout, out.stdout


def test_a_bad_timeout_argument_is_named():
    with pytest.raises(fs.ArgumentError, match="timeout_s must be a positive number of seconds"):
        fs.Mesh.from_env(timeout_s=-1)


# --- TrainState.replace -------------------------------------------------------------------------------------------

def _state():
    torch.manual_seed(0)
    return fs.init(Awkward(), fs.Mesh.from_env(), fs.adamw())


def _short(state):
    name = next(iter(state.params))
    return {**state.params, name: state.params[name][:-1]}


REPLACE = [  # (what is given, the message fragment)
    (lambda s: dict(step=torch.tensor(0.5)), r"step must be a 0-dim torch.int64 tensor.*torch.tensor\(n\)"),
    (lambda s: dict(step=3), r"step must be a 0-dim torch.int64 tensor"),
    (lambda s: dict(skipped=torch.zeros(2, dtype=torch.int64)), r"skipped must be a 0-dim torch.int64 tensor"),
    (lambda s: dict(params=_short(s)), r"params\['.*'\] has shape \(\d+,\).*\(\d+,\) elements.*the shard"),
    (lambda s: dict(params={k: v for k, v in list(s.params.items())[1:]}), r"params lacks unit"),
    (lambda s: dict(params={**s.params, "nope": torch.zeros(3)}), r"params has unit 'nope', which the model"),
    (lambda s: dict(params={k: v.double() for k, v in s.params.items()}), r"params\['.*'\] is torch.float64"),
    (lambda s: dict(opt_state={k: fs.AdamWState(v.count, v.exp_avg.half(), v.exp_avg_sq)
                               for k, v in s.opt_state.items()}), r"opt_state\['.*'\].exp_avg is torch.float16"),
    (lambda s: dict(buffers={}), r"buffers lacks 'shift'"),
]


@pytest.mark.parametrize("case", range(len(REPLACE)))
def test_replace_checks_what_it_is_given(case):
    state = _state()
    change, fragment = REPLACE[case]
    with pytest.raises(fs.ArgumentError, match=fragment):
        state.replace(**change(state))
    state.replace(step=torch.tensor(4), params=dict(state.params))  # right ones pass


# --- inputs that cannot train -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fragment", [
    (dict(lr=float("nan")), r"lr=nan.*finite numbers >= 0"), (dict(lr=float("inf")), r"lr=inf"),
    (dict(eps=float("nan")), r"eps=nan"), (dict(weight_decay=float("inf")), r"weight_decay=inf"),
    (dict(betas=(0.9, float("nan"))), r"each beta must be in \[0, 1\)"), (dict(betas=0.9), r"betas must be two")])
def test_non_finite_or_malformed_hyperparameters_are_refused(kwargs, fragment):
    with pytest.raises(fs.FshardError, match=fragment):
        fs.adamw(**kwargs)


INIT_MISUSE = [  # (arguments of fs.init, the error type, the message fragment)
    (lambda m: ("model", fs.Mesh.local(), fs.adamw()), fs.ArgumentTypeError, "model must be a torch.nn.Module"),
    (lambda m: (m, None, fs.adamw()), fs.ArgumentTypeError, r"fs.Mesh.local\(\) for one rank"),
    (lambda m: (m, fs.Mesh.local(), torch.optim.AdamW(m.parameters())), fs.ArgumentTypeError,
     "a torch.optim optimizer cannot be used"),
    (lambda m: (m, fs.Mesh.local(), fs.adamw(), dict(units="blocks.0")), fs.ArgumentTypeError, r"units=\['blocks.0'"),
    (lambda m: (m, fs.Mesh.local(), fs.adamw(), dict(units=["nope"])), fs.InitError, "'nope' is not a submodule"),
    (lambda m: (m, fs.Mesh.local(), fs.adamw(), dict(init_fn=3)), fs.ArgumentTypeError, r"init_fn\(module\)"),
    (lambda m: (m, fs.Mesh.local(), fs.adamw(), dict(seed="0")), fs.ArgumentTypeError, "seed must be an int"),
    (lambda m: (m, fs.Mesh.local(), fs.adamw(), dict(align_bytes=3)), fs.ArgumentError, "multiple of 16"),
    (lambda m: (torch.nn.ReLU(), fs.Mesh.local(), fs.adamw()), fs.InitError, "has no parameters"),
]


@pytest.mark.parametrize("case", range(len(INIT_MISUSE)))
def test_init_misuse_is_an_fshard_error_naming_the_fix(case):
    args, kind, fragment = INIT_MISUSE[case]
    args = args(Awkward())
    with pytest.raises(kind, match=fragment):
        fs.init(*args[:3], **(args[3] if len(args) > 3 else {}))


def test_a_loss_with_no_path_to_a_parameter_is_refused_and_changes_nothing():
    state = _state()
    snap = ft.snapshot(state)
    for detached in (lambda m, b: awkward_loss(m, b).detach(), lambda m, b: torch.tensor(1.0),
                     lambda m, b: _no_grad(awkward_loss, m, b)):
        with pytest.raises(fs.LossError, match=r"no path to any trainable parameter.*step.eval"):
            fs.compose(detached)(state, next(awkward_batches(2, 1)))
    ft.check_unchanged(state, snap)
    fs.compose(awkward_loss)(state, next(awkward_batches(2, 1)))  # still trains


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


class _Lazy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.LazyLinear(3)

    def forward(self, x):
        return self.b(self.a(x)).square().mean()


class _MadeInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.extra = torch.nn.Parameter(torch.ones(4))
        return (self.a(x) * self.extra).square().mean()


def test_parameters_created_in_forward_are_refused():
    with pytest.raises(fs.InitError, match=r"uninitialized \(lazy\) parameters \['b.weight'.*dummy batch"):
        fs.init(_Lazy(), fs.Mesh.local(), fs.adamw())
    torch.manual_seed(0)
    state = fs.init(_MadeInForward(), fs.Mesh.local(), fs.adamw())
    snap = ft.snapshot(state)
    with pytest.raises(fs.InitError, match=r"forward created parameters that fs.init never saw: \['extra'"):
        fs.compose(lambda m, x: m(x))(state, torch.randn(2, 4))
    ft.check_unchanged(state, snap)


# --- concurrent steps ---------------------------------------------------------------------------------------------

def test_a_concurrent_step_is_refused_and_the_running_one_is_unaffected():
    state = _state()
    batch = next(awkward_batches(2, 1))
    expected, _ = fs.compose(awkward_loss)(state, batch)
    inside, tried = threading.Event(), threading.Event()

    def held(m, b):  # the first step waits inside its forward until the second has tried
        inside.set()
        assert tried.wait(30)
        return awkward_loss(m, b)

    step, other_step, errors, results = fs.compose(held), fs.compose(awkward_loss), [], []
    first = threading.Thread(target=lambda: results.append(step(state, batch)))
    first.start()
    assert inside.wait(30)
    for attempt in (lambda: step(state, batch),  # the same step function
                    lambda: other_step(state, batch),  # another one, on a state of the same fs.init
                    lambda: other_step.eval(state, batch)):
        try:
            attempt()
        except fs.ConcurrentStepError as e:
            errors.append(str(e))
    tried.set()
    first.join(30)
    assert len(errors) == 3, errors
    assert "already running a step in another thread" in errors[0] and "compose one per thread" in errors[0]
    assert "share one model template" in errors[1] and "fs.init the model again" in errors[1]
    (new, _), = results
    for a, b in zip(new.params.values(), expected.params.values()):
        assert torch.equal(a, b)  # the running step's result is what it would have been alone
    fs.compose(awkward_loss)(state, batch)  # and the lock is released


def test_concurrent_steps_on_separate_inits_run_in_parallel_bitwise():
    states = [_state() for _ in range(2)]  # the same values, separate templates
    batch = next(awkward_batches(2, 1))
    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, fs.compose(awkward_loss)(states[i], batch)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    alone, _ = fs.compose(awkward_loss)(states[0], batch)
    for new, _ in results:
        for a, b in zip(new.params.values(), alone.params.values()):
            assert torch.equal(a, b)


# --- the store's disk needs ---------------------------------------------------------------------------------------

def _store_peak(tmp_path, donate: bool, overlap: bool, steps: int = 4) -> tuple[float, float, float]:
    """Peak bytes on disk of an NVMe store (allocated blocks, sampled every millisecond while ``steps`` steps run)
    over the bytes of the moments it holds, the same ratio at the end, and step.plan's bound for the second step on
    (``store/peak_bytes``) over the moments."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    state = fs.init(model, fs.Mesh.local(), fs.adamw())
    moments = sum(2 * s.exp_avg.nbytes for s in state.opt_state.values())
    d = tmp_path / f"store-{donate}-{overlap}"
    du = lambda: sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file())  # noqa: E731
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], du())
            except FileNotFoundError:  # a slot file removed while listed
                pass
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with fs.NVMeStore(d) as store, fs.compose(lambda m, x: m(x).square().mean(),
                                                   fs.offload_state(store, overlap_backward=overlap),
                                                   donate=donate) as step:
            bound = None
            for i in range(steps):
                batch = torch.randn(4, 256)
                if i == 1:  # the moments are in the store from the first step on
                    bound = step.plan(state, batch).bounds["store/peak_bytes"]
                state, _ = step(state, batch)
            end = du()
    finally:
        stop.set()
        sampler.join()
    return peak[0] / moments, end / moments, bound / moments


def test_the_stores_disk_peak_is_what_the_design_and_the_plan_say(tmp_path):
    """design/OFFLOAD.md: a step writes each updated unit's new version beside the input's, so the store peaks at 2x
    the moments (the version a step replaced is deleted at the next step's first store operation, before it writes);
    with donate=True chunks are written back in place (also by updates begun during backward): the moments plus
    depth + 1 chunk items (the writes in flight, and the slot the last one freed, kept for reuse)."""
    for donate, overlap in ((False, True), (False, False)):
        peak, end, bound = _store_peak(tmp_path, donate, overlap)
        assert 1.9 < peak <= 2.05 and end <= 2.05, (donate, overlap, peak, end)
        assert bound == 2.0 and peak <= bound * 1.01, (donate, overlap, peak, bound)  # step.plan says so
    for overlap in (False, True):
        peak, end, bound = _store_peak(tmp_path, True, overlap)  # 6 units of one chunk item each, depth 2
        assert bound == 1 + 3 / 6 and peak <= bound * 1.01, (overlap, peak, bound)  # + depth + 1 items in flight


def test_a_full_disk_says_how_much_the_store_needs_and_what_lowers_it(tmp_path):
    class Full(fs.CPUStore):
        directory = str(tmp_path)
        fail = False

        def stream(self, keys, depth=2, writeback=False, max_writes=None):
            if self.fail:
                raise fs.StoreError(f"write failed (No space left on device) in {tmp_path}")
            return super().stream(keys, depth=depth, writeback=writeback, max_writes=max_writes)

    state = _state()
    store = Full()
    with fs.compose(awkward_loss, fs.offload_state(store, overlap_backward=False)) as step:
        s1, _ = step(state, next(awkward_batches(2, 1)))
        snap = ft.snapshot(s1)
        store.fail = True
        with pytest.raises(fs.OffloadError, match=r"needs about [\d.]+ (MiB|GiB) at its peak \(2x its .* free\. .*"
                                                  r"fraction=.*donate=True and .*overlap_backward=False"):
            step(s1, next(awkward_batches(2, 1)))
        ft.check_unchanged(s1, snap)


# --- checkpoints: nothing deleted that fshard did not write, nothing run that a checkpoint holds (issue #37) -------

def _ckpt_state(step: int = 0, **kw):
    torch.manual_seed(0)
    state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw(**kw))
    return state.replace(step=torch.tensor(step))


def _same(a, b) -> bool:
    return int(a.step) == int(b.step) and all(torch.equal(x, y) for x, y in zip(a.params.values(),
                                                                                 b.params.values()))


def _tree(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_save_refuses_a_path_that_is_not_an_fshard_checkpoint_and_deletes_nothing(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    (run / "logs" / "train.log").write_text("loss 3.2")
    before = _tree(tmp_path)
    state = _ckpt_state(3)
    with pytest.raises(fs.CheckpointError, match=r"run exists and is not an fshard checkpoint \(a directory holding "
                                                 r"logs, notes.txt\).*nothing was written or deleted.*new path"):
        fs.save(run, state)
    (tmp_path / "file").write_text("x")
    with pytest.raises(fs.CheckpointError, match=r"file exists and is not an fshard checkpoint \(a file\)"):
        fs.save(tmp_path / "file", state)
    (tmp_path / "c.partial").mkdir()  # a user's directory that only looks like a save's
    (tmp_path / "c.partial" / "data.bin").write_bytes(b"1234")
    with pytest.raises(fs.CheckpointError, match=r"c.partial exists and was not made by fs.save"):
        fs.save(tmp_path / "c", state)
    (tmp_path / "d.old").mkdir()
    (tmp_path / "d.old" / "keep.txt").write_text("keep")
    with pytest.raises(fs.CheckpointError, match=r"d.old exists and is not an fshard checkpoint"):
        fs.save(tmp_path / "d", state)
    assert _tree(tmp_path) == {**before, "file": b"x", "c.partial/data.bin": b"1234", "d.old/keep.txt": b"keep"}
    (tmp_path / "empty").mkdir()  # what is fshard's, or nothing, is replaced
    fs.save(tmp_path / "empty", state)
    fs.save(tmp_path / "empty", _ckpt_state(4))
    assert int(fs.load(tmp_path / "empty", like=state).step) == 4


def test_keep_last_keeps_the_checkpoint_just_written_and_only_rotates_its_series(tmp_path):
    run = tmp_path / "run"
    fs.save(run / "step5", _ckpt_state(5))  # an earlier run's
    fs.save(run / "step5b", _ckpt_state(5))  # another series
    (run / "step7").mkdir()  # the user's, named like a checkpoint
    (run / "step7" / "notes.txt").write_text("mine")
    assert fs.save(run / "step1", _ckpt_state(1), keep_last=2) == str(run / "step1")
    assert sorted(p.name for p in run.iterdir()) == ["step1", "step5", "step5b", "step7"]
    assert fs.latest(run) == str(run / "step1")  # the one committed last, not the highest step
    fs.save(run / "step2", _ckpt_state(2), keep_last=2)
    assert sorted(p.name for p in run.iterdir()) == ["step1", "step2", "step5b", "step7"]
    fs.save(run / "step3", _ckpt_state(3), keep_last=1)
    assert sorted(p.name for p in run.iterdir()) == ["step3", "step5b", "step7"]
    assert int(fs.load(fs.latest(run), like=_ckpt_state()).step) == 3
    assert int(fs.load(run / "step5b", like=_ckpt_state()).step) == 5
    assert (run / "step7" / "notes.txt").read_text() == "mine"


class _Runs:
    """Unpickled, opens ``path`` for writing: a marker that code in a checkpoint ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _crafted(ckpt, marker, variant: str) -> None:
    import json
    import pickle
    from fshard._ckpt_files import crc
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Runs(marker)))
    if variant == "no manifest":
        (ckpt / "fshard.json").unlink(missing_ok=True)
    elif variant in ("recomputed CRC", "empty file list"):
        m = json.loads((ckpt / "fshard.json").read_text())
        m["files"] = {**m["files"], ".metadata": crc(ckpt / ".metadata")} if variant == "recomputed CRC" else {}
        (ckpt / "fshard.json").write_text(json.dumps(m))


@pytest.mark.parametrize("variant", ["no manifest", "recomputed CRC", "empty file list", "FSDP2-style"])
def test_loading_a_crafted_metadata_file_runs_nothing(tmp_path, variant):
    import torch.distributed.checkpoint as dcp
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    state = _ckpt_state(2)
    if variant == "FSDP2-style":  # a plain DCP checkpoint in FSDP2's layout: no fshard.json
        model = Awkward()
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
        assert int(fs.load(ckpt, like=state).step) == 2  # (it loads, before it is crafted: like's step)
    else:
        fs.save(ckpt, state)
    _crafted(ckpt, marker, variant)
    with pytest.raises(fs.CheckpointError, match=r"\.metadata is not a DCP metadata file .*open.*nothing in it "
                                                 r"was run"):
        fs.load(ckpt, like=state)
    assert not marker.exists()


def test_a_crafted_byte_entry_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    state = _ckpt_state(1)
    fs.save(tmp_path / "c", state.replace(transform_state={"evil": _Runs(marker)}))
    assert not marker.exists()  # (pickling it ran nothing either)
    with pytest.raises(fs.CheckpointError, match=r"names a class that loading does not run.*add_safe_globals"):
        fs.load(tmp_path / "c", like=state)
    assert not marker.exists()


def test_a_full_disk_removes_the_partial_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    import torch.distributed.checkpoint.filesystem as fsys

    import fshard._ckpt_files as ck
    fs.save(tmp_path / "a", _ckpt_state(1))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    for where, target, name in (("data", fsys, "_write_item"), ("manifest", ck, "_write_json")):
        with monkeypatch.context() as mp:
            real = getattr(target, name)
            mp.setattr(target, name, full if where == "data" else
                       (lambda p, obj: full() if p.name == "fshard.json" else real(p, obj)))
            with pytest.raises(fs.CheckpointError, match="No space left on device"):
                fs.save(tmp_path / "a", _ckpt_state(7))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a"], where  # no a.partial left
        assert int(fs.load(tmp_path / "a", like=_ckpt_state()).step) == 1, where


def _edit_manifest(ckpt, **changes):
    import json
    m = json.loads((ckpt / "fshard.json").read_text())
    (ckpt / "fshard.json").write_text(json.dumps({**m, **changes}))


def test_a_newer_format_or_an_edited_manifest_is_refused(tmp_path):
    state = _ckpt_state(1)
    fs.save(tmp_path / "c", state)
    _edit_manifest(tmp_path / "c", format=99)
    with pytest.raises(fs.CheckpointError, match=r"checkpoint format 99, newer than this fshard reads \(format 1 "
                                                 r"and older\); upgrade fshard"):
        fs.load(tmp_path / "c", like=state)
    _edit_manifest(tmp_path / "c", format=1, world_size=7)
    with pytest.raises(fs.CheckpointError, match=r"says world_size 7, but the checkpoint holds the files of ranks "
                                                 r"\[0\].*edited or damaged"):
        fs.load(tmp_path / "c", like=state)
    _edit_manifest(tmp_path / "c", world_size=1, params={"up.weight": [5, 8]})
    with pytest.raises(fs.CheckpointError, match=r"gives up.weight the shape \(5, 8\), the metadata \(37, 8\)"):
        fs.load(tmp_path / "c", like=state)
    with pytest.raises(fs.CheckpointError, match=r"fs.load\(None, like\).*fs.latest\(directory\) returns None"):
        fs.load(fs.latest(tmp_path / "nothing"), like=state)
    (tmp_path / "c" / "fshard.json").unlink()  # without a manifest (as FSDP2's), a missing data file is named too
    (tmp_path / "c" / "__0_0.distcp").unlink()
    with pytest.raises(fs.CheckpointError, match=r"'__0_0.distcp', which is not a file in the checkpoint"):
        fs.load(tmp_path / "c", like=state)


def test_load_keeps_likes_hyperparameters_and_warns_naming_each_that_differs(tmp_path):
    import warnings
    fs.save(tmp_path / "c", _ckpt_state(3, lr=1e-3, weight_decay=0.1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fs.load(tmp_path / "c", like=_ckpt_state(0, lr=1e-3, weight_decay=0.1))
    assert not [w for w in seen if "hyperparameters" in str(w.message)]  # the same ones: no warning
    with pytest.warns(UserWarning, match=r"hyperparameters differ: lr 0.001 in the checkpoint, 0.01 in like "
                                         r"\(\d+ parameters, e.g. .*\); weight_decay 0.1 in the checkpoint, 0.0 in "
                                         r"like.*training continues with like's optimizer"):
        loaded = fs.load(tmp_path / "c", like=_ckpt_state(0, lr=1e-2, weight_decay=0.0))
    assert loaded.spec.optimizer.lr == 1e-2 and int(loaded.step) == 3
