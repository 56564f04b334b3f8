"""No abort at exit (issue #38): fshard's processes leave through the interpreter's exit with code 0.

The example's runs aborted at exit ("terminate called without an active exception", SIGABRT) 3 times in 20 under
load, and scripts that caught an fshard error and called ``destroy_process_group()`` 4 times in 9: after
``destroy_process_group()`` gloo's process group and its threads stayed alive (held by reference cycles of
fshard's objects, or by a state kept in a module global) into interpreter finalization, where gloo's worker, letting
go of a finished all-gather whose tensors the caller had dropped, freed their Python objects: it asked for the GIL,
was ended by ``pthread_exit``, and that inside the work's destructor is ``std::terminate`` (the backtrace:
design/ARCHITECTURE.md, "Exit and teardown").

The fix is checked directly: a gloo mesh keeps the last small collectives' tensors (``Mesh.hold``) and its
finalizer waits until gloo has let go of them (``_release_held``), and in a failed step on 2 ranks the check's and
the exchange's tensors are held, let go by gloo, and waited for when the mesh dies. Each rank of the example also
checks the teardown order itself, where the abort was a matter of timing: no ``fs.Mesh`` is left once the run's
objects are dropped, and gloo's and the store's threads are gone once ``destroy_process_group()`` returns, which
failed on every run before the fix. Then the exit itself: 1 run of each script, every rank exiting 0 (the abort
was 3 runs in 20, 4 in 9 and 1 in 12: repeating blind runs is no test of a fix whose mechanism is checked above).

Each run is a pair of ranks forked from one process that imported torch and fshard once (tests/_exit_runs.py; the
three scripts' runs in one such process): a fresh interpreter per rank cost 10-30 s of
imports on a loaded 2-core machine; a forked rank runs the same code from ``train_gpt.main`` on, and leaves the
same way (``sys.exit`` at top level: atexit, then finalization). A busy loop at the lowest priority runs beside
them, so that the cores stay busy whether other tests run or not (the load under which the abort was seen)."""
from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


RUNS = 1  # of each script


