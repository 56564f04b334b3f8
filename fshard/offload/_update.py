"""The update policy of ``fs.offload_state`` (fshard/offload/_transform.py): ``OffloadUpdate`` streams the stored units'
chunks through the update (offload/_pipeline.py's ``stream_update``), moves the chosen units' state into their tier's
store on the first step, begins updates during backward in its worker thread (``overlap``), says what a step will
hold and move (``plan``), and cleans up after a failure (``abort``, ``OffloadError``). design/OFFLOAD.md."""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from .._pages import state_copy
from ..protocol._stages import UpdatePolicy
from ._reader import Reader
from ._pipeline import (Streamed, _Early, _quiet_delete, _settle, device_cut, owns_storage, split_update,
                        stream_update)
from ._staging import DeviceChunks
from ..dist._threads import lower_priority
from ..errors import FshardError, OffloadError
from ..optim._protocol import row_names, state_bytes, streamable
from ._tiers import choose_stores
from ._whole import whole_units
from ..state._slot_grad import SlotGrad
from ..state._stored import (READS_IN_FLIGHT, StoredParam, stored_items, _disk_need, _Items, _location, param_key,
                             put_moments, put_param, stored_state)
from ..store import StoreError
from ..store._protocol import locked


class OffloadUpdate(UpdatePolicy):
    """The update policy of ``fs.offload_state``. Updates begun during backward live in ``step.scratch(self)``
    (unit name -> ``_Early``) until ``__call__`` takes them or ``abort`` drops them."""

    def __init__(self, inner: UpdatePolicy, stores: tuple, fractions: tuple, chunk_numel: int, depth: int,
                 overlap_backward: bool | None, worker_nice: int, params: bool = False, device_share: float = 0.0):
        self.inner, self.stores, self.fractions, self.chunk, self.depth = inner, stores, fractions, chunk_numel, depth
        # device_share: of the units streamed after backward, by elements, updated on the mesh's device (update_on)
        self.overlap_backward, self.params, self.device_share = overlap_backward, params, device_share
        self._prefix = uuid.uuid4().hex[:8]  # keys of two step functions sharing a store never collide
        self._versions = itertools.count()
        self._chosen: tuple | None = None  # (fingerprint, unit name -> the store of its tier)
        # One thread (started at the first submit): the store is used by one thread at a time, and units are
        # updated in the order their gradients arrive.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fshard-offload",
                                         initializer=lower_priority, initargs=(worker_nice,))
        self.reader = Reader()  # reads parameter shards held in a store ahead of their gathers (read_ahead)
        self.chain = threading.Lock()  # orders the start of units' copies down between this thread and the worker
        self._copy_streams: dict = {}  # device -> (up, down): the device update's copy streams, made once

    def overlap(self, step, unit) -> None:
        """The unit's gradient shard is final (last micro-batch): begin its update in the worker if the result
        cannot depend on anything decided after backward. That holds when the grads stage hands the shards on
        unchanged (no global clip or skip), the moments are already in the store, the shard is on the CPU, and every
        trainable parameter of the unit got a gradient here (so on every rank, whatever the agreement says). On a
        GPU the gradient shard (and a parameter kept there) goes to pinned host memory on a copy stream once this
        thread's stream has produced it (fshard/offload/_staging.py), and ``__call__`` waits for the parameters' way back."""
        name, early = unit.name, step.scratch(self)
        s = step.state.opt_state.get(name)
        items = stored_items(s)
        if (not self.overlaps(step.spec.mesh.device) or not streamable(step.spec.optimizer)
                or not step.grads_unchanged or unit.grad is None
                or items is None or unit.shard.device.type not in ("cpu", "cuda")
                or not unit.got_all() or name in early):
            return
        opt = step.spec.optimizer
        count, segs = opt.plan(unit.layout, step.spec.mesh.shard_rank, s.count, [True] * len(unit.layout.trainable),
                               int(step.state.step))
        if not segs:
            return
        p, in_place, cuda = step.state.params[name], step.donate, unit.grad.device.type == "cuda"
        if in_place:  # the input's items and tensors change from here on: a failing step leaves it refusing use
            step.state.donation.take(int(step.state.step))
        stored = isinstance(p, StoredParam)
        if stored:  # memory is what matters: at most depth updates queued behind the worker, each freeing its shard
            pending = [w for w in early.values() if not w.future.done()]
            if len(pending) >= self.depth:
                _settle(pending[:len(pending) - self.depth + 1])
        else:
            p = unit.shard.detach()
        c = step.state.copies.get(name)
        if cuda and not stored and not in_place:  # a new version, cloned on this thread's stream (the worker's differs)
            p, c = p.clone(), None if c is None else c.clone()
        # A bucket's view on a GPU is written again on this stream while the copy down (its own stream) may read it:
        # the update reads a copy made here. A one-rank SlotGrad's assembled flat gradient is written by no one.
        data = ((unit.grad.flat() if isinstance(unit.grad, SlotGrad) else unit.grad.clone())
                if cuda and not owns_storage(unit.grad) else None)
        after = next(reversed(early.values()), None)  # the update submitted before this one (its copies first)
        early[name] = _Early(self, items.store, opt, name, p, c, unit.grad, s, segs, count,
                             items.key if in_place else self._key(name), step.record,
                             free_grad=(step, unit) if stored and step.grads_unread else None,
                             in_place=in_place, cloned=cuda and not stored and not in_place,
                             ready=torch.cuda.current_stream(unit.grad.device).record_event() if cuda else None,
                             data=data, after=after)

    def overlaps(self, device) -> bool:
        """Whether updates begin during backward: as asked, or by default (None) on a GPU mesh, where backward runs
        on the device and leaves the host's cores to the update (an NVMe store's default, on, is set already, and
        an update on the device's, off)."""
        return self.overlap_backward if self.overlap_backward is not None else device.type == "cuda"

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
        grads policy reading them, shards of their own): the others, plus ``depth`` of those queued behind the worker
        and the one just handed over.
        ``store/peak_bytes``, the most the store holds during the step (design/OFFLOAD.md, "Disk needs"): an updated
        unit's new version beside the input's (2x its moments), except where donate writes in place (1x, plus depth
        + 1 chunk items in flight for the whole update); a unit moved in or left alone, 1x. Parameters in the store
        (``params=True``) count as a third row of the moments, except their tail (frozen parameters), never
        rewritten; a parameter the step moves into the store is not new memory. With several stores (tiers), per
        store, summed; ``store/memory_peak_bytes``: the part in stores that live in memory (host RAM, in the RSS),
        ``store/pool_bytes``: what the stores hold in memory now."""
        spec, f = step.spec, {"io/read_bytes": 0, "io/write_bytes": 0, "mem/new_state_bytes": 0}
        chosen = self._choose(spec, state)
        peak = {id(st): 0 for st in self.stores}
        in_place = dict(peak)  # per store, the largest chunk items written back in place
        frees = (self.overlaps(spec.mesh.device) and step.grads_unread and spec.mesh.device.type in ("cpu", "cuda")
                 and streamable(spec.optimizer))  # (whole units are updated after backward)
        kept, freed = 0, []  # gradient shards held until the update; those an update during backward frees
        movable = on_device = 0  # what the units hold on the device (Plan.fractions), and the part there now
        whole, unit_most = not streamable(spec.optimizer), 0  # (whole units: the most one unit's items hold)
        for u in spec.units:
            s, on, p = state.opt_state.get(u.name), any(active.get(u.name, ())), state.params[u.name]
            if s is None:
                continue
            items = stored_items(s)
            stored, moments = items is not None, state_bytes(s)  # (every row the optimizer declares)
            copy = state.copies.get(u.name)
            # on the device a unit holds its moments, and with params=True its shard, its copy (param_copies) and
            # its gradient shard until the update (in a store, an update during backward frees that)
            wide = step.param_copies and step.param_dtype not in (None, u.dtype)
            unit_bytes = moments + (p.nbytes + (u.shard_numel * step.param_dtype.itemsize if wide else 0)
                                    + u.shard_numel * u.dtype.itemsize if self.params else 0)
            movable += unit_bytes
            on_device += 0 if stored else unit_bytes
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
            if on and hasattr(spec.optimizer, "exchange_bytes"):  # (a collective update's own traffic: fs.muon)
                f["comm/update_bytes"] = f.get("comm/update_bytes", 0) + spec.optimizer.exchange_bytes(
                    u, spec.mesh.shard_rank, active[u.name], spec.mesh.shard_size)
            clone = not donate  # (with donate, an update begun during backward writes in place too)
            store = items.store if stored else chosen.get(u.name)
            if store is not None:
                peak[id(store)] += ((moments + head) * (2 if stored and on and clone else 1)
                                    + (p.nbytes - head if sp else 0) + (p.nbytes if moved else 0))
                # (whole units: the rows stacked, each padded to the longest, all of a unit's items at once)
                padded = (len(s.rows) * max(r.nbytes for r in s.rows) + head) if stored and on else 0
                unit_most = max(unit_most, padded)
                if stored and on and not clone:
                    in_place[id(store)] = max(in_place[id(store)], padded if whole else
                                              min(moments + head, (len(s.rows) + sp) * self.chunk
                                                  * s.rows[0].dtype.itemsize))
            if not on:
                continue
            f["mem/new_state_bytes"] += (p.nbytes + (0 if copy is None else copy.nbytes)
                                         if clone and not sp and not moved else 0)
            if stored:
                f["io/read_bytes"] += moments + head
                f["io/write_bytes"] += moments + head
            elif u.name in chosen:
                f["io/write_bytes"] += moments + (p.nbytes if moved else 0)
            elif not donate:
                f["mem/new_state_bytes"] += moments
        if freed:  # backward waits while depth of them are queued behind the worker, the new one beside them
            f["mem/grad_shard_peak_bytes"] = kept + (self.depth + 1) * max(freed)
        blk = lambda n: -(-(n + 4096) // 4096) * 4096  # noqa: E731 - an item's pool buffer: a block of phase
        rows = len(spec.optimizer.rows)
        items = [rows * self.chunk * 4] + ([self.chunk * 4] if self.params else [])  # the rows' (and parameters') items
        # the streams' pool buffers: depth reads, the item worked on, depth writes; and a gather's reads
        f["store/buffer_bytes"] = ((2 * self.depth + 1) * sum(blk(n) for n in items)
                                   + (READS_IN_FLIGHT * blk(self.chunk * 4) if self.params else 0))
        if whole:  # one unit at a time: its items read, the update's new rows (unless donated), the items written
            f["store/buffer_bytes"] = (2 if donate else 3) * unit_most + (
                READS_IN_FLIGHT * blk(self.chunk * 4) if self.params else 0)
        at_peak = {id(st): peak[id(st)] + (1 if whole else self.depth + 1) * in_place[id(st)] for st in self.stores}
        f["store/peak_bytes"] = sum(at_peak.values())
        f["store/memory_peak_bytes"] = sum(at_peak[id(st)] for st in self.stores if st.directory is None)
        f["store/pool_bytes"] = sum(int(st.resident_bytes) for st in self.stores)  # in memory now
        f["offload/movable_bytes"], f["offload/device_bytes"] = movable, on_device
        f["offload/tiers"] = tuple((_location(st), st.directory is None, fr) for st, fr in zip(self.stores,
                                                                                              self.fractions))
        return f

    def read_ahead(self, leaf, dtype, record, label: str, pin: bool = False):
        """Read a stored parameter shard on this policy's reader thread (fshard/offload/_reader.py)."""
        return self.reader.read(leaf, dtype, record, label, pin)

    def close(self) -> None:
        """End the reader and worker threads (after the work they have)."""
        self.reader.close()
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
                    taken[name] = (*work.result(), work)  # the updated parameter shard and its copy
                    for up in work.ups:  # its parameters' copies back to the GPU, before anything reads them
                        torch.cuda.current_stream().wait_event(up)
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
        for store in self.stores:  # versions no state refers to any more; only now: the worker is done with them
            with locked(store):
                store.collect()
        chosen = self._choose(spec, state)
        stored = {n for n, s in state.opt_state.items() if stored_items(s) is not None}
        # Moments in memory: the wrapped update (the chosen units then move to the store). Stored ones: streamed.
        in_memory = {n: (a if n not in stored else [False] * len(a)) for n, a in active.items()}
        m["update/overlapped_units"] = len(taken)
        t0 = time.perf_counter()
        whole = not streamable(spec.optimizer)  # every unit updated whole, in model order (offload/_whole.py)
        try:
            params, opt_state, inner_metrics, copies = (
                whole_units(self, step, state, grads, active, donate, created, m) if whole else
                self.inner(step, state, grads, in_memory, donate))
            copies = dict(copies)
            m.update(inner_metrics)
            for name in sorted(chosen.keys() - stored):
                opt_state[name] = self._put(chosen[name], name, opt_state[name], row_names(spec.optimizer), created,
                                            m, step.record)
            streamed = []
            for u in spec.units:
                if u.name not in stored or whole:
                    continue
                s, on = state.opt_state[u.name], active[u.name]
                held, first = stored_items(s), s.rows[0]  # (first: the numel, dtype and location of every row)
                if u.name in taken:  # updated during backward, into a new version
                    params[u.name], copy, work = taken[u.name]
                    if copy is not None:
                        copies[u.name] = copy
                    items = (held if work.key == held.key else  # (in place: the input's items)
                             _Items(work.store, work.key, held.chunks, held.rows))
                    opt_state[u.name] = stored_state(s, items, work.count, first.numel, first.dtype, first.location)
                    continue
                count, segs = spec.optimizer.plan(u, spec.mesh.shard_rank, s.count, on, int(state.step))
                if not segs:  # nothing to update: the same items serve the new state
                    opt_state[u.name] = s.with_rows(count, s.rows)
                    continue
                key = held.key if donate else self._key(u.name)
                p = state.params[u.name]
                if isinstance(p, StoredParam):  # its head is streamed beside the moments, into a new version
                    c, pkey = None, None if p.head is None else p.head.key if donate else param_key(key)
                    params[u.name] = p if donate or pkey is None else p.renewed(
                        _Items(p.head.store, pkey, p.head.chunks, rows=p.head.rows))
                else:
                    p = p if donate else state_copy(p)
                    c, pkey = state.copies.get(u.name), None
                    c = c if donate or c is None else state_copy(c)
                    params[u.name] = p
                if c is not None:
                    copies[u.name] = c
                streamed.append(Streamed(p, grads.shards[u.name], segs, s, key, c, pkey))
                items = held if donate else _Items(held.store, key, held.chunks, held.rows)
                opt_state[u.name] = stored_state(s, items, count, first.numel, first.dtype, first.location)
            if streamed:
                self._stream(spec.optimizer, streamed, grads.scale, created, m, donate, step.record,
                             device=spec.mesh.device if self.device_share > 0 else None)
            if self.params:  # chosen units whose parameters are still in memory (the first step) go to the store
                for u in spec.units:
                    if u.name in chosen and isinstance(params[u.name], torch.Tensor):
                        params[u.name] = self._put_param(chosen[u.name], u, spec.mesh.shard_rank, params[u.name],
                                                         created, m, step.record)
                        copies.pop(u.name, None)  # a gather casts what it reads: no copy to keep
        except Exception as e:
            self._fail(e, created, donate, state)
        m["store/resident_bytes"] = sum(int(store.resident_bytes) for store in self.stores)
        t0 = min([t0] + [work.started for *_, work in taken.values()])  # I/O began with the first early update
        m["io/gbps"] = (m["io/read_bytes"] + m["io/write_bytes"]) / max(time.perf_counter() - t0, 1e-9) / 1e9
        return params, opt_state, m, copies

    def _fail(self, e, created, donate, state):
        for store in self.stores:  # (a key lives in one of them: the others ignore it)
            with locked(store):
                for k in created:
                    _quiet_delete(store, k)
        if donate:  # the step took the input before the update, which may have begun to write it in place
            lost = ("The input state was donated (compose(..., donate=True)), so it may be partly updated in place "
                    "and can no longer be used; restart from a checkpoint (fs.load(fs.latest(dir), like=...)), or "
                    "compose without donate=True to keep inputs intact.")
        else:
            lost = "Nothing was updated: the input state is unchanged and usable."
        if isinstance(e, FshardError) and not isinstance(e, StoreError):
            raise e
        chosen = self._choose(state.spec, state)
        disk = next((st for st in self.stores if st.directory is not None), self.stores[-1])
        raise OffloadError(
            f"offload_state could not move optimizer state through {', '.join(map(_location, self.stores))}: {e}. "
            f"{lost} {_disk_need(disk, state, {n for n, st in chosen.items() if st is disk})}") from e

    # --- the pipeline --------------------------------------------------------------------------------------------

    def _stream(self, opt, work, scale, created, m, donate, record, ready=None, wait_up=True, staging=None,
                device=None) -> list:
        """Stream ``work`` through the stores its units live in, one store after the other (model order within).
        Returns the CUDA events after the parameters' copies back to the GPU (none on a CPU mesh); ``ready``,
        ``wait_up``, ``staging`` (one unit's, in one store): as ``stream_update`` takes them. ``device``: each store's
        first ``device_share`` of units are updated there, the rest on the host meanwhile (``split_update``)."""
        ups = []
        for store in self.stores:
            mine = [w for w in work if stored_items(w.state).store is store]
            cut = 0 if device is None else device_cut([w.grad.numel() for w in mine], self.device_share)
            chunks = DeviceChunks(device, self.depth, self._streams(device)) if cut else None
            if 0 < cut < len(mine):
                ups += split_update(store, self.depth, opt, mine[:cut], mine[cut:], chunks, scale, created, m,
                                    donate, record)
            elif mine:
                up = stream_update(store, self.depth, opt, mine, scale, created, m, donate, record, ready, wait_up,
                                   staging, chunks)
                ups += [] if up is None else [up]
        return ups

    def _put(self, store, name: str, s, names: tuple[str, ...], created, m, record):
        """Move a unit's in-memory optimizer rows (named ``names``) into ``store`` as chunk items."""
        t0 = time.perf_counter()
        with locked(store):
            stored = put_moments(store, self._key(name), s, names, self.chunk, created)
        m["io/write_bytes"] += state_bytes(s)
        record("store", f"write {name}", t0, time.perf_counter())
        return stored

    def _put_param(self, store, u, rank: int, p, created, m, record) -> StoredParam:
        """Move a unit's parameter shard into ``store`` (head chunked as its moments, fshard/state/_stored.py)."""
        t0 = time.perf_counter()
        with locked(store):
            out = put_param(store, param_key(self._key(u.name)), p, u.opt_numel(rank), self.chunk, created)
        m["io/write_bytes"] += p.nbytes
        record("store", f"write {u.name} params", t0, time.perf_counter())
        return out

    # --- bookkeeping ---------------------------------------------------------------------------------------------

    def _streams(self, device) -> tuple | None:
        """The device update's two copy streams on ``device`` (up, down), made once: the caching allocator keeps a
        stream's freed blocks for that stream, so new streams every step would each strand a chunk pipeline's
        worth of GPU memory."""
        if device.type == "cuda" and device not in self._copy_streams:
            self._copy_streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._copy_streams.get(device)  # (None on a CPU mesh)

    def _key(self, name: str) -> str:
        return f"{name}@{self._prefix}.v{next(self._versions)}"

    def _choose(self, spec, state) -> dict:
        """Unit name -> the store its tier is (units that stay on the device are absent)."""
        if self._chosen is None or self._chosen[0] != spec.fingerprint:
            self._chosen = (spec.fingerprint, choose_stores(spec, state.opt_state, self.stores, self.fractions))
        return self._chosen[1]
