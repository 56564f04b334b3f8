"""offload_state's pipeline: ``stream_update`` runs units' updates through the store (read ‖ update ‖ write, the
parameters' chunks beside the moments' where they live in the store too); ``_Early``, an update begun during
backward (``overlap_backward``) in the worker thread; ``split_update``, a step's units shared between the device and
the host's cores; ``Streamed``, one unit's work item."""
from __future__ import annotations

import time
from concurrent.futures import Future, wait
from typing import Any, NamedTuple

import torch

from .._pages import state_copy
from ..optim._protocol import apply_runs
from ..state._slot_grad import SlotGrad
from ..state._stored import StoredParam, _Items, param_key
from ..store._protocol import locked
from ._staging import HostStaging


class Streamed(NamedTuple):
    """One unit's update through the store: its parameter shard (a tensor, written in place, or a ``StoredParam``),
    gradient shard, the optimizer's runs, its stored optimizer state, the key its new rows are written under, its
    low-precision copy (or None), and the key a stored parameter's head is written under (None for a tensor)."""

    param: Any
    grad: torch.Tensor
    segs: list
    state: Any
    key: str
    copy: torch.Tensor | None
    pkey: str | None = None


def stream_update(store, depth: int, opt, work, scale, created, m, donate, record, ready=None, wait_up=True,
                  staging=None, chunks=None):
    """``stream_steps`` run to its end; returns what it returns."""
    steps = stream_steps(store, depth, opt, work, scale, created, m, donate, record, ready, wait_up, staging, chunks,
                         turns=False)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def stream_steps(store, depth: int, opt, work, scale, created, m, donate, record, ready=None, wait_up=True,
                 staging=None, chunks=None, turns=True):
    """A generator: yields once a chunk's update is issued (the share of ``work``'s chunks done so far; with
    ``turns``, each chunk's runs applied before it yields, so a turn is a chunk). Updates every chunk of ``work``
    (Streamed items, in order) through ``store``: one stream over the moments' items (each item: the optimizer's
    declared rows, stacked, however many it declares) and, for parameters in the store, a second one over their head
    items in lockstep (item i of both covers the same elements), so each read, update and write-back overlaps the
    next chunk's read. After an error of its own it raises that one, not a later one from closing the streams. Each
    store operation holds the store's lock by itself (the kernel runs without it), so the gathers' reads of
    parameter shards (``StoredParam.load``, on offload_state's reader thread) go between this stream's items instead
    of waiting for the whole stream. Written keys that are new (not ``donate``) go to ``created``; ``m`` gets the
    traffic. Tensors on a GPU (gradients; parameters and copies kept there) go through pinned host memory, whole
    units at a time, on a copy stream overlapped with the host update (fshard/offload/_staging.py; ``ready``: the
    CUDA event after which the gradients are final). Returns the event after the last copy back to the GPU (None
    without a GPU), which the current stream waits for unless ``wait_up`` is False (a worker thread: its caller
    waits); ``staging``: a ``HostStaging`` of ``work`` made (and perhaps started) by the caller, else one is made
    here. ``chunks`` (a ``DeviceChunks``, for ``offload_state(update_on="device")``): the update runs on its device
    instead, on the stored chunks copied up and back beside the gradients and parameters where they are; no host
    staging."""
    items = [w.state.rows[0].items for w in work]  # (a stored unit's rows share their items)
    keys = [k for it in items for k in it.item_keys()]
    pkeys = [k for w in work if w.pkey is not None for k in w.param.head.item_keys()]
    where = [(i, c) for i, it in enumerate(items) for c in range(len(it.chunks))]
    last = {i: c for i, c in where}  # unit i's last chunk: its parameters go back to the GPU after it
    staging = (_Resident(work) if chunks is not None else HostStaging(work, ready)) if staging is None else staging
    t_wait, spans = 0.0, {}  # timeline: unit i -> [its first read asked for, its last write-back issued]
    # an in-memory store updated in place where the input may be overwritten: no copy out and back
    # (looked up on the class: a wrapper that forwards other calls through __getattr__ keeps its own stream)
    in_place = store.stream_in_place if donate and getattr(type(store), "stream_in_place", None) else None
    with locked(store):
        open_stream = in_place or (lambda ks: store.stream(ks, depth=depth, writeback=True))
        streams = [open_stream(keys)]
        if pkeys:
            streams.append(open_stream(pkeys))
    # The runs go to the optimizer together (optim._protocol.apply_runs: fs.adamw's kernel takes them in one call,
    # so this thread takes the GIL back once per call, not once per run, beside a step's Python thread that holds
    # it: each take waited up to the interpreter's switch interval, and the update ran at a tenth of its speed
    # beside a busy Python thread, benchmarks/RESULTS.md, session 25): a chunk's runs, or a whole unit's where the
    # items are the stored tensors themselves (in place: nothing is read or written, so none is held up), except
    # in a split's turns (``turns``: a chunk a turn, one thread, no other to wait for).
    runs, held, finished = [], [], False  # the runs not yet applied; the items they use, written back once they are
    try:
        its = [iter(s) for s in streams]
        for k, (i, c) in enumerate(where):
            if k:
                yield k / len(where)  # (a split update takes its turn here: split_update)
            t0 = time.perf_counter()
            w = staging.host(i)  # its tensors on the host (waits for their copies down)
            spans.setdefault(i, [t0, t0])
            with locked(store):
                item = next(its[0])  # waits for read(i); reads i+1 .. i+depth are in flight
                pitem = next(its[1]) if w.pkey is not None else None
            t_wait += time.perf_counter() - t0
            lo, hi = items[i].chunks[c]
            host = [item.tensor] + ([] if pitem is None else [pitem.tensor[0]])  # rows (and a stored head chunk)
            near = host if chunks is None else [chunks.up(t) for t in host]  # where the update runs
            p, plo = (w.param, 0) if pitem is None else (near[1], lo)  # a stored head chunk starts at lo
            for a, b, step, lr, wd in w.segs:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    runs.append(_run(p, w.grad, near[0], a, b, lo, (step, scale, lr, wd), w.copy, plo))
            held.append([(streams[0], item, (w.key, c))] + ([(streams[1], pitem, (w.pkey, c))] if pitem else []))
            if in_place is not None and c != last[i] and chunks is None and not turns:
                continue
            apply_runs(opt, runs)
            runs = []
            if chunks is not None:  # back into the host items; a write-back that reads them waits for that
                chunks.down(zip(near, host))
                near = None  # (its device memory may serve the next chunk once the copies down are done)
                if in_place is None:
                    chunks.settle()
            t0 = time.perf_counter()
            for s, it_, k in (d for done in held for d in done):
                with locked(store):
                    s.writeback(it_, key=k)  # async; waits only if too many writes are in flight
                if not donate:
                    created.append(k)
                n = it_.tensor.numel() * it_.tensor.element_size()
                m["io/read_bytes"] += n
                m["io/write_bytes"] += n
            held = []
            if c == last[i]:
                staging.up(i)
            spans[i][1] = time.perf_counter()
            t_wait += spans[i][1] - t0
        up = staging.finish(wait=wait_up)
        finished = True
    finally:
        t0 = time.perf_counter()
        error = None
        if chunks is not None:
            try:  # (in place: the stored tensors themselves; after an error too, before the buffers go back)
                chunks.settle()
            except BaseException as e:  # noqa: BLE001 - close the streams still, then raise
                error = e
        for s in streams:
            try:
                with locked(store):
                    s.close()  # completes every write-back (raises the first error)
            except BaseException as e:  # noqa: BLE001 - close the other stream too, then raise
                error = error or e
        t1 = time.perf_counter()
        t_wait += t1 - t0
        for i, (a, b) in spans.items():
            record("store", f"stream {work[i].key.rsplit('@', 1)[0]}", a, b)
        record("store", "write-back", t0, t1)
        m["time/io_wait"] += t_wait
        if error is not None and finished:  # (after the body's own error, a close's would hide it)
            raise error
    return up


