"""A command run to its end under a timeout, its output (stdout and stderr together) returned: what the tests that
drive examples/ under torchrun share; and the example's ``main`` for ranks forked by tests/_dist.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile


_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def example_main(argv: list):
    """examples/train_gpt.py's ``main(argv)`` in this process: what ``run_ranks(example_main, n, argv)`` runs on
    ranks forked from the rank server, where a test needs the example's training and not its torchrun launch (three
    fresh interpreters a run). Returns the run's summary (rank 0's is the one that writes)."""
    if _EXAMPLES not in sys.path:
        sys.path.insert(0, _EXAMPLES)
    import train_gpt
    return train_gpt.main(argv)


def run_logged(cmd: list, *, timeout: float = 240, what: str = "", **popen) -> str:
    """``cmd``'s output; an AssertionError with its tail when it fails or runs past ``timeout`` seconds. It runs in a
    session of its own, and whatever ends the wait (its timeout, pytest-timeout's, Ctrl-C) kills the whole group:
    torchrun and its workers never outlive the test."""
    # its temporary files in a directory of its own, removed after it: torchrun makes a torchelastic_* directory in
    # the temporary directory at every launch and leaves it there (hundreds in /tmp after a few runs of the suite)
    tmp = tempfile.mkdtemp(prefix="fshard-cmd-")
    popen["env"] = {**(popen.get("env") or os.environ), "TMPDIR": tmp}
    try:
        return _run(cmd, timeout, what, popen)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list, timeout: float, what: str, popen: dict) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **popen)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"{what}no result within {timeout:.0f} s\n{log[-4000:]}") from None
    except BaseException:  # the test itself timed out or was interrupted
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, f"{what}{log[-4000:]}"
    return log


# The driver of ``forked``: it imports the caller's module (torch and fshard with it) once, then forks each call's
# ranks from itself before any thread or tensor op, each child a fresh process as far as its heap and its loaded
# kernels go; results come back pickled through a pipe per rank, and the list of them on the last line of stdout.
_FORKED = r"""
import importlib, os, pickle, sys, traceback
sys.path[:0] = pickle.loads(bytes.fromhex(sys.argv[1]))
from _dist import _free_port
module, name, world, calls = pickle.loads(bytes.fromhex(sys.argv[2]))
fn = getattr(importlib.import_module(module), name)
out = []
for env, args in calls:
    port = _free_port()
    kids = []
    for rank in range(world):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            code = 1
            try:
                import torch
                torch.set_num_threads(1)
                torch.manual_seed(0)
                payload, code = pickle.dumps(("ok", fn(*args))), 0
            except BaseException:
                payload = pickle.dumps(("error", traceback.format_exc()))
            finally:
                import torch.distributed as dist
                if dist.is_initialized():
                    dist.destroy_process_group()
                with os.fdopen(w, "wb") as f:
                    f.write(payload)
                os._exit(code)
        os.close(w)
        kids.append((pid, r))
    got = []
    for pid, r in kids:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        got.append(pickle.loads(data) if data else ("died", "no result"))
    out.append(got)
print(pickle.dumps(out).hex())
"""


def forked(fn, calls: list, *, world_size: int = 1, timeout: float = 300) -> list:
    """``fn(*args)`` on ``world_size`` ranks (``fs.Mesh.from_env()`` finds them) for each ``(env, args)`` of
    ``calls``, every call's ranks forked from ONE fresh interpreter that imported ``fn``'s module: what a test that
    measures a fresh process's memory or reads its environment once needs, without a fresh interpreter (an import
    of torch and fshard, 5-10 s here) per call. Returns, per call, the results in rank order; an AssertionError
    with the tracebacks of the ranks that failed."""
    import pickle
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, os.path.join(os.path.dirname(here), "examples")]
    spec = (fn.__module__, fn.__name__, world_size, [(dict(env), tuple(args)) for env, args in calls])
    cmd = [sys.executable, "-c", _FORKED, pickle.dumps(paths).hex(), pickle.dumps(spec).hex()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:  # its timeout, the test's, Ctrl-C: no child outlives the test
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0 and stdout.strip(), stderr[-4000:]
    out = pickle.loads(bytes.fromhex(stdout.strip().splitlines()[-1]))
    bad = [f"call {i} rank {r} {s}:\n{v}" for i, got in enumerate(out) for r, (s, v) in enumerate(got) if s != "ok"]
    assert not bad, "\n".join(bad) + stderr[-2000:]
    return [[v for _, v in got] for got in out]
