"""The reader thread of ``fs.offload_state(params=True)``: parameter shards held in a store, read ahead of their
gathers (``OffloadUpdate.read_ahead``). The transform owns it as it owns its update worker: made with the step's
policy, ended by ``step.close()`` (the policy's ``close``).

The step asks the update policy to read a stored leaf ahead (``UpdatePolicy.read_ahead``) when a unit's gather is
launched, and issues the gather on its compute thread once the read is done (fshard/run/_read_ahead.py: collectives in
one order on every rank). A policy without a reader (the default) leaves the step to read the leaf at the gather.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor


class Reader:
    """One reader thread (started at its first read; ``close()`` ends it). One thread: reads of one store are serial
    anyway, and each store operation takes the store's lock, so the reads interleave item by item with an update
    streaming through the same store on offload_state's worker."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def read(self, leaf, dtype, record, label: str, pin: bool = False) -> Future:
        """Start reading ``leaf`` (a state leaf in a store: ``load(dtype, pin)``) as a CPU tensor of ``dtype``;
        ``record(lane, label, t0, t1)`` gets the read's span for the timeline; ``pin``: into pinned memory (bound for
        a GPU)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fshard-read")
        return self._pool.submit(_read, leaf, dtype, record, label, pin)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _read(leaf, dtype, record, label: str, pin: bool = False):
    t0 = time.perf_counter()
    out = leaf.load(dtype, pin)
    record("store", label, t0, time.perf_counter())
    return out