def _exits() -> str:
    """The three scripts' runs, in one process (tests/_exit_runs.py) beside a busy loop: its whole output."""
    # the load, at the lowest priority: it takes what the other tests leave of the cores (in the suite, the other
    # pytest-xdist worker is most of the load; at normal priority this loop took a core from it for 58 s)
    busy = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\nwhile True: pass"])
    try:
        proc = subprocess.run([sys.executable, os.path.join(_HERE, "_exit_runs.py"),
                               "example", str(RUNS), "fails", str(RUNS), "kept", str(RUNS)],
                              capture_output=True, text=True, timeout=540,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    finally:
        busy.kill()
        busy.wait()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def _runs(out: str, mode: str) -> None:
    lines = [line for line in out.splitlines() if line.startswith(f"{mode} run ")]
    assert len(lines) == RUNS, (mode, out[-5000:])
    bad = [line for line in lines if line.split(": ", 1)[1] != "rank 0 exit 0, rank 1 exit 0"]
    assert not bad, (bad, out[-5000:])


@pytest.mark.slow
@pytest.mark.timeout(600)  # 3 runs: 3.5 s of CPU each (both ranks); 13 s of wall time under heavy load
def test_the_example_and_scripts_that_catch_an_fshard_error_exit_with_code_0_under_load():
    """One process for the three scripts (one import of torch and fshard; one test, so that pytest-xdist never
    runs them twice on two workers): the example; a script that catches an fshard error, then destroys the group;
    and the same with its state and step kept (module globals), so the group and gloo's threads live into
    finalization: the failed step's last collectives (the check, the exchange of descriptors) let their tensors go
    only once gloo's thread has (``Mesh.hold``); before that, this script aborted in about 1 run in 12 (the
    backtrace in the design)."""
    out = _exits()
    for mode in ("example", "fails", "kept"):
        _runs(out, mode)
    assert "terminate called" not in out and "Fatal Python error" not in out, out[-5000:]


def test_released_waits_until_no_one_else_holds_the_tensor():
    """``released``: gloo's thread holds a finished collective's tensors a moment after wait() returns; the caller
    keeps them until it has let go (else their Python objects are freed on that thread, which takes the GIL)."""
    import threading
    import time

    import torch

    from fshard.dist._mesh import released
    t = torch.zeros(8)
    other = [t.view(-1)]  # a second holder of t's TensorImpl, as a gloo work is
    threading.Timer(0.2, other.clear).start()
    t0 = time.monotonic()
    assert t._use_count() > 1 and released(t) and t._use_count() == 1
    assert time.monotonic() - t0 >= 0.15  # it waited for the holder
    view = t.view(-1)
    assert not released(t, timeout_s=0.05) and t._use_count() > 1 and view.shape == (8,)  # bounded: left held
    assert released(torch.ones(2)) is True  # nothing else holds it: no wait


def test_the_background_worker_is_ended_by_close_and_by_its_finalizer_when_the_mesh_dies():
    """Mesh.background(): one worker per mesh until ``mesh.close()``, which waits for its jobs and ends its thread;
    a later call makes a new one. A mesh dropped without close(): its finalizer ends the thread as it dies (and at
    exit, before finalization, if it lives that long). The frozen mesh has no mutable field: what changes is in its
    ``runtime``."""
    import dataclasses
    import gc
    import threading
    import time

    import fshard as fs
    from fshard.dist._mesh import MeshRuntime

    def alive():
        return [t for t in threading.enumerate() if t.name.startswith("fshard-background")]

    mesh = fs.Mesh.local()
    mutable = [f.name for f in dataclasses.fields(mesh) if f.name != "runtime"
               and isinstance(getattr(mesh, f.name), (list, dict, set, bytearray, MeshRuntime))]
    assert mutable == [] and isinstance(mesh.runtime, MeshRuntime)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.runtime = MeshRuntime()
    bg = mesh.background()
    assert mesh.background() is bg and bg.group is None  # (a local mesh has no group to destroy)
    slow = bg.submit(lambda: time.sleep(0.2) or 7)
    assert len(alive()) == 1
    mesh.close()
    assert slow.done() and slow.result() == 7 and bg.closed and alive() == []  # waited for its job, then ended
    mesh.close()  # idempotent
    again = mesh.background()
    assert again is not bg and again.submit(lambda: 8).result() == 8 and len(alive()) == 1
    del mesh, again
    gc.collect()
    assert alive() == []  # the finalizer joined the thread as the mesh died


def test_a_gloo_mesh_holds_the_last_tensors_and_its_finalizer_waits_for_gloo_to_let_go():
    """``Mesh.hold``: on gloo the mesh keeps the last ``_HELD`` tensors (no other backend: nothing kept); when the
    mesh dies its finalizer waits until no one else (gloo's thread, here a view on a timer's thread) holds them, so
    that they are freed on the thread that drops the mesh, never on gloo's."""
    import threading
    import time
    import weakref

    import torch

    import fshard as fs
    from fshard.dist._mesh import _HELD
    for backend in ("local", "nccl"):
        mesh = fs.Mesh(0, 2, backend, torch.device("cpu"))
        mesh.hold(torch.zeros(1))
        assert len(mesh.runtime.held) == 0, backend
    mesh = fs.Mesh(0, 2, "gloo", torch.device("cpu"))
    ts = [torch.full((2,), float(i)) for i in range(_HELD + 4)]
    mesh.hold(*ts[:3])
    mesh.hold(*ts[3:])
    assert [float(t[0]) for t, _ in mesh.runtime.held] == list(range(4, _HELD + 4))  # the last _HELD, in order
    # each is kept by its Python object and by an anchor in C++: two owners, so another thread's is never the one
    # before last (that thread would decref the Python object, taking the GIL: Mesh.hold)
    assert all(t._use_count() == 2 for t, _ in mesh.runtime.held)
    del ts
    for delay in (0.2, 0.05, 0.0):  # (0.05: the other thread's drop racing the finalizer's wait)
        t = torch.zeros(8)
        freed, where = weakref.ref(t), []
        weakref.finalize(t, lambda: where.append(threading.current_thread()))  # the thread that frees it
        other = [t.view(-1)]  # a second holder of t's TensorImpl, as a gloo work is
        mesh.hold(t)
        del t
        threading.Timer(delay, other.clear).start()
        t0 = time.monotonic()
        del mesh  # its finalizer: waits for the view's holder to let go, then frees t here
        assert time.monotonic() - t0 >= 0.75 * delay and other == [] and freed() is None, delay
        assert where == [threading.main_thread()], (delay, where)
        mesh = fs.Mesh(0, 2, "gloo", torch.device("cpu"))
    x, sparse = torch.zeros(2), torch.zeros(2, 2).to_sparse()
    mesh.hold(x, x, sparse)  # x held twice, two anchors; DLPack exports no sparse tensor: held without one
    assert [a is None for _, a in mesh.runtime.held][-3:] == [False, False, True]
    t0 = time.monotonic()
    del mesh  # nothing else holds them: no wait
    assert time.monotonic() - t0 < 0.5 and x._use_count() == 1 and sparse._use_count() == 1


def _failed_step_holds(_):
    """A step that fails on rank 1, caught on both: what the mesh held, and what its finalizer was given."""
    import gc

    import torch

    import fshard as fs
    from fshard.dist import _mesh
    from fshard.dist._agreement import _DESC_BYTES
    finalized, real = [], _mesh._release_held

    def spy(held, callbacks):  # the finalizer's function (looked up when hold() registers it): after its wait
        real(held, callbacks)
        finalized.append((len(held), all(t._use_count() == 2 for t, _ in held)))  # the held object and its anchor

    from _exit_runs import fail_a_step
    _mesh._release_held = spy
    mesh = fs.Mesh.from_env()
    state, step, error = fail_a_step(mesh)
    held = [t for t, _ in mesh.runtime.held]
    descriptors = [bytes(t.tolist()).rstrip(b"\0").decode() for t in held
                   if t.dtype == torch.uint8 and t.numel() == _DESC_BYTES]
    let_go = _mesh.released(*held, owners=2)  # gloo lets go of them (bounded wait): the object and its anchor left
    del held, state, step, mesh
    gc.collect()
    return error, descriptors, let_go, finalized


def test_a_failed_steps_last_collectives_are_held_until_gloo_lets_go_and_the_mesh_waits_for_them():
    """The failure path's collectives (the check, the all-gather of descriptors) keep their tensors on the mesh:
    after the failed step the mesh holds the descriptors of both ranks, gloo lets go of every held tensor, and the
    mesh's finalizer runs when the run's objects are dropped, with them."""
    from _dist import run_ranks
    for rank, (error, descriptors, let_go, finalized) in enumerate(run_ranks(_failed_step_holds, 2, None)):
        assert error == ("RankFailedError" if rank == 0 else "StepError"), (rank, error)
        # this rank's descriptor, and the gathered descriptors of both ranks: rank 1's names its failure
        assert any(d.startswith("failed") and "boom" in d for d in descriptors), (rank, descriptors)
        assert len(descriptors) >= 3 and let_go, (rank, descriptors, let_go)
        assert len(finalized) == 1 and finalized[0][0] >= 4 and finalized[0][1], (rank, finalized)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object",
                "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
                "reduce", "reduce_scatter_tensor", "scatter_object_list")  # (fshard's calls, and DCP's entry points)