def split_update(store, depth: int, opt, on_device, on_host, chunks, scale, created, m, donate, record) -> list:
    """``offload_state(update_on=<a share>)``: ``on_device`` (Streamed items) updated on ``chunks``' device and
    ``on_host`` by the host's cores, both through ``store``, taking turns on this thread a chunk at a time: the
    device's part whenever it is behind and its copies have room (its launches return at once, the link and the GPU
    work on), the host's otherwise (the kernel runs on the host's cores meanwhile). One thread, not two: a Python
    thread beside the host kernel's caller holds it up at every chunk for the interpreter's lock (the GPU session of
    benchmarks/RESULTS.md, session 50). The parts overlap where the device's chunks are updated in place (a pinned
    CPUStore with ``donate=True``); elsewhere each device chunk is waited for before its write-back reads it, and
    the host's turn waits with it. Returns the CUDA events after the host part's parameters went back up."""
    cuda = chunks.device.type == "cuda"
    ready = torch.cuda.current_stream(chunks.device).record_event() if cuda else None  # the gradients are final
    parts = {"device": stream_steps(store, depth, opt, on_device, scale, created, m, donate, record, chunks=chunks),
             "host": stream_steps(store, depth, opt, on_host, scale, created, m, donate, record, ready, False)}
    done, spent, up = {"device": 0.0, "host": 0.0}, {"device": 0.0, "host": 0.0}, None
    try:
        while parts:
            side = min(parts, key=lambda k: (done[k], k))  # the part behind (the device's on a tie)
            if side == "device" and "host" in parts and not chunks.has_room():
                side = "host"  # (the device's copies are full: its next chunk would wait)
            t0 = time.perf_counter()
            try:
                done[side] = next(parts[side])
            except StopIteration as end:
                del parts[side]
                up = end.value if side == "host" else up
            spent[side] += time.perf_counter() - t0
    except BaseException:
        for rest in parts.values():  # the other part's streams closed, its copies settled; the first error raised
            try:
                rest.close()
            except BaseException:  # noqa: BLE001, S110 - (its own error after the first: the first says why)
                pass
        raise
    # this thread's time in each part: with a good share, the host's (its kernel) covers the device's copies
    m["time/split_device"] = m.get("time/split_device", 0.0) + spent["device"]
    m["time/split_host"] = m.get("time/split_host", 0.0) + spent["host"]
    m["update/device_units"] = m.get("update/device_units", 0) + len(on_device)
    if up is None:
        return []
    torch.cuda.current_stream(chunks.device).wait_event(up)
    return [up]


