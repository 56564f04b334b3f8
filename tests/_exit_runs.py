"""Process pairs that train and exit, for tests/test_exit.py (issue #38).

    python tests/_exit_runs.py MODE RUNS [MODE RUNS ...]       MODE: example | fails | kept

Imports torch, fshard and examples/train_gpt.py once, then, RUNS times for each MODE in turn, forks two ranks (so that a run costs its
work, not a 10-30 s import on a loaded machine) that rendezvous over gloo on a fresh port, as torchrun's workers
would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and leave through the interpreter's own exit (``sys.exit``
propagates to this file's top level: atexit hooks, then interpreter finalization, where the abort of issue #38
happened). Each rank:

- example: ``train_gpt.main`` (the tiny GPT, gather_ahead + bucket_reduce + bf16, ``--export``), then what the
  example's ``__main__`` does: ``dist.barrier()`` and ``dist.destroy_process_group()``;
- fails: a step whose loss_fn raises on rank 1, caught as ``fs.FshardError`` on both ranks, then
  ``dist.destroy_process_group()`` at once (no barrier), as a script that gives up would;
- kept: the same, with the state and the step kept alive past the interpreter's exit (as a script's module globals
  are), so the process group they hold, and gloo's threads, outlive ``destroy_process_group()`` into finalization:
  the condition under which the abort's backtrace was taken (design/ARCHITECTURE.md, "Exit and teardown").

In the example and the failing script, after ``destroy_process_group`` a rank checks that no ``fs.Mesh`` is left
(no reference cycle of fshard's objects, and no work gloo's thread has yet to destroy, holds one, and through it the
process group) and that torch's gloo and store threads are gone (the group was destroyed then, not left to
interpreter finalization); it exits 3 naming them if not. (In the failing script rank 0 kept its group in about 1
run in 8 until no collective carried the step's saved-tensor hooks: fshard/dist/_bare.py.) Prints one line per run:
``MODE run I: rank 0 STATUS, rank 1 STATUS`` (exit code or signal), for the test to read.
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import traceback
import warnings

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fshard as fs  # noqa: E402
import train_gpt  # noqa: E402

_TORCH_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")  # gloo's loop and run-loop threads, the TCPStore daemon


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread has just ended
            pass
    return names


def _example(rank: int, tmp: str) -> None:
    # the run directory both ranks share (the pair's parent and port name it), not the checkout's runs/gpt, whose
    # checkpoint the example would resume from
    run = os.path.join(tempfile.gettempdir(), f"fshard-exit-{os.getppid()}-{os.environ['MASTER_PORT']}")
    train_gpt.main(["--tiny", "--steps", "3", "--threads", "1", "--log-every", "0", "--run-dir", run,
                    "--export", os.path.join(tmp, "export.pt")])
    dist.barrier()  # as examples/train_gpt.py's __main__
    if rank == 0:
        shutil.rmtree(run, ignore_errors=True)
    dist.destroy_process_group()


_KEPT: list = []  # kept mode: what a script's module globals would hold until the interpreter's exit


def fail_a_step(mesh) -> tuple:
    """A step of 4 units whose loss_fn raises on rank 1, caught as ``fs.FshardError`` on every rank (also used by
    tests/test_exit.py in its ranks): returns the state, the closed step and the error's type name."""
    state = fs.init(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]), mesh, fs.adamw())

    def loss_fn(m, x):
        if mesh.rank == 1:
            raise ValueError("boom")
        return m(x).square().mean()

    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(0.001)) as step:
        try:
            step(state, torch.randn(4, 16))
            raise AssertionError("the step did not fail")
        except fs.FshardError as e:
            error = type(e).__name__
    return state, step, error


def _fails(rank: int, tmp: str, keep: bool = False) -> None:
    torch.manual_seed(0)
    state, step, _ = fail_a_step(fs.Mesh.from_env())
    if keep:
        _KEPT.extend([state, step])
    dist.destroy_process_group()


def _rank(mode: str, rank: int, port: int) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FSHARD_TIMEOUT_S="60")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the example's output; stderr stays (the test looks for "terminate called" there)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            {"example": _example, "fails": _fails, "kept": lambda r, d: _fails(r, d, keep=True)}[mode](rank, tmp)
    except BaseException:  # noqa: BLE001 - reported as exit code 2
        traceback.print_exc()
        return 2
    # nothing of fshard's outlives the run's objects (a reference cycle would hold the mesh, and through it the
    # process group, until a garbage collection: at the latest the interpreter's final one, during finalization)
    if mode == "kept":  # (its state keeps the group, by design)
        return 0
    with warnings.catch_warnings():  # (isinstance on torch's deprecated module attributes warns)
        warnings.simplefilter("ignore")
        meshes = [o for o in gc.get_objects() if isinstance(o, fs.Mesh)]
    left = [n for n in _threads() if n.startswith(_TORCH_THREADS)]
    if meshes or left:
        found, held = repr(meshes), _holders(meshes[0], ignore=meshes) if meshes else "-"
        del meshes  # (before the collection below: this list would keep them alive)
        print(f"rank {rank}: after destroy_process_group, meshes {found}, threads {left}; held by {held}; after "
              f"gc.collect(): {_after_collect()}", file=sys.stderr, flush=True)
        return 3
    return 0


def _holders(obj, depth: int = 4, ignore=()) -> str:
    """What holds ``obj``: its referrers' types (a frame by its function and line), ``depth`` levels up, for the
    report of a mesh left alive (which torch or Python keeps it is what a fix needs); ``ignore``: the caller's own
    list of what it found."""
    import types
    seen, out, level = {id(obj), id(ignore), id(sys._getframe())}, [], [obj]
    for d in range(depth):
        nxt = []
        for o in level:
            for r in gc.get_referrers(o):
                if id(r) in seen or r is level or r is nxt:
                    continue
                seen.add(id(r))
                nxt.append(r)
        nxt = nxt[:8]
        names = [f"frame {r.f_code.co_name}:{r.f_lineno}" if isinstance(r, types.FrameType) else
                 f"{type(r).__module__}.{type(r).__qualname__}" for r in nxt]
        out.append(f"L{d + 1}[{', '.join(names)}]")
        level = nxt
    return " <- ".join(out)


def _after_collect() -> str:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = sum(isinstance(o, fs.Mesh) for o in gc.get_objects())
    return f"{n} meshes, threads {[t for t in _threads() if t.startswith(_TORCH_THREADS)]}"


def _port() -> int:
    from _dist import _free_port  # (below the ephemeral range: no connection takes it before rank 0 binds it)
    return _free_port()


def _status(status: int) -> str:
    return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"


if __name__ == "__main__":
    fs.ops.native_available()  # the native kernels loaded (or built) once, here, not by every rank
    for mode, runs in zip(sys.argv[1::2], sys.argv[2::2]):
        for i in range(int(runs)):
            port, pids = _port(), []
            for rank in range(2):
                pid = os.fork()
                if pid == 0:
                    sys.exit(_rank(mode, rank, port))  # up to the top level: the interpreter's own exit
                pids.append(pid)
            print(f"{mode} run {i}: " + ", ".join(f"rank {r} {_status(os.waitpid(p, 0)[1])}"
                                                  for r, p in enumerate(pids)), flush=True)
