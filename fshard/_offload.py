"""fs.offload_state: keep optimizer moments (and, with ``params=True``, parameter shards) in a store (CPU memory or
NVMe) and stream them through the update.

The moments of the chosen units live in ``store`` as chunk items: item ``(key, i)`` holds rows
``[exp_avg; exp_avg_sq]`` of elements ``chunks[i]`` of the unit's optimizer range; they are ``Stored`` leaves in
the state (parameters: ``StoredParam``, fshard/_stored.py). The update streams every active offloaded chunk,
read(i+1) || update(i) || write(i-1) with a bounded number of buffers, through the same AdamW kernel on the same
elements as without offload (bitwise: chunk boundaries are multiples of 16 elements, so vector lanes see every
element in the same position).

Purity: without ``donate``, updated chunks go under a new version key and the input state's items stay readable;
an item is deleted once no state refers to it (``store.delete_later``, carried out at the store's next
operation, whichever step function made it). With ``donate=True`` chunks are written back under their own key (the
store keeps the previous version readable until the new one is complete). The first step moves the chosen units'
state into the store; a failed write there raises ``OffloadError`` with the input state unchanged and usable
(unless donated).

``fraction`` chooses whole units, in model order, until their moments make up ``fraction`` of all moment bytes;
other units go to the update policy this one was given. With ``overlap_backward`` a unit's update starts in a worker
thread once its gradient shard is final, while backward runs (design/OFFLOAD.md); ``step.close()`` ends the thread.
"""
from __future__ import annotations

import itertools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ._base import UpdatePolicy
from ._early import (Streamed, _Early, _lower_priority, _quiet_delete, _settle, owns_storage, param_key,
                     stream_update)
from ._errors import ArgumentError, ArgumentTypeError, FshardError
from ._optim import AdamWState
from ._place import choose_units
from ._stored import (READS_IN_FLIGHT, Stored, StoredParam, _disk_need, _Items, _location, _stored_state,
                      put_moments, put_param)
from ._transforms import Transform
from .store import StoreError
from .store._protocol import is_store, locked
from .store._stream import check_depth

_ALIGN = 16  # elements: chunk boundaries keep SIMD lanes in place (bitwise equal to the unchunked update)


class OffloadError(FshardError):
    """The store could not hold the optimizer state; the input state is unchanged (unless it was donated)."""


