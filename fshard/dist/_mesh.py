"""Mesh: the ranks a state is sharded over. A thin, immutable wrapper of a torch.distributed process group.

A mesh may be 2-D (HSDP, issue #41): ``shard_size`` k splits its N ranks into N / k shard groups of k consecutive
ranks. Parameters, gradients and optimizer state are sharded over the k ranks of a shard group (``shard_rank`` of
``shard_size``: what the flat layout shards over) and replicated over the N / k groups; the ranks with the same
``shard_rank`` in every shard group form a replica group (``replica_rank`` of ``replicas``). Gathers and
reduce-scatters run in the shard group; a gradient shard is then all-reduced in the replica group; the ranks'
agreement checks, the loss and the all-or-none commit stay over all N ranks. ``shard_size == world_size`` is the
1-D mesh; ``shard_size == 1`` is DDP with fshard's state. ``from_env``'s default (``default_shard_size``) is one
node under torchrun on several nodes (LOCAL_WORLD_SIZE ranks), else every rank.


The environment is read once, when a mesh is made: ``FSHARD_TIMEOUT_S`` (the collective timeout, unless
``timeout_s`` is given), ``FSHARD_GATHER`` (how gathers are done) and, by ``from_env`` without ``shard_size``,
torchrun's ``LOCAL_WORLD_SIZE``; a bad value is an ``ArgumentError`` naming the variable. What a mesh counts and
owns while it is used (checks made, tensors held, its background worker) is in its ``MeshRuntime``, so that the
frozen mesh itself has no mutable field."""
from __future__ import annotations

import itertools
import math
import os
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.dlpack import to_dlpack

from ..errors import ArgumentError, MeshMismatchError
from ._threads import Background, registered_groups

# A dead rank must make the others fail instead of hanging: collectives time out after this many seconds.
DEFAULT_TIMEOUT_S = 300.0
_RELEASE_S = 2.0  # at exit, the longest wait for gloo's threads to let go of the last collectives' tensors
_HELD = 16  # how many of the last small collectives' tensors a mesh keeps (a check's two, the descriptors' N + 1)


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


def released(*tensors: torch.Tensor, timeout_s: float = _RELEASE_S, owners=1) -> bool:
    """Wait until the caller's references are the only ones left to each of ``tensors`` (C++ owners counted:
    ``_use_count``; ``owners``: how many are the caller's, one number or one a tensor); False after ``timeout_s``
    (left as they are). Polls with the GIL released (gloo's thread may be waiting for it)."""
    ours = [owners] * len(tensors) if isinstance(owners, int) else list(owners)
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > n for t, n in zip(tensors, ours)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _anchor(t: torch.Tensor):
    """A second owner of ``t``'s TensorImpl held in C++, not by a Python reference (``Mesh.hold``): the capsule
    ``torch.utils.dlpack.to_dlpack`` makes keeps the tensor itself (0.6 us; a view would keep the base of a view,
    not the view). None for a tensor DLPack cannot export (it is then held by its Python object only)."""
    try:
        return to_dlpack(t)
    except (RuntimeError, BufferError, TypeError):
        return None


def _release_held(held, callbacks) -> None:
    """When the mesh dies, or at exit if it lives that long (weakref.finalize: before finalization, every thread still
    able to take the GIL): wait, bounded, until gloo's threads have let go of the tensors ``Mesh.hold`` kept (their
    Python objects and anchors the only owners left), so that they are freed on this thread, and have run and
    dropped the completion callbacks ``Mesh.hold_callback`` watches (a weak reference dies once the thread that ran
    it has let go of it, with the GIL)."""
    anchors = Counter(id(t) for t, anchor in held if anchor is not None)  # (a tensor held twice has two)
    released(*(t for t, _ in held), owners=[1 + anchors[id(t)] for t, _ in held])
    deadline = time.monotonic() + _RELEASE_S
    while any(r() is not None for r in callbacks) and time.monotonic() < deadline:
        time.sleep(0.001)


