"""Mesh: the ranks a state is sharded over. A thin, immutable wrapper of a torch.distributed process group."""
from __future__ import annotations

import atexit
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


_ids = itertools.count()


def _registered_groups():
    from torch.distributed.distributed_c10d import _world  # the live process groups; no public accessor exists
    return _world.pg_map


def _close_background(ref) -> None:
    """At exit (atexit: before interpreter finalization, with every thread still able to take the GIL): end the
    mesh's background thread and destroy its group, rather than leave both to finalization (design/ARCHITECTURE.md,
    "Exit and teardown"). Every background job has ended by then (the executor's own exit hook waits for them)."""
    mesh = ref()
    if mesh is None or not mesh._background:
        return
    group, pool = mesh._background.pop()
    pool.shutdown(wait=True)
    if group is not None and dist.is_initialized() and group in _registered_groups():
        dist.destroy_process_group(group)


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


def _idle_priority() -> None:
    """Run the calling thread only when a core would otherwise idle (Linux SCHED_IDLE, per thread): background work
    at nice 5 took a quarter of each core from the step (1.35x its time, benchmarks/RESULTS.md, checkpoints); idle
    priority fills the step's waits instead. Elsewhere, or if refused, the thread keeps its priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


@dataclass(frozen=True, eq=False)
class Mesh:
    """The ranks of one process group. ``group is None`` means a single local rank without torch.distributed."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    group: Any = None
    timeout: timedelta = field(default_factory=lambda: timedelta(seconds=_timeout()))
    id: int = field(default_factory=lambda: next(_ids))
    _background: list = field(default_factory=list, repr=False, compare=False)  # see background()
    checks: list = field(default_factory=lambda: [0], repr=False, compare=False)  # checks made (dist/_agreement.py)
    _held: deque = field(default_factory=lambda: deque(maxlen=_HELD), repr=False, compare=False)  # see hold()

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
        if not self._held:  # the first: the mesh's finalizer waits for them when it dies or at exit
            weakref.finalize(self, _release_held, self._held)
        self._held.extend(tensors)

    def background(self):
        """(process group, one-thread executor) for work that runs collectives beside the step's, such as
        fs.save(..., blocking=False): a group of its own, so that the two never interleave on one group, and one
        thread, so that such work runs in the order it was submitted, the same on every rank. Collective the first
        time (every rank of this mesh calls it in the same order); kept for the mesh's lifetime after that, and
        closed at exit (``_close_background``)."""
        if not self._background:
            from concurrent.futures import ThreadPoolExecutor

            group = None
            if self.group is not None:
                group = dist.new_group(dist.get_process_group_ranks(self.group), timeout=self.timeout,
                                       backend="gloo", use_local_synchronization=True)
            pool = ThreadPoolExecutor(1, thread_name_prefix="fshard-background", initializer=_idle_priority)
            self._background.append((group, pool))
            atexit.register(_close_background, weakref.ref(self))  # the owner tears both down at exit
        return self._background[0]

    def check_alive(self) -> None:
        """Raise if this mesh's process group has been destroyed since the mesh was made."""
        if self.group is None:
            return
        if not dist.is_initialized() or self.group not in _registered_groups():
            raise MeshMismatchError(
                f"{self} no longer exists: its process group was destroyed. A state holds shards for the mesh "
                "it was made on; build a new state on the new mesh with fs.init(model, mesh, opt), or load "
                "a checkpoint into it: fs.load(path, like=fs.init(model, mesh, opt))."
            )

    def __repr__(self) -> str:
        return f"Mesh(#{self.id}, rank {self.rank}/{self.world_size}, {self.backend}, {self.device})"