class OffloadUpdate(UpdatePolicy):
    """The update policy of ``fs.offload_state``. Updates begun during backward live in ``step.scratch(self)``
    (unit name -> ``_Early``) until ``__call__`` takes them or ``abort`` drops them."""

    def __init__(self, inner: UpdatePolicy, store, fraction: float, chunk_numel: int, depth: int,
                 overlap_backward: bool, worker_nice: int, params: bool = False):
        self.inner, self.store, self.fraction, self.chunk, self.depth = inner, store, fraction, chunk_numel, depth
        self.overlap_backward, self.params = overlap_backward, params
        self._prefix = uuid.uuid4().hex[:8]  # keys of two step functions sharing a store never collide
        self._versions = itertools.count()
        self._chosen: tuple | None = None  # (fingerprint, frozenset of unit names)
        # One thread (started at the first submit): the store is used by one thread at a time, and units are
        # updated in the order their gradients arrive.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fshard-offload",
                                         initializer=_lower_priority, initargs=(worker_nice,))

    def overlap(self, step, unit) -> None:
        """The unit's gradient shard is final (last micro-batch): begin its update in the worker if the result
        cannot depend on anything decided after backward. That holds when the grads stage hands the shards on
        unchanged (no global clip or skip), the moments are already in the store, the shard is on the CPU, and every
        trainable parameter of the unit got a gradient here (so on every rank, whatever the agreement says)."""
        name, early = unit.name, step.scratch(self)
        s = step.state.opt_state.get(name)
        if (not self.overlap_backward or not step.grads_unchanged or unit.grad is None
                or not isinstance(getattr(s, "exp_avg", None), Stored) or unit.shard.device.type != "cpu"
                or not unit.got_all() or name in early):
            return
        opt = step.spec.optimizer
        count, segs = opt.plan(unit.layout, step.spec.mesh.rank, s.count, [True] * len(unit.layout.trainable),
                               int(step.state.step))
        if not segs:
            return
        p, in_place = step.state.params[name], step.donate
        if in_place:  # the input's items and tensors change from here on: a failing step leaves it refusing use
            step.state.donation.take(int(step.state.step))
        stored = isinstance(p, StoredParam)
        if stored:  # memory is what matters: at most depth updates queued behind the worker, each freeing its shard
            pending = [w for w in early.values() if not w.future.done()]
            if len(pending) >= self.depth:
                _settle(pending[:len(pending) - self.depth + 1])
        else:
            p = unit.shard.detach()
        early[name] = _Early(self, opt, name, p, step.state.copies.get(name), unit.grad, s, segs, count,
                             s.exp_avg.key if in_place else self._key(name), step.record,
                             free_grad=stored and step.grads_unread, in_place=in_place)

    def abort(self, step) -> None:
        """Drop the updates begun during backward that ``__call__`` did not take (the step failed, or skipped its
        update): wait until the worker is done with every one of them, then delete what they wrote."""
        early = step.scratch(self)
        _settle(early.values())  # the deletes below use the store: the worker must be done with it
        while early:
            early.popitem()[1].abandon()

    def plan(self, step, state, active, donate):
        """Store traffic, assuming every trainable parameter gets a gradient: a stored unit's chunks are read and
        written once (both moments); a chosen unit still in memory is written once (the first step). New tensors:
        each unit's step count; its parameter (and its copy) unless donated (updated in place, also during
        backward); in-memory moments only for units that stay in memory, without donate. Gradient shards held at
        once (``mem/grad_shard_peak_bytes``), where updates during backward free them (parameters in the store, no
        grads policy reading them, shards of their own): the others, plus ``depth`` of those.
        ``store/peak_bytes``, the most the store holds during the step (design/OFFLOAD.md, "Disk needs"): an updated
        unit's new version beside the input's (2x its moments), except where donate writes in place (1x, plus depth
        + 1 chunk items in flight for the whole update); a unit moved in or left alone, 1x. Parameters in the store
        (``params=True``) count as a third row of the moments, except their tail (frozen parameters), never
        rewritten; a parameter the step moves into the store is not new memory."""
        spec, f = step.spec, {"io/read_bytes": 0, "io/write_bytes": 0, "mem/new_state_bytes": 0}
        chosen = self._choose(spec, state)
        peak, in_place = 0, 0  # in_place: the largest chunk items written back in place
        frees = self.overlap_backward and step.grads_unread and spec.mesh.device.type == "cpu"
        kept, freed = 0, []  # gradient shards held until the update; those an update during backward frees
        for u in spec.units:
            s, on, p = state.opt_state.get(u.name), any(active.get(u.name, ())), state.params[u.name]
            if s is None:
                continue
            stored, moments = isinstance(s.exp_avg, Stored), 2 * s.exp_avg.nbytes
            sp = isinstance(p, StoredParam)  # its head is rewritten with the moments; its tail never
            grad = u.shard_numel * u.dtype.itemsize if on else 0
            g = step.units[u.name].grad
            if frees and stored and sp and g is not None and owns_storage(g) and step.units[u.name].got_all():
                freed.append(grad)
            else:
                kept += grad
            head = p.opt_numel * p.dtype.itemsize if sp else 0
            moved = self.params and not sp and u.name in chosen  # parameters this step puts in the store
            f["mem/new_state_bytes"] += s.count.nbytes if on or stored else 0  # a stored unit's count is renewed
            clone = not donate  # (with donate, an update begun during backward writes in place too)
            if stored or u.name in chosen:
                peak += ((moments + head) * (2 if stored and on and clone else 1) + (p.nbytes - head if sp else 0)
                         + (p.nbytes if moved else 0))
                if stored and on and not clone:
                    in_place = max(in_place, min(moments + head, (2 + sp) * self.chunk * s.exp_avg.dtype.itemsize))
            if not on:
                continue
            copy = state.copies.get(u.name)
            f["mem/new_state_bytes"] += (p.nbytes + (0 if copy is None else copy.nbytes)
                                         if clone and not sp and not moved else 0)
            if stored:
                f["io/read_bytes"] += moments + head
                f["io/write_bytes"] += moments + head
            elif u.name in chosen:
                f["io/write_bytes"] += moments + (p.nbytes if moved else 0)
            elif not donate:
                f["mem/new_state_bytes"] += moments
        if freed:  # backward waits while depth of them are queued behind the worker (overlap)
            f["mem/grad_shard_peak_bytes"] = kept + self.depth * max(freed)
        blk = lambda n: -(-(n + 4096) // 4096) * 4096  # noqa: E731 - an item's pool buffer: a block of phase
        items = [2 * self.chunk * 4] + ([self.chunk * 4] if self.params else [])  # moments' (and parameters') items
        # the streams' pool buffers: depth reads, the item worked on, depth writes; and a gather's reads
        f["store/buffer_bytes"] = ((2 * self.depth + 1) * sum(blk(n) for n in items)
                                   + (READS_IN_FLIGHT * blk(self.chunk * 4) if self.params else 0))
        f["store/pool_bytes"] = int(getattr(getattr(self.store, "pool", None), "resident_bytes", 0))  # held now
        f["store/peak_bytes"] = peak + (self.depth + 1) * in_place
        return f

    def close(self) -> None:
        """End the worker thread (after the work it has)."""
        self.worker.shutdown(wait=True)
        self.inner.close()

    def _take_early(self, early: dict, grads, state, active, m, created) -> dict:
        """Wait for the updates begun during backward; keep those that are what the update would compute now."""
        taken = {}
        t0 = time.perf_counter()
        _settle(early.values())  # every one first: from here on the store is this thread's alone
        m["time/io_wait"] += time.perf_counter() - t0  # what backward did not hide
        try:
            for name in list(early):
                work = early.pop(name)
                ok = (grads.scale == 1.0 and all(active.get(name, ()))
                      and grads.shards.get(name) is work.grad and state.opt_state.get(name) is work.s)
                if not ok:  # (never expected: overlap only starts work whose inputs are final)
                    work.abandon()
                    continue
                try:
                    taken[name] = (*work.future.result(), work)  # the updated parameter shard and its copy
                except BaseException:
                    work.abandon()  # deletes what the worker wrote before it failed
                    raise
                created.extend(work.created)  # from here on, a failure deletes them with the rest
                for k in ("io/read_bytes", "io/write_bytes"):
                    m[k] += work.metrics[k]
                m["time/overlapped_update"] += work.seconds
        finally:
            while early:  # an error above: drop the rest before going on
                early.popitem()[1].abandon()
        return taken

    def __call__(self, step, state, grads, active, donate):
        spec = step.spec
        m = {"io/read_bytes": 0, "io/write_bytes": 0, "time/io_wait": 0.0, "time/overlapped_update": 0.0}
        created = []  # keys this update wrote under new names: deleted again if it fails
        try:
            taken = self._take_early(step.scratch(self), grads, state, active, m, created)
        except Exception as e:  # nothing of the input was written yet, but with donate the step already took it
            return self._fail(e, created, donate, state)
        with locked(self.store):  # versions no state refers to any more; only now: the worker is done with it
            self.store.collect()
        chosen = self._choose(spec, state)
        stored = {n for n, s in state.opt_state.items() if isinstance(getattr(s, "exp_avg", None), Stored)}
        # Moments in memory: the wrapped update (the chosen units then move to the store). Stored ones: streamed.
        in_memory = {n: (a if n not in stored else [False] * len(a)) for n, a in active.items()}
        m["update/overlapped_units"] = len(taken)
        t0 = time.perf_counter()
        try:
            params, opt_state, inner_metrics, copies = self.inner(step, state, grads, in_memory, donate)
            copies = dict(copies)
            m.update(inner_metrics)
            for name in sorted(chosen - stored):
                opt_state[name] = self._put(name, opt_state[name], created, m, step.record)
            streamed = []
            for u in spec.units:
                if u.name not in stored:
                    continue
                s, on = state.opt_state[u.name], active[u.name]
                if u.name in taken:  # updated during backward, into a new version
                    params[u.name], copy, work = taken[u.name]
                    if copy is not None:
                        copies[u.name] = copy
                    items = (s.exp_avg.items if work.key == s.exp_avg.key else  # (in place: the input's items)
                             _Items(self.store, work.key, s.exp_avg.items.chunks))
                    opt_state[u.name] = _stored_state(items, work.count, s.exp_avg.numel, s.exp_avg.dtype,
                                                      s.exp_avg.location)
                    continue
                count, segs = spec.optimizer.plan(u, spec.mesh.rank, s.count, on, int(state.step))
                if not segs:  # nothing to update: the same items serve the new state
                    opt_state[u.name] = AdamWState(count, s.exp_avg, s.exp_avg_sq)
                    continue
                key = s.exp_avg.key if donate else self._key(u.name)
                p = state.params[u.name]
                if isinstance(p, StoredParam):  # its head is streamed beside the moments, into a new version
                    c, pkey = None, None if p.head is None else p.head.key if donate else param_key(key)
                    params[u.name] = p if donate or pkey is None else p.renewed(
                        _Items(self.store, pkey, p.head.chunks, rows=p.head.rows))
                else:
                    p = p if donate else p.clone()
                    c, pkey = state.copies.get(u.name), None
                    c = c if donate or c is None else c.clone()
                    params[u.name] = p
                if c is not None:
                    copies[u.name] = c
                streamed.append(Streamed(p, grads.shards[u.name], segs, s, key, c, pkey))
                items = s.exp_avg.items if donate else _Items(self.store, key, s.exp_avg.items.chunks)
                opt_state[u.name] = _stored_state(items, count, s.exp_avg.numel, s.exp_avg.dtype,
                                                  s.exp_avg.location)
            if streamed:
                self._stream(spec.optimizer, streamed, grads.scale, created, m, donate, step.record)
            if self.params:  # chosen units whose parameters are still in memory (the first step) go to the store
                for u in spec.units:
                    if u.name in chosen and isinstance(params[u.name], torch.Tensor):
                        params[u.name] = self._put_param(u, spec.mesh.rank, params[u.name], created, m, step.record)
                        copies.pop(u.name, None)  # a gather casts what it reads: no copy to keep
        except Exception as e:
            self._fail(e, created, donate, state)
        m["store/resident_bytes"] = int(self.store.resident_bytes)
        t0 = min([t0] + [work.started for *_, work in taken.values()])  # I/O began with the first early update
        m["io/gbps"] = (m["io/read_bytes"] + m["io/write_bytes"]) / max(time.perf_counter() - t0, 1e-9) / 1e9
        return params, opt_state, m, copies

    def _fail(self, e, created, donate, state):
        with locked(self.store):
            for k in created:
                _quiet_delete(self.store, k)
        if donate:  # the step took the input before the update, which may have begun to write it in place
            lost = ("The input state was donated (compose(..., donate=True)), so it may be partly updated in place "
                    "and can no longer be used; restart from a checkpoint (fs.load(fs.latest(dir), like=...)), or "
                    "compose without donate=True to keep inputs intact.")
        else:
            lost = "Nothing was updated: the input state is unchanged and usable."
        if isinstance(e, FshardError) and not isinstance(e, StoreError):
            raise e
        raise OffloadError(
            f"offload_state could not move optimizer state through {_location(self.store)}: {e}. {lost} "
            f"{_disk_need(self.store, state, self._choose(state.spec, state))}") from e

    # --- the pipeline --------------------------------------------------------------------------------------------

    def _stream(self, opt, work, scale, created, m, donate, record) -> None:
        stream_update(self.store, self.depth, opt, work, scale, created, m, donate, record)

    def _put(self, name: str, s: AdamWState, created, m, record) -> AdamWState:
        """Move a unit's in-memory moments into the store as chunk items."""
        with locked(self.store):
            return self._put_locked(name, s, created, m, record)

    def _put_param(self, u, rank: int, p, created, m, record) -> StoredParam:
        """Move a unit's parameter shard into the store (head chunked as its moments, fshard/_stored.py)."""
        t0 = time.perf_counter()
        with locked(self.store):
            out = put_param(self.store, param_key(self._key(u.name)), p, u.opt_numel(rank), self.chunk,
                            created)
        m["io/write_bytes"] += p.nbytes
        record("store", f"write {u.name} params", t0, time.perf_counter())
        return out

    def _put_locked(self, name: str, s: AdamWState, created, m, record) -> AdamWState:
        t0 = time.perf_counter()
        stored = put_moments(self.store, self._key(name), s, self.chunk, created)
        m["io/write_bytes"] += 2 * s.exp_avg.nbytes
        record("store", f"write {name}", t0, time.perf_counter())
        return stored

    # --- bookkeeping ---------------------------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{name}@{self._prefix}.v{next(self._versions)}"

    def _choose(self, spec, state) -> frozenset:
        if self._chosen is None or self._chosen[0] != spec.fingerprint:
            self._chosen = (spec.fingerprint, choose_units(spec, state.opt_state, self.fraction))
        return self._chosen[1]


class offload_state(Transform):
    """Keep ``fraction`` of the optimizer moments in ``store`` (``fs.CPUStore()`` or ``fs.NVMeStore(dir)``) and
    update them by streaming chunks of ``chunk_mb`` MiB per moment, ``depth`` reads ahead.

    overlap_backward: update a unit in a background thread as soon as its gradient shard is final, while backward
    goes on (CPU shards, identity grads stage, units whose parameters all got a gradient); the others are updated
    after backward. The result is bitwise the same either way. None (the default) turns it on for stores that wait
    on a device (NVMeStore), whose I/O backward can hide, and off for in-memory stores, whose update is CPU work
    that would only compete with backward for the same cores (measured 1.9x slower on 2 cores).
    worker_nice: how much lower the worker thread's CPU priority is than the caller's (Linux nice, 0-19), so that
    backward keeps the cores and the worker's I/O waits fill the gaps (5: uring steps 3-20% faster on 2 cores in
    all 7 A/B rounds, aio within noise; benchmarks/RESULTS.md, offload runs 6-7).
    params: keep the chosen units' fp32 parameter shards in the store too (``StoredParam``): each gather reads its
    unit's shard, the update streams it beside the moments, and with donate + overlap_backward each unit's gradient
    shard is freed once updated, so memory holds a few units, not the model (design/OFFLOAD.md; a 4.87B GPT in
    3.7 GiB at world size 2, benchmarks/RESULTS.md). No ``param_copies`` for them: a gather casts what it reads.

    Metrics: ``io/read_bytes``, ``io/write_bytes``, ``io/gbps``, ``time/io_wait`` (the step's wait on the store
    after backward: I/O nothing hid), ``update/overlapped_units`` and ``time/overlapped_update`` (units updated
    during backward, and the worker's time on them), ``store/resident_bytes``, and ``io/param_read_bytes`` (the
    gathers' reads of stored parameter shards, also in ``io/read_bytes``)."""

    name = "offload_state"
    stages = {"update": "set"}  # one store per step; units it does not take go to the policy it was given

    def __init__(self, store: Any, fraction: float = 1.0, chunk_mb: float = 4, depth: int = 2,
                 overlap_backward: bool | None = None, worker_nice: int = 5, params: bool = False):
        if not is_store(store):
            raise ArgumentTypeError(f"fs.offload_state: store must be an fs.CPUStore() or fs.NVMeStore(directory) (or "
                                    f"have every method and attribute of fs.Store), got {type(store).__name__}.")
        if not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ArgumentError(f"fs.offload_state: fraction must be in [0, 1], got {fraction!r}.")
        if not chunk_mb > 0 or not isinstance(depth, int) or depth < 1:
            raise ArgumentError(f"fs.offload_state: chunk_mb must be > 0 and depth an int >= 1, got {chunk_mb!r}, "
                                f"{depth!r}.")
        if not isinstance(worker_nice, int) or not 0 <= worker_nice <= 19:
            raise ArgumentError(f"fs.offload_state: worker_nice must be an int in [0, 19], got {worker_nice!r}.")
        if not isinstance(params, bool):
            raise ArgumentTypeError(f"fs.offload_state: params must be True or False, got {params!r}.")
        check_depth(store, depth, f"fs.offload_state(depth={depth})")
        if params:  # two streams side by side: the moments' and the parameters'
            check_depth(store, 2 * depth + 2, f"fs.offload_state(depth={depth}, params=True)")
        self.params = params
        self.store, self.fraction, self.chunk_mb, self.depth = store, float(fraction), chunk_mb, depth
        on_disk = store.directory is not None  # a store that waits on a device
        self.overlap_backward = on_disk if overlap_backward is None else bool(overlap_backward)
        self.worker_nice = worker_nice

    @property
    def chunk_numel(self) -> int:
        """Elements of each moment per store item."""
        return max(_ALIGN, int(self.chunk_mb * 2**20) // 4 // _ALIGN * _ALIGN)  # fp32 moments

    def wrap_update(self, update: UpdatePolicy) -> UpdatePolicy:
        return OffloadUpdate(update, self.store, self.fraction, self.chunk_numel, self.depth, self.overlap_backward,
                             self.worker_nice, self.params)

    def fingerprint(self) -> str:
        """The kind of store and the placement, not its directory: each rank may offload to a disk of its own."""
        return (f"fs.offload_state({type(self.store).__name__}, fraction={self.fraction}, chunk_mb={self.chunk_mb}, "
                f"depth={self.depth}, overlap_backward={self.overlap_backward}, params={self.params})")

    def __repr__(self) -> str:
        return (f"fs.offload_state({_location(self.store)}, fraction={self.fraction}"
                f"{', params=True' if self.params else ''})")