def _issued(tmp):
    """Every collective of a run, as fshard calls ``torch.distributed``: whether saved-tensor hooks were on the
    thread's stack when it was issued (torch copies them into the work: fshard/dist/_bare.py)."""
    import torch
    import torch.distributed as dist

    import fshard as fs
    from _exit_runs import fail_a_step
    top = torch._C._autograd._top_saved_tensors_default_hooks
    seen, in_forward = [], []
    for name in filter(lambda n: hasattr(dist, n), _COLLECTIVES):  # (fshard looks them up on the module at each call)
        def spy(*args, _real=getattr(dist, name), _name=name, **kwargs):
            seen.append((_name, top(True) is not None, args[0].numel() if args and torch.is_tensor(args[0]) else 0))
            return _real(*args, **kwargs)
        setattr(dist, name, spy)
    mesh = fs.Mesh.from_env()
    opt = fs.partition({"muon": fs.muon(0.02), "adamw": fs.adamw()}, lambda n, p: "muon" if p.ndim == 2 else "adamw")
    state = fs.init(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]), mesh, opt)

    def loss_fn(m, x):
        in_forward.append(top(True) is not None)  # fshard's hooks are in force in the forward (and a user's)
        return m(x).square().mean()

    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(0.001), fs.mixed_precision(torch.bfloat16),
                    timeline=True) as step, \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # a user's, around everything
        for _ in range(2):
            state, metrics = step(state, torch.randn(4, 8))
        fs.save(os.path.join(tmp, "ckpt"), state)
        fs.load(os.path.join(tmp, "ckpt"), state)
        fs.timeline(metrics, mesh=mesh)
    fail_a_step(mesh)
    return seen, in_forward


