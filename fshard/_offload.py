"""fs.offload_state: keep optimizer moments in a store (CPU memory or NVMe) and stream them through the update.

The moments of the chosen units live in ``store`` as chunk items: item ``(key, i)`` holds rows
``[exp_avg; exp_avg_sq]`` of elements ``chunks[i]`` of the unit's optimizer range. In the state they are leaves
of type ``Stored``, shown by ``print(state)`` with their key, bytes and location. The update walks every active
offloaded chunk through the store's stream, so read(i+1) || update(i) || write(i-1) with a bounded number of
buffers, and runs the same AdamW kernel on the same elements as without offload (bitwise; chunk boundaries are
multiples of 16 elements, so a kernel's vector lanes see every element in the same position).

Purity: without ``donate``, updated chunks are written under a new version key and the input state's items stay
readable; an item is deleted once no state refers to it (its ``Stored`` leaves were garbage-collected): the store
owns that (``store.delete_later``, carried out at its next operation), so it holds whichever step function made
the item, and also once every step function is gone. With ``donate=True`` chunks are written back under their own
key (the store keeps the previous version readable until the new one is complete). The first step moves the
chosen units' moments into the store; if a write fails there (directory full, read-only), the step raises
``OffloadError`` and the input state is unchanged and usable (unless it was donated).

``fraction`` chooses whole units, in model order, until their moments make up ``fraction`` of all moment bytes
(0: none, 1: all). Other units go to the update policy this one was given. With ``overlap_backward`` a unit's
update starts in a worker thread once its gradient shard is final, while backward runs (design/OFFLOAD.md); the
thread ends with ``step.close()``. On CUDA the shard's gradient and parameter go to the CPU for the update and the
parameter comes back (not run on a GPU yet).
"""
from __future__ import annotations

import itertools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any


from ._base import UpdatePolicy
from ._early import Streamed, _Early, _lower_priority, _quiet_delete, _settle
from ._errors import ArgumentError, ArgumentTypeError, FshardError
from ._optim import AdamWState
from ._stored import Stored, _disk_need, _Items, _location, _stored_state, put_moments
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
                 overlap_backward: bool, worker_nice: int):
        self.inner, self.store, self.fraction, self.chunk, self.depth = inner, store, fraction, chunk_numel, depth
        self.overlap_backward = overlap_backward
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
        if segs:
            early[name] = _Early(self, opt, name, unit.shard.detach(), step.state.copies.get(name), unit.grad, s,
                                 segs, count, self._key(name), step.record)

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
        each unit's step count; its parameter (and its copy) unless donated and updated in place (an update begun
        during backward writes a clone); in-memory moments only for units that stay in memory, without donate.
        ``store/peak_bytes``, the most the store holds during the step (design/OFFLOAD.md, "Disk needs"): an updated
        unit's new version beside the input's (2x its moments), except where donate writes in place (1x, plus depth
        + 1 chunk items in flight for the whole update); a unit moved in or left alone, 1x."""
        spec, f = step.spec, {"io/read_bytes": 0, "io/write_bytes": 0, "mem/new_state_bytes": 0}
        chosen = self._choose(spec, state)
        early = self.overlap_backward and step.grads_unchanged and spec.mesh.device.type == "cpu"
        peak, in_place = 0, 0  # in_place: the largest chunk item written back in place
        for u in spec.units:
            s, on = state.opt_state.get(u.name), any(active.get(u.name, ()))
            if s is None:
                continue
            stored, moments = isinstance(s.exp_avg, Stored), 2 * s.exp_avg.nbytes
            f["mem/new_state_bytes"] += s.count.nbytes if on or stored else 0  # a stored unit's count is renewed
            clone = not donate or (stored and early and step.units[u.name].got_all())
            if stored or u.name in chosen:
                peak += moments * (2 if stored and on and clone else 1)
                if stored and on and not clone:
                    in_place = max(in_place, min(moments, 2 * self.chunk * s.exp_avg.dtype.itemsize))
            if not on:
                continue
            copy = state.copies.get(u.name)
            f["mem/new_state_bytes"] += (state.params[u.name].nbytes + (0 if copy is None else copy.nbytes)
                                         if clone else 0)
            if stored:
                f["io/read_bytes"] += moments
                f["io/write_bytes"] += moments
            elif u.name in chosen:
                f["io/write_bytes"] += moments
            elif not donate:
                f["mem/new_state_bytes"] += moments
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
                    items = _Items(self.store, work.key, s.exp_avg.items.chunks)
                    opt_state[u.name] = _stored_state(items, work.count, s.exp_avg.numel, s.exp_avg.dtype,
                                                      s.exp_avg.location)
                    continue
                count, segs = spec.optimizer.plan(u, spec.mesh.rank, s.count, on, int(state.step))
                if not segs:  # nothing to update: the same items serve the new state
                    opt_state[u.name] = AdamWState(count, s.exp_avg, s.exp_avg_sq)
                    continue
                p = state.params[u.name] if donate else state.params[u.name].clone()
                c = state.copies.get(u.name)
                c = c if donate or c is None else c.clone()
                key = s.exp_avg.key if donate else self._key(u.name)
                streamed.append(Streamed(p, grads.shards[u.name], segs, s, key, c))
                params[u.name] = p
                if c is not None:
                    copies[u.name] = c
                items = s.exp_avg.items if donate else _Items(self.store, key, s.exp_avg.items.chunks)
                opt_state[u.name] = _stored_state(items, count, s.exp_avg.numel, s.exp_avg.dtype,
                                                  s.exp_avg.location)
            if streamed:
                self._stream(spec.optimizer, streamed, grads.scale, created, m, donate, step.record)
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
        with locked(self.store):  # the store serves one thread at a time (a background save reads it too)
            self._stream_locked(opt, work, scale, created, m, donate, record)

    def _stream_locked(self, opt, work, scale, created, m, donate, record) -> None:
        keys = [k for w in work for k in w.state.exp_avg.items.item_keys()]
        where = [(i, c) for i, w in enumerate(work) for c in range(len(w.state.exp_avg.items.chunks))]
        t_wait, spans = 0.0, {}  # timeline: unit i -> [its first read asked for, its last write-back issued]
        stream = self.store.stream(keys, depth=self.depth, writeback=True)
        try:
            it = iter(stream)
            for i, c in where:
                t0 = time.perf_counter()
                spans.setdefault(i, [t0, t0])
                item = next(it)  # waits for read(i); reads i+1 .. i+depth are in flight
                t_wait += time.perf_counter() - t0
                p, g, segs, s, key, copy = work[i]  # a Streamed
                lo, hi = s.exp_avg.items.chunks[c]
                mv = item.tensor
                m["io/read_bytes"] += mv.numel() * mv.element_size()
                for a, b, step, lr, wd in segs:
                    a, b = max(a, lo), min(b, hi)
                    if a < b:
                        _apply(opt, p, g, mv[0], mv[1], a, b, lo, (step, scale, lr, wd), copy)
                t0 = time.perf_counter()
                stream.writeback(item, key=(key, c))  # async; waits only if too many writes are in flight
                spans[i][1] = time.perf_counter()
                t_wait += spans[i][1] - t0
                if not donate:
                    created.append((key, c))
                m["io/write_bytes"] += mv.numel() * mv.element_size()
        finally:
            t0 = time.perf_counter()
            stream.close()  # completes every write-back (raises the first error)
            t1 = time.perf_counter()
            t_wait += t1 - t0
            for i, (a, b) in spans.items():
                record("store", f"stream {work[i].key.rsplit('@', 1)[0]}", a, b)
            record("store", "write-back", t0, t1)
        m["time/io_wait"] += t_wait

    def _put(self, name: str, s: AdamWState, created, m, record) -> AdamWState:
        """Move a unit's in-memory moments into the store as chunk items."""
        with locked(self.store):
            return self._put_locked(name, s, created, m, record)

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


