"""Run a function on N local ranks (processes) over gloo, as torchrun would, and collect what each returns.

Ranks are forked from a server process (multiprocessing's forkserver, one per test process) that has imported
torch, fshard and what the tests' ranks import (pytest, hypothesis, transformers: ``_context``) once and run
nothing: a rank starts in a fraction of a second instead of importing them afresh, 10-20 s of CPU a pair of ranks on
a loaded 2-core machine, the largest part of the suite's time when every rank was a fresh interpreter. A rank is
otherwise what a fresh interpreter's would be: no collective, thread pool, process group or native library has been
started or loaded in the server (torch seeds, threads and the environment are set per rank in ``_worker``), and the
environment is the caller's at the time of the call, as with ``spawn``.

A rank's stderr goes to a file of its own, with faulthandler on: a rank that dies (gloo aborting on a collective
mismatch, a segfault) is reported with what its native code wrote there and every thread's Python stack (``Died``),
so that a crash seen once in CI can be read (CI once showed only "rank 0 died: -6")."""
from __future__ import annotations

import faulthandler
import itertools
import os
import queue as queues
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

TIMEOUT_S = 240
# what the server imports once (their import-time state only: the server runs no code of theirs). A rank imports
# the test module its function comes from, and with it pytest and hypothesis: 0.3 s of CPU a rank when they were not
# here, about a third of a multi-rank test file's CPU (py-spy over tests/test_optimizers_groups.py, session 37).
# fshard.ops (the module, not its kernels, which a rank loads on first use) and torch's cpp_extension under it: 380
# of the suite's 679 ranks imported them (0.1 s each when quiet; session 37, counted in every rank).
# Not torch.utils.cpp_extension where torch is built with CUDA: its import asks the driver whether a GPU is there
# (_find_cuda_home: torch.cuda.is_available()), after which torch refuses CUDA in every process forked from the
# server ("Cannot re-initialize CUDA in forked subprocess": every NCCL test on the GPU machine, session 50).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "fshard", "fshard.testing", "pytest",
            "hypothesis", "hypothesis.strategies", "_dist", "models", "fshard.ops"] + (
    [] if torch.version.cuda else ["torch.utils.cpp_extension"])


# A rendezvous port comes from below the kernel's ephemeral range (ip_local_port_range, 32768-60999 here). A port
# bound to 0, closed, then bound again by rank 0's TCPStore could be taken in between as the local port of any
# outgoing connection (the other pytest-xdist worker's gloo pairs and store clients): rank 0 then failed with
# EADDRINUSE (test_hsdp in a fresh-clone rehearsal, session 32). Below the range only an explicit bind takes a port;
# each process walks its own sequence (from its pid) and skips a port that cannot be bound now.
_LOW = 10000
_TAKEN = itertools.count()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    span = _ephemeral_low() - _LOW
    if span < 1000:  # (a system whose ephemeral range starts low: the kernel's choice, as before)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = (os.getpid() * 2654435761) % span
    for _ in range(span):
        port = _LOW + (start + 7919 * next(_TAKEN)) % span
        if _bindable(port):
            return port
    raise OSError(f"no free port in {_LOW}-{_LOW + span - 1}")


def _context():
    """The forkserver context, its server importing ``_PRELOAD`` when it starts (the first call of a process), and
    transformers with the test models' modules (``models.HF_MODULES``, 1.8 s of CPU an HF rank) where
    HF_HUB_OFFLINE=1 already (tests/conftest.py sets it for the suite): transformers reads it once, when first
    imported, and a rank's environment must be the caller's."""
    from models import HF_MODULES
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + (HF_MODULES if os.environ.get("HF_HUB_OFFLINE") == "1" else []))
    return ctx


def _worker(rank, world_size, port, fn, args, out, timeout_s, environ, fault):
    # a rank that dies (an abort, a segfault) leaves here what its native code printed (gloo's reason for an abort,
    # glibc's, "terminate called ...") and every thread's Python stack, for the report: its stderr is otherwise the
    # forkserver's, which pytest does not show
    log = open(fault, "w")
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    os.environ.clear()  # the caller's environment now, not the server's when it started (as ``spawn`` would)
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FSHARD_TIMEOUT_S=str(timeout_s))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same default on every rank (torch seeds each process at random), as a script seeds
    try:
        out.put((rank, "ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Died(int):
    """A died rank's exit code, which prints with what the rank wrote to its stderr (native code's last words, and
    faulthandler's Python stacks of its threads where a signal killed it)."""

    def __new__(cls, code: int, stacks: str = ""):
        out = super().__new__(cls, code)
        out.stacks = stacks
        return out

    def __reduce__(self):  # (pickled and copied with its stacks)
        return Died, (int(self), self.stacks)

    def __str__(self):
        return f"{int(self)}\n{self.stacks}" if self.stacks else str(int(self))

    __repr__ = __str__  # (a test that prints a spawn outcome shows the stacks too)


def _read(path: str, tail: int = 20_000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-tail:]
    except OSError:
        return ""


def spawn(fn, world_size: int, *args, timeout_s: float = TIMEOUT_S, collective_timeout_s: float = 60,
          wait_for=None):
    """fn(*args) on every rank. Returns rank -> ("ok", value) | ("error", traceback) | ("died", exitcode) |
    ("hung", None); never waits past ``timeout_s``, nor, with ``wait_for`` (ranks), past the moment those reported
    (a test that stops a rank on purpose). A test that measures a rank's memory measures its growth from a point in
    the rank (``_memory.reset_peak``): a rank forked from the server, which ran nothing, grows as a fresh interpreter
    does (tests/test_offload_params.py's four variants: within 2-6 MB of the figures from spawned interpreters, 51-414
    MB, session 38), without the 4-7 s import each of those cost."""
    wanted = set(range(world_size) if wait_for is None else wait_for)
    ctx = _context()
    out = ctx.Queue()
    port = _free_port()
    faults = tempfile.mkdtemp(prefix="fshard-ranks-")
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out, collective_timeout_s,
                                                       dict(os.environ), f"{faults}/{r}"),
                         daemon=True) for r in range(world_size)]
    outcome, deadline = {}, time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while not wanted <= set(outcome) and time.monotonic() < deadline:
            try:
                rank, status, value = out.get(timeout=0.5)
                outcome[rank] = (status, value)
            except queues.Empty:
                # a rank that exited without reporting has died (its report, if any, is already queued)
                for r, p in enumerate(procs):
                    if r not in outcome and p.exitcode is not None and out.empty():
                        outcome[r] = ("died", Died(p.exitcode, _read(f"{faults}/{r}")))
    finally:
        for r, p in enumerate(procs):
            if p.pid is None:  # (never started)
                continue
            p.join(timeout=10 if r in wanted else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(faults, ignore_errors=True)
    return {r: outcome.get(r, ("hung", None)) for r in range(world_size)}


def run_ranks(fn, world_size: int, *args, timeout_s: float = TIMEOUT_S, collective_timeout_s: float = 60):
    """fn(*args) on every rank (fn calls fs.Mesh.from_env()). Returns the results in rank order; raises with each
    failing rank's traceback if any rank failed, died or hung."""
    outcome = spawn(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s)
    bad = {r: o for r, o in outcome.items() if o[0] != "ok"}
    if bad:
        raise AssertionError("\n".join(f"rank {r} {s}:\n{v}" for r, (s, v) in sorted(bad.items())))
    return [outcome[r][1] for r in range(world_size)]
