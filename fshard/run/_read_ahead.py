"""Parameter shards held in a store (``offload_state(params=True)``), read ahead of their gathers.

A unit whose shard is in a store is read when its gather is launched: the read, and its cast to the compute dtype, run
on the reader thread of the update policy (``UpdatePolicy.read_ahead``; ``fs.offload_state``'s owns one,
fshard/offload/_reader.py) while compute goes on. The gather itself is a collective, which every
rank must issue in the same order from one thread, so it is issued on the compute thread once the read is done: launched
units wait in a queue (``Launches``) and their gathers are issued in launch order, at every launch, acquire and release
of a unit (the heads whose reads are done), and all the way up to a unit that is acquired or released (waiting for the
reads before it). Any other collective a policy issues (a reduction in backward) first issues every launched gather:
gathers and the other collectives then interleave at the same places on every rank, whatever the reads' timing (the
order ranks must agree on). So ``gather_ahead(depth)``'s prefetch reads ``depth`` units ahead, and with ``depth >= 2``
the next unit's gather is issued while the current one computes (read -> gather -> compute, overlapped). Without a
reader (``step.plan``'s dry run, a policy that reads nothing ahead) a launch issues at once, reading at the gather.

The alternatives: reading on the compute thread at launch (what fshard did first) serialised every read with compute
(about 2 of the 3.4 s of forward on the 8-layer scale GPT, benchmarks/RESULTS.md); issuing the gather from the reader
thread would let two threads issue collectives (the reader's gathers and the compute thread's reductions in backward) in
an order that differs from rank to rank, which gloo and NCCL pair up wrongly or hang on.
"""
from __future__ import annotations

from collections import deque


class Launches:
    """One micro-batch's launched units whose gathers are not issued yet, in launch order."""

    def __init__(self):
        self.queue: deque = deque()

    def add(self, unit) -> None:
        """A launched unit: queued behind the ones before it, then the heads whose reads are done are issued."""
        unit._queued = True
        self.queue.append(unit)
        self.pump()

    def pump(self, until=None) -> None:
        """Issue the gathers at the head of the queue whose reads are done; with ``until`` (a queued unit), every
        one up to and including it, waiting for their reads."""
        q = self.queue
        while q and (until is not None or q[0]._read_done()):
            unit = q.popleft()
            unit._issue()
            if unit is until:
                return

    def flush(self) -> None:
        """Issue every launched gather (waiting for their reads): before any other collective, so that gathers
        and reductions interleave at the same places on every rank, whenever the reads complete."""
        if self.queue:
            self.pump(until=self.queue[-1])

    def drop(self) -> None:
        """The micro-batch ended without issuing them (it failed): wait for their reads (the reader writes into
        their results) and forget them."""
        while self.queue:
            self.queue.popleft()._abandon_read()