class MeshRuntime:
    """What a mesh counts and owns while it is used, kept out of its frozen identity (``Mesh.runtime``): the checks
    made on it (``checks``: fshard/dist/_agreement.py, dist/_call.py; every rank counts alike, so transport errors
    key their reports by it), the last small collectives' tensors, each with its anchor (``held``: ``Mesh.hold``),
    weak references to the completion callbacks gloo's threads hold (``callbacks``: ``Mesh.hold_callback``), the
    finalizer that waits for both, and its background worker (``Mesh.background``)."""

    def __init__(self):
        self.checks = 0
        self.held: deque = deque(maxlen=_HELD)
        self.callbacks: list = []  # weak references to Python callbacks gloo's threads hold (Mesh.hold_callback)
        self.finalizer: weakref.finalize | None = None
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
    # 2-D (module docstring): k ranks per shard group (0: all of them), the groups of this rank (None: 1-D)
    shard_size: int = 0
    shard_group: Any = None
    replica_group: Any = None
    # the checks before collectives and the small control all-reduces: on gloo a group of their own (``_control``)
    control_group: Any = None

    def __post_init__(self):
        if not self.shard_size:  # 1-D: the whole mesh is the one shard group
            object.__setattr__(self, "shard_size", self.world_size)
        if self.shard_group is None and self.shard_size == self.world_size:
            object.__setattr__(self, "shard_group", self.group)
        if self.control_group is None:
            object.__setattr__(self, "control_group", self.group)

    @property
    def shard_rank(self) -> int:
        """This rank's index in its shard group: which 1/``shard_size`` of each unit it holds."""
        return self.rank % self.shard_size

    @property
    def replicas(self) -> int:
        """How many shard groups hold a copy of the state (1: a 1-D mesh)."""
        return self.world_size // self.shard_size

    @property
    def replica_rank(self) -> int:
        """Which shard group this rank is in (its index in its replica group)."""
        return self.rank // self.shard_size

    @classmethod
    def from_env(cls, backend: str | None = None, timeout_s: float | None = None,
                 shard_size: int | None = None) -> "Mesh":
        """Join the ranks started by torchrun (gloo on CPU, nccl on CUDA); world size 1 under plain ``python``.

        An already initialised default process group is reused as it is. ``shard_size``: shard the state over
        groups of that many consecutive ranks and replicate it over the groups (HSDP; the module docstring). By
        default (``default_shard_size``) one node under torchrun on several nodes (torchrun numbers a node's ranks
        consecutively), else every rank; ``shard_size=world_size`` shards over every rank on any number of nodes.
        Collective on gloo (the checks' group: ``_control``) and when the mesh is 2-D: every rank makes the groups,
        in the same order.
        """
        timeout = timedelta(seconds=_timeout(timeout_s))
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if not dist.is_initialized() and env_world <= 1:
            _check_shard_size(shard_size, 1)
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
        rank, world = dist.get_rank(), dist.get_world_size()
        if shard_size is None:
            shard_size = default_shard_size(world, os.environ.get("LOCAL_WORLD_SIZE"))
        return cls(rank, world, backend, device, dist.group.WORLD, timeout,
                   **_split(dist.group.WORLD, world, _check_shard_size(shard_size, world), timeout),
                   control_group=_control(backend, world, timeout))

    @classmethod
    def from_group(cls, group, shard_size: int | None = None) -> "Mesh":
        """A mesh over an existing process group (e.g. one made with torch.distributed.new_group); ``shard_size``
        as in ``from_env`` (collective when given: every rank of ``group`` calls it), but every rank of the group by
        default: which of its ranks share a node is not known. Its checks share ``group`` (no control group: one made
        by a subgroup's members alone is named from what each process made before, and could differ between them)."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        world, timeout = dist.get_world_size(group), timedelta(seconds=_timeout())
        return cls(dist.get_rank(group), world, dist.get_backend(group), device, group, timeout,
                   **_split(group, world, _check_shard_size(shard_size, world), timeout))

    def same_as(self, other: "Mesh") -> bool:
        """Whether two meshes are the same ranks of the same process group, split alike (so shards are
        interchangeable)."""
        return self is other or (self.group is other.group and self.group is not None
                                 and (self.rank, self.world_size, self.shard_size)
                                 == (other.rank, other.world_size, other.shard_size))

    @classmethod
    def local(cls, device: str | torch.device = "cpu") -> "Mesh":
        """One rank, no process group: every collective is a local copy."""
        return cls(0, 1, "local", torch.device(device), None)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Keep the tensors of a small collective that just finished (a check, the descriptors after a failure)
        until the mesh dies or the process exits, on gloo. gloo's worker thread lets go of a finished work, and with
        it of its tensors, a moment after ``wait()`` returns. A tensor whose Python object is alive is kept alive
        from C++ (torch's PyObject preservation); when the work's reference is the last but the Python object's, the
        worker decrefs that object, taking the GIL inside the work's destructor, and frees it if no one else holds
        it. During interpreter finalization a thread that asks for the GIL is ended (``pthread_exit``), and
        unwinding through that destructor is ``std::terminate``: "terminate called without an active exception" at
        exit (design/ARCHITECTURE.md, "Exit and teardown", the backtrace).

        Each tensor is kept with an anchor (``_anchor``: a second owner in C++), so that gloo's reference is never
        the one before last and its thread never touches Python for them. Holding the Python object alone was not
        enough: the other thread lowers the C++ count before it takes the GIL to decref, so a wait that saw the
        count fall could let go first, and the object was then freed on the other thread (36 times in 800 under
        load, tests/test_exit.py). When the mesh dies or at exit, ``_release_held`` waits (bounded) until only the
        mesh's own references (the objects and their anchors) are left, before finalization. Costs an append and
        an export (0.6 us); waiting at each check instead cost 1.1 ms a check (measured). A tensor DLPack cannot
        export (a sparse one) is held by its object alone, as before."""
        if self.backend != "gloo":  # NCCL's watchdog frees works on its own thread and period; local: no work
            return
        self._finalizer()
        self.runtime.held.extend((t, _anchor(t)) for t in tensors)

    def hold_callback(self, callback) -> None:
        """Watch a Python function given to a gloo work's future (``add_done_callback``): gloo's worker thread
        runs it when the work completes, maybe after ``wait()`` has returned here, and then drops it, taking the GIL
        for both; at exit that would be the abort ``hold`` describes. The mesh's finalizer waits (bounded) until
        every watched callback has been run and let go of. Costs a weak reference and an append."""
        if self.backend != "gloo":
            return
        self._finalizer()
        callbacks = self.runtime.callbacks
        if len(callbacks) >= 64:  # (the finished ones are let go of: a long run keeps a few)
            callbacks[:] = [r for r in callbacks if r() is not None]
        callbacks.append(weakref.ref(callback))

    def _finalizer(self) -> None:
        """The first time: the mesh's finalizer, which waits for what ``hold`` and ``hold_callback`` kept."""
        rt = self.runtime
        if rt.finalizer is None:
            rt.finalizer = weakref.finalize(self, _release_held, rt.held, rt.callbacks)

    @property
    def checks(self) -> int:
        """How many checks (one tiny all-gather each, fshard/dist/_agreement.py) were made on this mesh so far."""
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
        shape = ("" if self.replicas == 1 else f", {self.replicas} replicas x {self.shard_size} shards (shard "
                 f"{self.shard_rank}, replica {self.replica_rank})")
        return f"Mesh(#{self.id}, rank {self.rank}/{self.world_size}{shape}, {self.backend}, {self.device})"