def test_no_collective_carries_the_steps_saved_tensor_hooks(tmp_path):
    """A step's forward and backward run under fshard's saved-tensor hooks (bound methods of the step's run, which
    holds the mesh and its process group), and torch copies the hooks in force into every work it makes: gloo's
    thread then dropped them, taking the GIL, after the work finished, which aborted a script exiting at that moment
    and kept the group alive past ``destroy_process_group()``. Every collective fshard issues in a step (gathers
    ahead, bucketed reductions, Muon's exchange, checks, the vote), in ``fs.save`` and ``fs.load`` (DCP's own
    collectives too), and in a failing step's exchange is issued with none on the stack, even inside a user's own
    hooks."""
    from _dist import run_ranks
    for rank, (seen, in_forward) in enumerate(run_ranks(_issued, 2, str(tmp_path))):
        assert in_forward and all(in_forward), (rank, in_forward)  # (the premise: hooks were in force)
        kinds = {name for name, _, _ in seen}
        assert {"all_reduce", "all_gather", "all_to_all_single"} <= kinds, (rank, kinds)
        assert kinds & {"all_gather_single", "all_gather_into_tensor"}, (rank, kinds)  # (the checks)
        # the gathers (broadcasts on gloo, all-gathers under FSHARD_GATHER=all_gather): larger than a check's 2 x 2
        assert any(name in ("broadcast", "all_gather_single", "all_gather_into_tensor") and n > 4
                   for name, _, n in seen), seen
        assert kinds & {"gather_object", "broadcast_object_list", "scatter_object_list"}, (rank, kinds)
        # the buckets' reductions: on gloo at two ranks an exchange of sections (Comm.reduce_each), larger than the
        # checks' and the loss's few numbers; the blocking reduce's reduce-scatter
        assert any(name in ("all_to_all_single", "reduce", "reduce_scatter_tensor") and n > 16
                   for name, _, n in seen), seen
        assert [name for name, hooked, _ in seen if hooked] == [], (rank, seen)


def test_a_gloo_mesh_waits_for_gloo_to_run_and_let_go_of_the_completion_callbacks_it_watches():
    """``Mesh.hold_callback``: a step's gathers give gloo's futures a Python callback (the completion stamp), which
    gloo's thread runs and drops, with the GIL, maybe after ``wait()`` returned; the mesh's finalizer waits until
    every watched callback is gone (here a timer's thread holds one 0.2 s), so none is left to gloo at finalization.
    Other backends watch nothing."""
    import threading
    import time

    import torch

    import fshard as fs
    for backend in ("local", "nccl"):
        mesh = fs.Mesh(0, 2, backend, torch.device("cpu"))
        mesh.hold_callback(lambda: None)
        assert mesh.runtime.callbacks == [] and mesh.runtime.finalizer is None, backend
    mesh = fs.Mesh(0, 2, "gloo", torch.device("cpu"))
    for _ in range(100):  # finished ones are let go of as more come
        mesh.hold_callback(lambda: None)
    assert len(mesh.runtime.callbacks) <= 64
    callback = (lambda: None)
    other = [callback]  # gloo's future, as it holds the callback until its thread has run it
    mesh.hold_callback(callback)
    del callback
    threading.Timer(0.2, other.clear).start()
    t0 = time.monotonic()
    del mesh
    assert time.monotonic() - t0 >= 0.15 and other == []


