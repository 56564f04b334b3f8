"""``Flight``: one collective of a step in flight, waited for right before its output is used (``Comm``'s gathers
and reductions return one)."""
from __future__ import annotations

import time

import torch

from ._agreement import wait_works


class Flight:
    """One collective in flight (a gather or a reduction, ``phase``, of the unit or bucket ``tag``). ``wait()``
    returns once its output is complete (on CUDA: once the current stream is ordered after it)."""

    __slots__ = ("_comm", "works", "t_issue", "t_done", "_stamps", "phase", "tag", "_then", "scratch")

    def __init__(self, comm, works: list, t_issue: float, phase: str = "gather", tag: str = "", then=None,
                 scratch: tuple = ()):
        self._comm, self.works, self.t_issue, self.t_done, self.phase = comm, works, t_issue, None, phase
        self.tag = tag
        # then: what completes the output once the works have (a received piece added in: Comm.reduce_each's
        # exchange); scratch: what the works write besides the caller's tensors, until waited for (a caller that
        # must see gloo let go of every buffer, as replay's zeros do before the process may exit, takes it first)
        self._then, self.scratch = then, scratch
        self._stamps: list = [None] * len(works)  # completion time of each work, set from gloo's threads
        if comm.mesh.device.type == "cpu":  # (on CUDA a work completes on the GPU: only host times are known)
            try:
                futures = [w.get_future() for w in works]
            except RuntimeError:  # some gloo works have no future (reduce_scatter): completion is seen at wait()
                futures = []
            for i, fut in enumerate(futures):
                # (the stamps, not the flight: gloo's thread then holds no reference to the step's objects; the
                # mesh watches the callback until gloo's thread has run it and let go: Mesh.hold_callback)
                stamp = (lambda _f, i=i, s=self._stamps: s.__setitem__(i, time.perf_counter()))
                fut.add_done_callback(stamp)
                comm.mesh.hold_callback(stamp)

    def done(self) -> bool:
        """Has every work completed? Never blocks; ``wait()`` is still what makes the output usable."""
        return self.works is None or all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        if self.works is None:
            return
        t0 = time.perf_counter()
        # timeline: a wait is exposed if the collective was still running when compute asked for it (issuing, in
        # _flight, is exposed too)
        blocked = self._comm.spans is not None and not all(w.is_completed() for w in self.works)
        wait_works(self.works, self._comm, lambda: f"its {self.phase} of {self.tag!r}")
        if self._comm.stream is not None:  # the copy (local mesh) or the collective ran on the side stream
            torch.cuda.current_stream().wait_stream(self._comm.stream)
        if self._then is not None:
            self._then()
        self._then, self.scratch = None, ()
        t1 = time.perf_counter()
        self.works = None
        stamps = self._stamps
        self.t_done = max(stamps) if stamps and all(t is not None for t in stamps) else t1
        self._comm.seconds[self.phase + "_exposed"] += t1 - t0
        if blocked and self.t_done > t0:  # (gloo may run the completion callback before is_completed() says so)
            self._comm.span("wait", f"{self.phase}:{self.tag}", t0, t1)
        self._comm = None  # a record now: no cycle with comm.flights, so a step's Comm (and its mesh's process
        # group) is freed when the step ends, not at a later garbage collection (design: "Exit and teardown")