def default_shard_size(world_size: int, local_world_size: str | None) -> int:
    """``from_env``'s ``shard_size`` when none is given, from the world size and $LOCAL_WORLD_SIZE (the ranks
    torchrun started on this node; None: unset): one node where that divides the world and is smaller (torchrun on
    several nodes: a shard group a node, the replica all-reduce the only traffic between nodes), else
    ``world_size`` (1-D: one node, plain ``python``, nodes of different sizes, or one rank a node, where a shard
    group of one would hold the whole model on every rank, DDP's memory, unasked). Pure: ``from_env`` reads the
    variable once and passes it. Not a whole number >= 1 is an ``ArgumentError`` naming the variable."""
    if local_world_size is None:
        return world_size
    try:
        local = int(local_world_size)
    except ValueError:
        local = 0
    if local < 1:
        raise ArgumentError(
            f"LOCAL_WORLD_SIZE (environment)={local_world_size!r} is not a number of ranks: torchrun sets it to the "
            "ranks it started on this node, and fs.Mesh.from_env() makes them one shard group when there are "
            "several nodes. Unset it, or pass shard_size (a divisor of the world size) to fs.Mesh.from_env.")
    return local if 1 < local < world_size and world_size % local == 0 else world_size


def _check_shard_size(shard_size, world_size: int) -> int:
    """``shard_size`` (None: ``world_size``), checked: a whole number that divides the world size."""
    if shard_size is None:
        return world_size
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size not in divisors:
        raise ArgumentError(
            f"fs.Mesh.from_env(shard_size={shard_size!r}): the {world_size} rank(s) cannot be split into shard "
            f"groups of that many ranks. Pass a divisor of the world size ({', '.join(map(str, divisors))}): "
            f"shard_size={world_size} shards over every rank (the default on one node), 1 replicates the state on "
            "each rank (DDP), and the ranks of one node (LOCAL_WORLD_SIZE under torchrun) is the usual HSDP choice.")
    return shard_size


