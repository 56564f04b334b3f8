"""Mesh: the ranks a state is sharded over. A thin, immutable wrapper of a torch.distributed process group.

The environment is read once, when a mesh is made: ``FSHARD_TIMEOUT_S`` (the collective timeout, unless
``timeout_s`` is given) and ``FSHARD_GATHER`` (how gathers are done); a bad value is an ``ArgumentError`` naming the
variable. What a mesh counts and owns while it is used (checks made, tensors held, its background worker) is in its
``MeshRuntime``, so that the frozen mesh itself has no mutable field."""
from __future__ import annotations

import itertools
import math
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ArgumentError, MeshMismatchError
from ._threads import Background, registered_groups

# A dead rank must make the others fail instead of hanging: collectives time out after this many seconds.
DEFAULT_TIMEOUT_S = 300.0
_RELEASE_S = 2.0  # at exit, the longest wait for gloo's threads to let go of the last collectives' tensors
_HELD = 16  # how many of the last small collectives' tensors a mesh keeps (a check, the descriptors of N ranks)


def _timeout(value=None) -> float:
    """The collective timeout in seconds: ``value`` if given, else $FSHARD_TIMEOUT_S, else 300. Read when a mesh
    is made, not at import, so that a bad variable is an error naming it rather than a broken ``import fshard``."""
    where = "fs.Mesh.from_env(timeout_s=...)"
    if value is None:
        value, where = os.environ.get("FSHARD_TIMEOUT_S", DEFAULT_TIMEOUT_S), "FSHARD_TIMEOUT_S (environment)"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ArgumentError(f"{where}: timeout_s must be a positive number of seconds, got {value!r}. It is how "
                            "long a rank waits for the others in a collective before failing (default 300).")
    return seconds


GATHER_IMPLS = ("all_gather", "broadcast", "all_reduce")
_FASTEST_GATHER = {"gloo": "broadcast"}  # measured (design/COLLECTIVES.md); any other backend: all_gather


def _gather_env() -> str:
    """$FSHARD_GATHER (``auto``, the default, or one of ``GATHER_IMPLS``), read when a mesh is made: a step's
    ``Comm`` takes it from the mesh (``Mesh.gather_impl``), not from the environment at every step."""
    impl = os.environ.get("FSHARD_GATHER", "auto")
    if impl != "auto" and impl not in GATHER_IMPLS:
        raise ArgumentError(f"FSHARD_GATHER (environment)={impl!r} is not one of auto, {', '.join(GATHER_IMPLS)}: "
                            "it chooses how gathers are done (design/COLLECTIVES.md); unset it for the measured "
                            "fastest of the backend.")
    return impl


_ids = itertools.count()


def released(*tensors: torch.Tensor, timeout_s: float = _RELEASE_S) -> bool:
    """Wait until the caller's reference is the only one left to each of ``tensors``; False after ``timeout_s``
    (left as they are). Polls with the GIL released (gloo's thread may be waiting for it)."""
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > 1 for t in tensors):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _release_held(held) -> None:
    """When the mesh dies, or at exit if it lives that long (weakref.finalize: before finalization, every thread still
    able to take the GIL): wait, bounded, until gloo's threads have let go of the tensors ``Mesh.hold`` kept, so
    that they are freed on this thread."""
    released(*held)


class MeshRuntime:
    """What a mesh counts and owns while it is used, kept out of its frozen identity (``Mesh.runtime``): the checks
    made on it (``checks``: fshard/dist/_agreement.py, dist/_call.py; every rank counts alike, so transport errors
    key their reports by it), the last small collectives' tensors (``held``: ``Mesh.hold``), and its background
    worker (``Mesh.background``)."""

    def __init__(self):
        self.checks = 0
        self.held: deque = deque(maxlen=_HELD)
        self.background: Background | None = None