def device_cut(numels: list, share: float) -> int:
    """How many of the units (element counts ``numels``, in order) a split update gives the device: the prefix whose
    elements come nearest ``share`` of all; at least one for a share above 0, all of them for 1."""
    if share <= 0 or not numels:
        return 0
    if share >= 1:
        return len(numels)
    total, run, best = sum(numels), 0, (share * sum(numels), 0)
    for i, n in enumerate(numels, 1):
        run += n
        best = min(best, (abs(run - share * total), i))
    return max(best[1], 1)


class _Resident:
    """``HostStaging``'s interface for an update on the device: every tensor stays where it is."""

    def __init__(self, work):
        self.work = work

    def host(self, i: int):
        return self.work[i]

    def up(self, i: int) -> None:
        pass

    def finish(self, wait: bool = True):
        return None


def _run(p, g, rows, a: int, b: int, lo: int, run: tuple, copy=None, plo: int = 0) -> tuple:
    """One optimizer run (``apply_runs``'s tuple) over shard elements [a, b) whose state sits at [a - lo, b - lo) of
    each chunk row and parameters at [a - plo, b - plo) of ``p``; ``run``: (step, grad scale, lr, weight decay);
    ``copy``: the shard's low-precision copy, written in the same pass. Every tensor is where the update runs (on the
    host, where ``HostStaging`` put it, or on the device with ``DeviceChunks``)."""
    step, scale, lr, wd = run
    return (p[a - plo:b - plo], g[a:b], tuple(r[a - lo:b - lo] for r in rows), step, scale, lr, wd,
            None if copy is None else copy[a:b])


