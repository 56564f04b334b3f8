"""The threads fshard starts beside the step: their priority (``lower_priority``, the one helper every such thread's
initializer uses) and the mesh's background worker (``Background``, owned by the mesh: ``close()``, or its finalizer
when the mesh dies or at exit). design/ARCHITECTURE.md, "Exit and teardown"."""
from __future__ import annotations

import os
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

IDLE = "idle"  # lower_priority(IDLE): run only when a core would otherwise idle


def lower_priority(level) -> None:
    """Lower the calling thread's CPU priority, so that the step's own threads keep the cores and this one fills
    their waits. ``IDLE``: Linux SCHED_IDLE (background work at nice 5 took a quarter of each core from the step,
    1.35x its time, benchmarks/RESULTS.md, checkpoints; idle priority fills the step's waits instead); an int ``n``:
    the thread's nice value raised by ``n`` (at most 19), for a worker mostly waiting on a disk. Linux only: there
    both are per thread, elsewhere they would lower the whole process. A refusal only costs speed: the thread then
    keeps its priority."""
    if not sys.platform.startswith("linux") or not level:
        return
    try:
        if level == IDLE:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + int(level)))
    except (AttributeError, OSError):
        pass


class Background:
    """A mesh's background worker (``Mesh.background()``): one thread at idle priority, so that its jobs run in the
    order they were submitted, the same on every rank, and on a mesh with a process group a gloo group of its own
    over the same ranks, so that its collectives never interleave with the step's. ``close()`` ends both, after the
    jobs already submitted; idempotent. Its finalizer does the same when the mesh dies, or at exit before
    interpreter finalization if the mesh lives that long (every thread can still take the GIL then)."""

    def __init__(self, mesh):
        self.group = None
        if mesh.group is not None:  # collective: every rank of the mesh makes it in the same order
            self.group = dist.new_group(dist.get_process_group_ranks(mesh.group), timeout=mesh.timeout,
                                        backend="gloo", use_local_synchronization=True)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fshard-background", initializer=lower_priority,
                                       initargs=(IDLE,))
        self._finalizer = weakref.finalize(mesh, _end, self.group, self.pool)  # (refers to the mesh weakly)

    def submit(self, fn, *args):
        """Run ``fn(*args)`` on the background thread, after every job submitted before it: a Future."""
        return self.pool.submit(fn, *args)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Wait for the submitted jobs, end the thread, destroy the group (unless already destroyed)."""
        self._finalizer()


def _end(group, pool: ThreadPoolExecutor) -> None:
    # (not from the background thread itself, where the last job may drop the mesh: it cannot join itself)
    pool.shutdown(wait=threading.current_thread() not in getattr(pool, "_threads", ()))
    if group is not None and dist.is_initialized() and group in registered_groups():
        dist.destroy_process_group(group)


def registered_groups():
    from torch.distributed.distributed_c10d import _world  # the live process groups; no public accessor exists
    return _world.pg_map