def choose_units(spec, opt_state, fraction: float) -> frozenset:
    """The units offload_state(fraction=...) places in its store: whole units in model order until their moments
    make up ``fraction`` of all moment bytes (fs.load(..., offload=) places a loaded state's moments the same way)."""
    return choose_layouts([u for u in spec.units if opt_state.get(u.name) is not None], spec.mesh.rank, fraction)


def choose_layouts(layouts, rank: int, fraction: float) -> frozenset:
    """``choose_units`` over the unit layouts that have moments, before a state exists (fs.init(..., offload=))."""
    sizes = [(u.name, 2 * u.opt_numel(rank)) for u in layouts]
    total, acc, names = sum(b for _, b in sizes), 0, set()
    for name, b in sizes:
        if acc >= fraction * total - 1e-9 * total:
            break
        names.add(name)
        acc += b
    return frozenset(names)

def _apply(opt, p, g, m, v, a: int, b: int, lo: int, run: tuple, copy=None) -> None:
    """One AdamW pass over shard elements [a, b) whose moments sit at [a - lo, b - lo) of the chunk rows; ``run``:
    (step, grad scale, lr, weight decay); ``copy``: the shard's low-precision copy, written in the same pass."""
    step, scale, lr, wd = run
    if p.device.type == "cpu":
        opt.apply(p[a:b], g[a:b], m[a - lo:b - lo], v[a - lo:b - lo], step, scale, lr=lr, weight_decay=wd,
                  copy=None if copy is None else copy[a:b])
        return
    # CUDA: update on the host copy, then send the parameter (and its cast) back (not run on a GPU yet)
    ph, gh = p[a:b].to("cpu"), g[a:b].to("cpu")
    opt.apply(ph, gh, m[a - lo:b - lo], v[a - lo:b - lo], step, scale, lr=lr, weight_decay=wd)
    p[a:b].copy_(ph, non_blocking=True)
    if copy is not None:
        copy[a:b].copy_(ph.to(copy.dtype), non_blocking=True)


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

    Metrics: ``io/read_bytes``, ``io/write_bytes``, ``io/gbps``, ``time/io_wait`` (the step's wait on the store
    after backward: I/O nothing hid), ``update/overlapped_units`` and ``time/overlapped_update`` (units updated
    during backward, and the worker's time on them), and ``store/resident_bytes``."""

    name = "offload_state"
    stages = {"update": "set"}  # one store per step; units it does not take go to the policy it was given

    def __init__(self, store: Any, fraction: float = 1.0, chunk_mb: float = 4, depth: int = 2,
                 overlap_backward: bool | None = None, worker_nice: int = 5):
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
        check_depth(store, depth, f"fs.offload_state(depth={depth})")
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
                             self.worker_nice)

    def fingerprint(self) -> str:
        """The kind of store and the placement, not its directory: each rank may offload to a disk of its own."""
        return (f"fs.offload_state({type(self.store).__name__}, fraction={self.fraction}, chunk_mb={self.chunk_mb}, "
                f"depth={self.depth}, overlap_backward={self.overlap_backward})")

    def __repr__(self) -> str:
        return f"fs.offload_state({_location(self.store)}, fraction={self.fraction})"