class _Early:
    """One unit's update, begun in the worker during backward: a new version of its chunks (new keys, a cloned
    parameter and copy), so the input state stays intact until the update takes the result, and nothing is lost if
    the step fails first (``abandon``). A step that donates its input writes in place instead (``in_place``: the
    policy marked the input donated first)."""

    def __init__(self, owner, store, opt, name, param, copy, grad, s, segs, count, key, record, free_grad=None,
                 in_place=False, ready=None, cloned=False, data=None, after=None):
        self.store, self.opt, self.name, self.param, self.grad, self.s = store, opt, name, param, grad, s
        # free_grad: (step, unit) whose shard to free once consumed, or None; in_place: the step donates
        self.free_grad, self.in_place = free_grad, in_place
        self.cloned = cloned  # the caller already made the new version of the parameter and copy (on a GPU)
        self.data = grad if data is None else data  # what the update reads: the gradient shard, or a copy of it
        self.copy = copy  # the parameter's low-precision copy (TrainState.copies), or None
        self.count, self.key, self.record = count, key, record  # record: the step's StepView.record
        # ups: the events after the parameters' copies back to the GPU, which the step's stream waits for when it
        # takes the result
        self.ups = []
        self.created: list = []  # keys written so far (appended by the worker)
        self.metrics = {"io/read_bytes": 0, "io/write_bytes": 0, "time/io_wait": 0.0}
        self.started, self.seconds = float("inf"), 0.0
        self.pkey = None  # a stored parameter's head: rewritten in place, or under a new key
        if isinstance(param, StoredParam) and param.head is not None:
            self.pkey = param.head.key if in_place else param_key(key)
        # On a GPU (ready: the CUDA event after which the gradient is final) the unit's tensors are final now and
        # go down to pinned host memory while the worker updates the unit before this one: their copies start
        # when the worker starts that unit (``after``: the update submitted before this one, if it has not
        # started yet), else now. So at most two units are staged on the host at once, and the worker finds each
        # unit's tensors there instead of waiting for their copies (HostStaging staged one unit at a time).
        self.staging, self._then, self._running = None, None, False
        if ready is not None:
            c = None if isinstance(param, StoredParam) else copy
            self.staging = HostStaging([Streamed(param, self.data, segs, s, key, c, self.pkey)], ready)
            with owner.chain:
                if after is None or after._running:
                    self.staging.start()
                else:
                    after._then = self
        self.future = owner.worker.submit(self._run, owner, segs)

    def _run(self, owner, segs):
        t0 = self.started = time.perf_counter()
        with owner.chain:
            self._running, then, self._then = True, self._then, None
        if then is not None:
            then.staging.start()
        p, c, pkey = self.param, self.copy, self.pkey
        if isinstance(p, StoredParam):  # read, updated and written beside the moments
            c = None
        elif not self.in_place and not self.cloned:
            p, c = state_copy(p), None if c is None else state_copy(c)
        try:
            self.ups = owner._stream(self.opt, [Streamed(p, self.data, segs, self.s, self.key, c, pkey)], 1.0,
                                     self.created, self.metrics, donate=self.in_place, record=self.record,
                                     staging=self.staging, wait_up=False)
            if pkey is not None and not self.in_place:
                p = p.renewed(_Items(self.store, pkey, p.head.chunks, rows=p.head.rows))
            if self.free_grad is not None and _free(self.grad):  # nothing reads it after its update (grads_unread)
                step, unit = self.free_grad
                step.grad_freed(unit)
        finally:
            # the host copies made for the update are done with (their pinned memory goes back)
            self.data, self.staging = self.grad, None
            self.seconds = time.perf_counter() - t0
            self.record("update", f"{self.name} (early)", t0, t0 + self.seconds)
        return p, c

    def result(self):
        """The worker's ``(parameter shard, copy)``, or its error, raised once: the error's traceback holds the
        worker's frame, whose ``self`` is this work, which holds the future that holds the error, a cycle that
        would keep the failed step (and its mesh) alive until a garbage collection; so the future is let go
        first."""
        try:
            return self.future.result()
        except BaseException:
            self.future = _DONE  # (so a later call returns (None, None): the callers take a result once)
            raise

    def abandon(self) -> None:
        """Wait for the worker, then delete what it wrote: the step did not take this update. (The caller has let
        the worker finish every other update first, so the store has one user at a time.)"""
        try:
            self.result()
        except Exception:  # noqa: BLE001 - the step already failed for its own reason; this work is discarded
            pass
        with locked(self.store):
            for k in self.created:
                _quiet_delete(self.store, k)
        self.created = []


_DONE: Future = Future()  # what a work's failed future is swapped for (finished; read-only once set)
_DONE.set_result((None, None))


def owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage (a gradient shard that is a view of a bucket is not)."""
    return (type(t) is torch.Tensor and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
            and t.is_contiguous())  # (not a SlotGrad, whose storage is a placeholder: its slots' tensors hold it)


def _free(t: torch.Tensor) -> bool:
    """Free ``t``'s storage if ``t`` is all of it (or a one-rank ``SlotGrad``'s gradients); whether it did."""
    if isinstance(t, SlotGrad):
        t.release()
        return True
    if not owns_storage(t):
        return False
    t.untyped_storage().resize_(0)
    return True


def _settle(works) -> None:
    """Wait until the worker has finished (or failed) every one of ``works``."""
    wait([w.future for w in works])


def _quiet_delete(store, key) -> None:
    try:
        store.delete(key)
    except Exception:  # noqa: BLE001 - already gone, or the store is closed: nothing left to free
        pass