@contextlib.contextmanager
def _collector_off():
    """The cyclic garbage collector off, after a collection: what dies in the block dies by reference counting,
    as it must for ``destroy_process_group()`` to destroy the group then (a cycle waits for a collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _frames_of(error: BaseException) -> list:
    """Every frame in the tracebacks of ``error`` and of its causes and contexts."""
    frames, todo, seen = [], [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
    return frames


@pytest.mark.parametrize("how", ["raises", "reaches_in"])
def test_a_failed_steps_error_holds_no_generator_frame_of_fshard_and_frees_the_mesh_without_a_collection(how):
    """Session 26, on the GPU machine (Python 3.12): after a failed step was caught and dropped, the mesh (and
    through it the process group and gloo's threads) lived on until a garbage collection. A generator context
    manager that catches the exception thrown into it and raises another keeps its finished frame linked to
    contextlib's ``__exit__`` frame (``f_back``, Python >= 3.12: cpython#100964, #129280), whose ``value`` is the
    caught exception, whose traceback holds the generator's frame: a cycle, and every frame of the failed step
    with it. So fshard handles errors in class context managers (the step's envelope, the meta-read translation).
    Checked on any Python: no frame of an fshard generator in the error's tracebacks; and, with the collector off,
    the mesh and the model die with the error (what fails on 3.12 with the cycle)."""
    import inspect
    import weakref

    import torch

    import fshard as fs

    def failed():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        mesh = fs.Mesh.local()
        state = fs.init(model, mesh, fs.adamw(), units=[model[0], model[1]] if how == "reaches_in" else None)

        def loss_fn(m, x):
            if how == "raises":
                raise ValueError("boom")
            return (x * m[0].weight).sum()  # a unit's parameter read outside its call: UnboundParameterError

        with fs.compose(loss_fn) as step:
            try:
                step(state, torch.randn(4, 4))
            except fs.FshardError as e:
                made = [f for f in _frames_of(e) if f.f_code.co_flags & inspect.CO_GENERATOR
                        and os.sep + "fshard" + os.sep in f.f_code.co_filename]
                kind = type(e).__name__
        return [f"{f.f_code.co_filename}:{f.f_code.co_name}" for f in made], kind, weakref.ref(mesh), weakref.ref(model)

    with _collector_off():
        made, kind, mesh, model = failed()
        assert kind == ("StepError" if how == "raises" else "UnboundParameterError")
        assert made == [], f"the error passed through fshard generator frames {made}"
        assert mesh() is None and model() is None, "a reference cycle keeps the failed step's mesh and model"


def test_an_update_that_fails_in_the_offload_worker_frees_the_mesh_without_a_collection():
    """The worker's error sits in its future; its traceback holds the worker's frame, whose ``self`` is the work,
    which held the future: a cycle (on any Python) that kept the failed step and its mesh until a garbage collection
    (found by session 26's review). ``_Early.result`` lets go of the future before the error goes on."""
    import weakref

    import torch

    import fshard as fs

    class Boom(torch.optim.SGD):
        armed = False

        def step(self, closure=None):
            if Boom.armed and self.param_groups[0]["params"][0].numel() > 3:  # (not the probes' small parameters)
                raise ValueError("boom in the worker")
            return super().step(closure)

    def failed():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        mesh = fs.Mesh.local()
        state = fs.init(model, mesh, fs.optim.from_torch(Boom, lr=0.1, momentum=0.9), units=[model[0], model[1]])
        store = fs.CPUStore()
        kind = None
        with fs.compose(lambda m, x: m(x).sum(), fs.offload_state(store, overlap_backward=True)) as step:
            state, _ = step(state, torch.randn(2, 4))
            Boom.armed = True
            try:
                step(state, torch.randn(2, 4))
            except fs.FshardError as e:
                kind = (type(e).__name__, "boom in the worker" in str(e))
        store.close()
        return kind, weakref.ref(mesh), weakref.ref(step)

    with _collector_off():
        kind, mesh, step = failed()
        assert kind == ("OffloadError", True)
        assert mesh() is None and step() is None, "a reference cycle keeps the failed step and its mesh"


@pytest.mark.parametrize("how", ["read_into", "get"])
def test_a_store_that_fails_mid_step_frees_the_step_and_mesh_without_a_collection(how):
    """A store's failure in a step, caught and dropped: ``read_into`` raising under parameter offload (a unit's read
    ahead, run/_unit.py, drops its future), or ``get`` handing back a failed handle for the moments (``Handle.wait``
    raises a copy of its kept error, and ``reap`` lets go of its own frame's references)."""
    import weakref

    import torch

    import fshard as fs
    from fshard.store._handle import Handle

    class Flaky(fs.CPUStore):
        armed = False

        def read_into(self, key, out):
            if Flaky.armed and how == "read_into":
                raise OSError("read failed (simulated)")
            return super().read_into(key, out)

        def get(self, key, out=None):
            if Flaky.armed and how == "get":
                return Handle.failed("read", key, fs.errors.CorruptedItemError(f"cannot read {key!r} (simulated)"))
            return super().get(key, out)

    def failed():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        mesh = fs.Mesh.local()
        state = fs.init(model, mesh, fs.adamw(), units=[model[0], model[1]])
        store, kind = Flaky(), None
        offload = fs.offload_state(store, params=how == "read_into", overlap_backward=False)
        with fs.compose(lambda m, x: m(x).sum(), offload) as step:
            for _ in range(2):
                state, _ = step(state, torch.randn(2, 64))
            Flaky.armed = True
            try:
                step(state, torch.randn(2, 64))
            except fs.FshardError as e:
                kind = type(e).__name__, "(simulated)" in str(e) or "(simulated)" in str(e.__cause__)
            Flaky.armed = False
        store.close()
        return kind, weakref.ref(mesh), weakref.ref(step)

    with _collector_off():
        kind, mesh, step = failed()
        assert kind is not None and kind[1], kind
        assert mesh() is None and step() is None, "a reference cycle keeps the failed step and its mesh"


@pytest.mark.parametrize("waited", [True, False])
def test_a_failed_async_save_frees_the_state_and_mesh_without_a_collection(monkeypatch, tmp_path, waited):
    """A save that fails inside ``_write`` (here its checksums), its error caught from ``wait()`` and dropped, or its
    handle never waited for (the state keeps the handle: a donating step refuses the state until wait()). ``wait()``
    raises a copy of the kept error (its message and the save thread's frames, at each call), and ``_write`` clears
    its finished frames and drops its state and mesh before the error goes on: nothing leads back to the state."""
    import traceback
    import weakref

    import torch

    import fshard as fs
    import fshard.checkpoint._save as save_module

    def checksums_fail(*args):
        raise OSError("checksums failed (simulated)")

    monkeypatch.setattr(save_module, "crc_share", checksums_fail)

    def failed():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        mesh = fs.Mesh.local()
        state = fs.init(model, mesh, fs.adamw())
        handle, seen = fs.save(tmp_path / "ckpt", state, blocking=False), []
        for _ in range(2 if waited else 0):
            try:
                handle.wait()
            except OSError as e:
                seen.append((str(e), any(f.name == "checksums_fail" for f in traceback.extract_tb(e.__traceback__))))
        mesh.close()  # waits for the save
        assert handle.done() and not (tmp_path / "ckpt").exists()
        return seen, weakref.ref(mesh), weakref.ref(state)

    with _collector_off():
        seen, mesh, state = failed()
        assert seen == [("checksums failed (simulated)", True)] * (2 if waited else 0)
        assert mesh() is None and state() is None, "a reference cycle keeps the state and mesh of a failed save"