def _split(group, world_size: int, shard_size: int, timeout: timedelta) -> dict:
    """The 2-D mesh's fields: this rank's shard group (consecutive ranks of ``group``) and replica group (the ranks
    with the same index in every shard group), made with ``dist.new_group`` by their members, in the order of
    ``groups``. Nothing where the mesh is 1-D."""
    if shard_size == world_size:
        return {}
    ranks = dist.get_process_group_ranks(group)
    me = ranks[dist.get_rank(group)]
    mine = {}
    for kind, members in groups(ranks, shard_size):
        # Made by its members only, named by a hash of them (use_local_synchronization): meshes that disjoint
        # subgroups make at once (from_group) get groups of their own; a job-wide counter would give both the
        # same names and cross-wire them. Every member makes its groups in this same order, so none deadlocks.
        if me in members:
            mine[kind] = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
    return {"shard_size": shard_size, **mine}


def _control(backend: str, world_size: int, timeout: timedelta):
    """The group a gloo mesh over the whole job (``from_env``) runs its checks and small control all-reduces in: one
    of their own over every rank (None elsewhere: the mesh's group). gloo runs the collectives of one group in the
    order they were issued, so a check issued behind a gather still in flight waited for the whole gather: 47-50 ms
    behind a 64 MiB broadcast against 1.4-1.6 ms in a group of its own (measured, two ranks), and at each collective
    the check before it undid gather_ahead's prefetch (design/ARCHITECTURE.md, "Checks in a group of their own").
    Made by every rank (after the 2-D groups) and named by torch's job-wide count, as every group made by all ranks is: not by a hash of
    its members and the groups a process has, which differs between processes that made subgroups before (a mesh
    made after ``dist.new_group([0, 1])`` on 3 ranks then waited for the timeout). One group a mesh, freed with the
    process group (``dist.destroy_process_group()``): make a mesh once per job, not per step."""
    if backend != "gloo" or world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def groups(ranks: list[int], shard_size: int) -> list[tuple[str, list[int]]]:
    """The 2-D mesh's groups of ``ranks`` (a divisor ``shard_size``), in the order every rank makes them: the shard
    groups (consecutive ranks), then the replica groups (the same index in every shard group)."""
    n = len(ranks)
    return ([("shard_group", ranks[g:g + shard_size]) for g in range(0, n, shard_size)]
            + [("replica_group", ranks[j::shard_size]) for j in range(shard_size)])