@dataclass(frozen=True, eq=False)
class Mesh:
    """The ranks of one process group. ``group is None`` means a single local rank without torch.distributed.
    Frozen; ``runtime`` (not compared, not shown) holds what changes while the mesh is used."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    group: Any = None
    timeout: timedelta = field(default_factory=lambda: timedelta(seconds=_timeout()))
    id: int = field(default_factory=lambda: next(_ids))
    gather_impl: str = field(default_factory=_gather_env)  # FSHARD_GATHER, read once here (dist/_collectives.py)
    runtime: MeshRuntime = field(default_factory=MeshRuntime, repr=False, compare=False)  # the mutable part

    @classmethod
    def from_env(cls, backend: str | None = None, timeout_s: float | None = None) -> "Mesh":
        """Join the ranks started by torchrun (gloo on CPU, nccl on CUDA); world size 1 under plain ``python``.

        An already initialised default process group is reused as it is.
        """
        timeout = timedelta(seconds=_timeout(timeout_s))
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if not dist.is_initialized() and env_world <= 1:
            return cls.local()
        if not dist.is_initialized():
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend, timeout=timeout)
        backend = dist.get_backend()
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(dist.get_rank(), dist.get_world_size(), backend, device, dist.group.WORLD, timeout)

    @classmethod
    def from_group(cls, group) -> "Mesh":
        """A mesh over an existing process group (e.g. one made with torch.distributed.new_group)."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        return cls(dist.get_rank(group), dist.get_world_size(group), dist.get_backend(group), device, group)

    def same_as(self, other: "Mesh") -> bool:
        """Whether two meshes are the same ranks of the same process group (so shards are interchangeable)."""
        return self is other or (self.group is other.group and self.group is not None
                                 and (self.rank, self.world_size) == (other.rank, other.world_size))

    @classmethod
    def local(cls, device: str | torch.device = "cpu") -> "Mesh":
        """One rank, no process group: every collective is a local copy."""
        return cls(0, 1, "local", torch.device(device), None)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Keep the tensors of a small collective that just finished (a check, the descriptors after a failure)
        until exit, on gloo. gloo's worker thread lets go of a finished work, and with it of its tensors, a moment
        after ``wait()`` returns; a tensor whose Python object the caller had dropped is then freed by that thread,
        which takes the GIL inside the work's destructor. During interpreter finalization a thread that asks for the
        GIL is ended (``pthread_exit``), and unwinding through that destructor is ``std::terminate``: "terminate
        called without an active exception" at exit (design/ARCHITECTURE.md, "Exit and teardown", the backtrace).
        Kept here, the last ones are still ours when the mesh dies or the process exits, where ``_release_held``
        waits (bounded) for gloo to let go, before finalization. Costs an append; waiting at each check instead cost 1.1 ms a check (measured)."""
        if self.backend != "gloo":  # NCCL's watchdog frees works on its own thread and period; local: no work
            return
        held = self.runtime.held
        if not held:  # the first: the mesh's finalizer waits for them when it dies or at exit
            weakref.finalize(self, _release_held, held)
        held.extend(tensors)

    @property
    def checks(self) -> int:
        """How many checks (one tiny all-reduce each, fshard/dist/_agreement.py) were made on this mesh so far."""
        return self.runtime.checks

    def background(self) -> Background:
        """This mesh's background worker (fshard/dist/_threads.py), for work that runs collectives beside the
        step's, such as fs.save(..., blocking=False): one thread, so that such work runs in the order it was
        submitted, the same on every rank, and a process group of its own, so that its collectives never interleave
        with the step's. Made at the first call, which is collective (every rank of this mesh calls it in the same
        order); the same one after that, until ``close()``. Ended by ``close()``, or by its finalizer when the mesh
        dies or at exit."""
        bg = self.runtime.background
        if bg is None or bg.closed:
            bg = self.runtime.background = Background(self)
        return bg

    def close(self) -> None:
        """End this mesh's background worker (``background()``), after the work submitted to it (an
        ``fs.save(..., blocking=False)`` still running is waited for); idempotent. The mesh stays usable: a later
        asynchronous save starts a new worker, collectively, on every rank."""
        if self.runtime.background is not None:
            self.runtime.background.close()

    def check_alive(self) -> None:
        """Raise if this mesh's process group has been destroyed since the mesh was made."""
        if self.group is None:
            return
        if not dist.is_initialized() or self.group not in registered_groups():
            raise MeshMismatchError(
                f"{self} no longer exists: its process group was destroyed. A state holds shards for the mesh "
                "it was made on; build a new state on the new mesh with fs.init(model, mesh, opt), or load "
                "a checkpoint into it: fs.load(path, like=fs.init(model, mesh, opt))."
            )

    def __repr__(self) -> str:
        return f"Mesh(#{self.id}, rank {self.rank}/{self.world_size}, {self.backend}, {self.device})"
