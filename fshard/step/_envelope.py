"""The envelope a training step and an eval pass both run in: what keeps ranks together and frees what a call made.

    with envelope(step, state, "step {}", train=True) as env:    # env.comm: this call's collectives
        ...                                                         # env.runs: its StepRuns, closed at the end

On entry: the state's checks (``spec_of``: no other rank can be told if they fail), the call's ``Comm`` (with the step
function's trace, timeline, gather stream and ``check_collectives``), one call at a time per step function and per
model template (``exclusive``), then the checks every rank learns of (``check_usable``), then the last step's
gradients are let go (``Step._held``: before this call's forward, as torch's loop frees ``.grad``). If the body
raises, the error is posted at the other ranks' next check (``Comm.fail``, fshard/dist/_agreement.py) and raised as an
fshard error on this rank (``step_error``: one family on every rank); whatever happens, nothing is left in flight
(``drain``), a training step's updates begun during backward that no update took are dropped (``UpdatePolicy.abort``),
and every run is closed, freeing its buffers now rather than at a later collection.
"""
from __future__ import annotations

import time

from .._frames import dynamo_import_collected
from ..dist._agreement import foreign, step_error
from ..dist._collectives import Comm
from ..run._pool import BufferPool
from ._guards import check_usable, exclusive, spec_of


class Envelope:
    """One call's ``comm``, its ``runs`` (closed when the call ends), ``t0``, when the call began, and ``pool``,
    the gathered buffers its runs freed for its later gathers (fshard/run/_pool.py; emptied when the call ends)."""

    def __init__(self, comm: Comm, t0: float):
        self.comm, self.runs, self.t0, self.pool = comm, [], t0, BufferPool()

    def gather_figures(self) -> dict:
        """The gathers' figures of the call so far: busy and exposed time, bytes, the most held at once."""
        comm = self.comm
        return {"time/gather": comm.busy_seconds("gather"), "time/gather_exposed": comm.seconds.get("gather_exposed",
                                                                                                    0.0),
                "mem/peak_gathered_bytes": max(r._peak_bytes for r in self.runs),
                "comm/gather_bytes": comm.bytes.get("all_gather", 0)}

    def traced(self, metrics: dict) -> dict:
        """``metrics`` with the collectives issued (``trace=True``) and the timeline (``timeline=True``)."""
        if self.comm.trace is not None:
            metrics["trace/collectives"] = tuple(self.comm.trace)
        if self.comm.spans is not None:
            metrics["trace/timeline"] = self.comm.timeline(self.t0)
        return metrics


class envelope:
    """The envelope (the module docstring) of one call of ``step`` on ``state``; ``context`` names it in messages
    (``"step {}"``: formatted with the state's step), ``train``: a training step (its update policy's ``abort``).

    A class, not a ``contextlib.contextmanager`` generator: a generator that catches the error thrown into it (to
    raise another, here the ``StepError``, or to suppress it) leaves, from Python 3.12, its finished frame linked to
    contextlib's ``__exit__`` frame, whose ``value`` is the caught error, whose traceback holds the generator's
    frame: a cycle that keeps every frame of the failed step, and through them the mesh, its process group and
    gloo's threads, until a garbage collection (seen on the GPU machine, session 26; cpython#100964, #129280)."""

    def __init__(self, step, state, context: str, train: bool):
        self.step, self.state, self.context, self.train = step, state, context, train

    def __enter__(self) -> Envelope:
        self._collected = dynamo_import_collected().__enter__()  # (fshard/_frames.py; left in _end)
        step, state = self.step, self.state
        t0 = time.perf_counter()
        spec = spec_of(state)
        comm = Comm(spec.mesh, trace=step.trace, stream=step._gather_stream(spec.mesh.device), timeline=step.timeline,
                    verify=step._verify(spec.mesh), context=self.context.format(int(state.step)))
        self.env = Envelope(comm, t0)
        self._guard = exclusive(step, spec)
        self._guard.__enter__()
        try:
            check_usable(step, state)
        except BaseException as e:
            self._end(e)
            raise
        step._held = ()  # the last step's gradients, let go as torch's loop zero_grad()s (ARCHITECTURE: "Held")
        return self.env

    def __exit__(self, kind, error, traceback) -> bool:
        self._end(error)
        return False  # the body's own error (or the step error _end raised) goes on

    def _end(self, error: BaseException | None) -> None:
        env, comm = self.env, self.env.comm
        try:
            if error is not None:
                told = comm.fail(error)  # drains what is in flight, then tells the other ranks at their next check
                if foreign(error):  # not fshard's own errors, KeyboardInterrupt, SystemExit: raised as they are
                    raise step_error(comm, error, told) from error  # one error family on every rank
        finally:
            try:
                if error is not None:
                    comm.drain()  # an error mid-call: no gather or reduction may still be writing into our buffers
                if self.train and env.runs:  # work begun during backward that no update took (failed, or skipped)
                    self.step.policy.update.abort(env.runs[-1])
                for run in env.runs:
                    run._close()  # free this call's buffers now, also when it raised
                env.pool.clear()  # (nothing is held between calls)
            finally:
                try:
                    self._guard.__exit__(None, None, None)  # (a try/finally generator: nothing thrown into it)
                finally:
                    self._collected.__exit__(None, None, None)  # torch's first import of dynamo, if in this call
