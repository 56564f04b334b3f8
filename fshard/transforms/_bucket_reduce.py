"""fs.bucket_reduce: reduce gradients in flat buckets, launched asynchronously while backward goes on.

The plan is made once, in the first step's backward, from the layout and that step's forward order, so every
rank has the same one: the units with trainable parameters are packed whole, in the order backward completes them
(the reverse of their first use in forward; the root and units forward never called last), into buckets of at
most ``bucket_mb`` (a larger unit is a bucket of its own), never mixing dtypes. A unit covers pieces of several
ranks' shards; a bucket's buffer holds, for each rank r, the pieces r owns, one after another (rank-major). One
SUM reduce per rank then leaves each rank the sum of exactly its own pieces, and each unit's gradient shard is
one run of this rank's section: a view, handed over as it is. With ``per_unit=True`` each unit is one bucket
(FSDP2's per-module reduce-scatter): the section is then exactly the unit's shard, a tensor of its own that an
update during backward can free.

Why whole units (design/ARCHITECTURE.md, "bucket_reduce"): a bucket ending inside a unit could launch no sooner,
and a rank's shard cut by it had to be concatenated from two sections after landing.

Readiness: a unit's gradient reaches the reduce policy in one piece, once every use of the unit (two calls of
the same block, tied parameters) has contributed; parameters with no gradient contribute zeros. When a unit
arrives, its pieces are scaled into its bucket; a bucket whose units have all arrived is launched, in plan
order, so ranks issue the same collectives in the same order even when their units finish at different times.
Buckets still waiting at the end of backward (a unit unused on this rank) are zero-filled and launched then.
The step waits for all of them before the update.

Landing: at each arrival, the flights that have already completed (checked without blocking, in launch order) are
landed, and every unit of a landed bucket gets its gradient shard then, while backward goes
on (``step.grad_ready``: offload_state may begin that unit's update). The rest land at the end of backward.

On a 2-D mesh (HSDP) the plan is over the shard group (its k ranks' sections), the reduces sum over it, and each
bucket's section of this rank is then all-reduced over the replica group (``replicate``). Every rank issues those
in the same order, one bucket behind the reduces: launching bucket i issues its reduces, then waits for bucket
i - 1's and issues that bucket's replica all-reduce, so the all-reduces run beside backward as the reduces do; the
end of backward issues the last. A bucket lands once both have completed.

At world size 1 there is nothing to sum: each unit's gradient (cast to the bucket's dtype where that differs) is
handed over as its shard as soon as it arrives, without a bucket or a copy (design/ARCHITECTURE.md, "One rank"); a
unit no gradient reached gets a zero shard at the end of backward, as at N > 1.

Memory: a bucket's buffer is one tensor per rank section, not one flat tensor. Only this rank's section holds a
result; the others, and what the transport received into, are scratch, handed as the bucket lands to the step's
later buckets (``_Spare``, on CPU). So what outlives backward is this rank's sections, which the gradient shards
are views of (1/N of the gradients), not whole buckets (with one flat buffer per bucket, a shard view kept every
bucket alive until the update: a whole model's gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _pages
from ..protocol._stages import ReducePolicy
from ..errors import ArgumentError, ArgumentTypeError
from ..state._flat import ROOT
from ..state._slot_grad import grad_parts
from ..protocol._transform import Transform


@dataclass(frozen=True)
class _Piece:
    unit: str
    lo: int        # range in the unit's flat buffer
    hi: int
    at: int        # offset in the bucket buffer
    rank: int      # the rank whose shard holds [lo, hi)


@dataclass(frozen=True)
class _Bucket:
    index: int
    units: frozenset
    pieces: tuple      # _Piece, rank-major
    sections: tuple    # (offset, numel) per rank
    numel: int
    dtype: torch.dtype  # its units' dtype: a bucket never mixes dtypes


def backward_order(units, forward_order) -> list:
    """Units in the order backward completes their gradients: the reverse of their first use in forward (a unit
    used twice completes after its first use's backward); units forward did not call, and the root (its
    parameters are used around all the others), last."""
    first: dict[str, int] = {}
    for i, name in enumerate(forward_order):
        first.setdefault(name, i)
    by_name = {u.name: u for u in units}
    used = sorted(first, key=first.get, reverse=True)
    rest = [u.name for u in units if u.name not in first]
    return [by_name[n] for n in used + [n for n in rest if n != ROOT] + [n for n in rest if n == ROOT]]


def plan_buckets(units, world_size: int, bucket_bytes: int, per_unit: bool = False) -> list[_Bucket]:
    """Bucket plan over the units with trainable parameters, taken whole in the given (backward) order, packed
    greedily into buckets of at most ``bucket_bytes`` (a larger unit alone) of one dtype; ``per_unit``: each unit
    is one bucket, whatever its size."""
    groups, size = [], 0
    for u in units:
        if not u.trainable:
            continue
        nbytes = u.numel * u.dtype.itemsize
        if groups and not per_unit and u.dtype == groups[-1][0].dtype and size + nbytes <= bucket_bytes:
            groups[-1].append(u)
            size += nbytes
        else:
            groups.append([u])
            size = nbytes
    buckets = []
    for i, group in enumerate(groups):
        pieces, sections, at = [], [], 0
        for r in range(world_size):
            start = at
            for u in group:  # rank r's piece of u: its shard
                a, b = u.shard_range(r)
                if a < b:
                    pieces.append(_Piece(u.name, a, b, at, r))
                    at += b - a
            sections.append((start, at - start))
        buckets.append(_Bucket(i, frozenset(u.name for u in group), tuple(pieces), tuple(sections), at,
                               group[0].dtype))
    return buckets


class _Plan:
    """The buckets, plus what each gradient arrival and the hand-over need, precomputed once."""

    def __init__(self, buckets: list[_Bucket], rank: int, reduce_dtype=None):
        self.buckets, self.rank = buckets, rank
        self.need = [0] * (len(buckets) + 1)  # need[i]: the largest section of buckets i.. in bytes (spare's bound)
        for b in reversed(buckets):
            self.need[b.index] = max(self.need[b.index + 1],
                                     max(k for _, k in b.sections) * (reduce_dtype or b.dtype).itemsize)
        self.by_unit: dict[str, tuple] = {}  # unit -> (its bucket, its pieces there)
        self.mine: dict[str, tuple] = {}  # unit -> (bucket index, offset in this rank's section, numel)
        for b in buckets:
            for name in b.units:
                self.by_unit[name] = (b, [p for p in b.pieces if p.unit == name])
            for p in b.pieces:
                if p.rank == rank:
                    self.mine[p.unit] = (b.index, p.at - b.sections[rank][0], p.hi - p.lo)
        # units in the order their shards become complete: by their bucket
        self.complete_order = sorted(self.mine, key=lambda n: self.mine[n][0])


class _Spare:
    """Scratch this step is done with (other ranks' sections, receive buffers of landed buckets) for its later
    buckets' scratch (CPU): pages the process has, where new blocks of these sizes often fault in afresh (RESULTS,
    "Session 41"; a new one asks for huge pages: fshard/_pages.py). A buffer is taken only for a need of at least
    half its size, held only while a later bucket may need that much (``keep_upto``), let go at backward's end."""

    def __init__(self, device: torch.device):
        self.held = [] if device.type == "cpu" else None  # (CUDA's caching allocator keeps blocks already)
        self.device = device
        self.reused = 0  # bytes of scratch served from spare memory

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        fits = [i for i, t in enumerate(self.held or ()) if nbytes <= t.numel() <= 2 * nbytes]
        if fits:  # (by index: tensors compare elementwise, so list.remove would compare their values)
            t = self.held.pop(min(fits, key=lambda i: self.held[i].numel()))
            self.reused += nbytes
            return t[:nbytes].view(dtype)
        return _pages.empty(numel, dtype, self.device)  # (in huge pages where it is mapped afresh)

    def give(self, *tensors) -> None:
        if self.held is None:
            return
        for t in tensors:  # its whole storage, as bytes
            if t is not None and t.numel() > 0:
                self.held.append(torch.empty(0, dtype=torch.uint8, device=self.device).set_(t.untyped_storage()))

    def keep_upto(self, nbytes: int) -> None:  # let go of what no need of at most ``nbytes`` would take
        if self.held:
            self.held = [t for t in self.held if t.numel() <= 2 * nbytes]


class _Pending:
    """One step's buckets: buffers, which units each still waits for, and the flights launched."""

    def __init__(self, plan: _Plan, device: torch.device):
        self.plan = plan
        self.buffers: dict[int, list] = {}  # bucket index -> one tensor per rank section (None once freed)
        self.waiting = {b.index: set(b.units) for b in plan.buckets}
        self.next = 0  # the first bucket not launched yet
        self.flights = []  # flights[i] reduces bucket i
        self.replicas = []  # replicas[i] all-reduces this rank's section of bucket i over the replica group (2-D)
        self.landed = 0  # flights waited for, in launch order
        self.received = []  # received[i]: what bucket i's reduces received into (Comm.reduce_each's ``empty``)
        self.spare = _Spare(device)
        self.given = 0  # units of plan.complete_order whose gradient shard has been handed over


class BucketReduce(ReducePolicy):
    """The reduce policy of ``fs.bucket_reduce``. The plan lives here (made once per layout); one step's buckets
    live in ``step.scratch(self)``. It widens a narrower gradient as it copies each piece into its bucket (the
    buckets are in the units' own dtype, or ``reduce_dtype``): ``widens``; and it copies a ``SlotGrad``'s slots
    into their buckets where autograd left them: ``per_slot``."""

    widens = True
    per_slot = True

    def __init__(self, bucket_bytes: int, reduce_dtype, op: str, per_unit: bool = False):
        self.bucket_bytes, self.reduce_dtype, self.op, self.per_unit = bucket_bytes, reduce_dtype, op, per_unit
        self._plan = None  # (key, plan), made on the first step from the layout

    def _plan_for(self, run):
        # Made once per layout, in the first step's backward, when that step's forward order is known. Ranks run
        # the same forward (or the collective-sequence check fails the step), so they make the same plan.
        mesh = run.comm.mesh
        key = (run.spec.fingerprint, mesh.shard_size)
        if self._plan is None or self._plan[0] != key:
            order = backward_order(run.spec.units, run.order)
            self._plan = (key, _Plan(plan_buckets(order, mesh.shard_size, self.bucket_bytes, self.per_unit),
                                     mesh.shard_rank, self.reduce_dtype))
        return self._plan[1]

    def _state(self, run) -> _Pending:
        scratch = run.scratch(self)
        if "pending" not in scratch:
            scratch["pending"] = _Pending(self._plan_for(run), run.comm.mesh.device)
        return scratch["pending"]

    def reduce(self, run, unit, grad: torch.Tensor) -> None:
        n = run.comm.mesh.world_size
        if n == 1:
            return self._whole(run, unit, grad)
        st = self._state(run)
        self._land_done(run, st)  # (first: what landed frees memory this unit's buckets can take)
        name = unit.name
        scale = 1.0 / n if (self.op == "avg" and n > 1) else None
        if name in st.plan.by_unit:
            b, pieces = st.plan.by_unit[name]
            sections = self._buffer(st, b, grad.device)
            for p in pieces:
                spot = _spot(sections, b, p)
                for lo, hi, src in grad_parts(grad, p.lo, p.hi, padding=True):  # (a SlotGrad: slot by slot)
                    dst = spot if hi - lo == spot.shape[0] else spot[lo - p.lo:hi - p.lo]
                    if scale is None:
                        dst.copy_(src)
                    elif dst.dtype == src.dtype:
                        torch.mul(src, scale, out=dst)  # grad * (1/N), as the blocking reduce and DDP do
                    else:
                        dst.copy_(src).mul_(scale)  # reduce in a wider dtype: widen first, then scale
            st.waiting[b.index].discard(name)
        self._launch_ready(run, st, force=False)
        self._land_done(run, st)

    def _land_done(self, run, st: _Pending) -> None:
        """Land the completed flights; hand over the shards they complete. (Not on CUDA, where a wait orders the
        compute stream after the whole comm stream, prefetched gathers included: flights land at the end there.)"""
        while run.comm.mesh.device.type == "cpu" and self._landable(run, st):
            self._land(run, st)
        self._scatter(run, st)

    def _whole(self, run, unit, grad: torch.Tensor) -> None:
        """One rank: nothing to sum, and a bucket would only be a copy of the gradient. The unit's gradient, in the
        bucket's dtype (the cast its copy into a bucket would make), is its shard, handed over as it arrives."""
        dtype = self.reduce_dtype or unit.layout.dtype
        g = grad if grad.dtype == dtype else grad.to(dtype)
        run.comm.reduce_scatter(g, g, unit.name).wait()  # (no copy: recorded, as the blocking reduce's)
        run.grad_ready(unit, g if g.dtype == unit.layout.dtype else g.to(unit.layout.dtype))

    def _unreached(self, run) -> None:
        """One rank, end of backward: as at N > 1, where its buckets reduce zeros for it, a unit with trainable
        parameters that no gradient reached gets a zero shard (in backward's order)."""
        for layout in backward_order(run.spec.units, run.order):
            unit = run.units[layout.name]
            if layout.trainable and unit.grad is None:
                run.grad_ready(unit, torch.zeros(layout.shard_numel, dtype=layout.dtype, device=run.comm.mesh.device))

    def finish(self, run) -> None:
        if run.comm.mesh.world_size == 1:  # (every unit reached was handed over as it arrived)
            return self._unreached(run)
        st = self._state(run)
        self._launch_ready(run, st, force=True)
        self._replicate(run, st, len(st.flights))
        while st.landed < len(st.flights):
            self._land(run, st)
        self._scatter(run, st)
        del run.scratch(self)["pending"]

    def _landable(self, run, st: _Pending) -> bool:
        """Has the next bucket in launch order completed (its reduces, and on a 2-D mesh its replica all-reduce)?
        Never blocks."""
        i = st.landed
        return i < len(st.flights) and st.flights[i].done() and (
            run.comm.mesh.replicas == 1 or (i < len(st.replicas) and st.replicas[i].done()))

    def _land(self, run, st: _Pending) -> None:
        """Wait for the next flight in launch order; give its bucket's scratch (the sections other ranks own, what
        the exchange received into) to the spare memory, which keeps what a bucket not yet launched may take."""
        st.flights[st.landed].wait()
        if st.landed < len(st.replicas):
            st.replicas[st.landed].wait()
        sections, rank = st.buffers[st.landed], run.comm.mesh.shard_rank
        st.spare.give(*(t for r, t in enumerate(sections) if r != rank), *st.received[st.landed])
        sections[:] = [t if r == rank else None for r, t in enumerate(sections)]
        st.received[st.landed] = ()
        st.spare.keep_upto(st.plan.need[st.next])
        st.landed += 1

    def _replicate(self, run, st: _Pending, upto: int) -> None:
        """2-D meshes: for each bucket before ``upto`` without one, wait for its reduces, then issue the all-reduce
        of this rank's section over the replica group (the entry every rank checks: all the sections' sizes)."""
        mesh = run.comm.mesh
        if mesh.replicas == 1:
            return
        while len(st.replicas) < upto:
            i = len(st.replicas)
            b = st.plan.buckets[i]
            st.flights[i].wait()
            st.replicas.append(run.comm.replicate(st.buffers[i][mesh.shard_rank], f"bucket{b.index}",
                                                  sizes="+".join(str(k) for _, k in b.sections)))

    def _buffer(self, st: _Pending, b: _Bucket, device, fill=None) -> list:
        """``b``'s sections: this rank's new and exactly sized (the shards' memory, which an early update may free),
        the others scratch from the spare memory."""
        if b.index not in st.buffers:
            dtype, rank = self.reduce_dtype or b.dtype, st.plan.rank
            st.buffers[b.index] = [_pages.empty(k, dtype, device) if r == rank else st.spare.take(k, dtype)
                                   for r, (_, k) in enumerate(b.sections)]
            if fill is not None:
                for t in st.buffers[b.index]:
                    t.fill_(fill)
        return st.buffers[b.index]

    def _launch_ready(self, run, st: _Pending, force: bool) -> None:
        while st.next < len(st.plan.buckets):
            b = st.plan.buckets[st.next]
            if st.waiting[b.index] and not force:
                return
            if b.index in st.buffers:
                for p in b.pieces:  # pieces of units that never arrived hold zeros
                    if p.unit in st.waiting[b.index]:
                        _spot(st.buffers[b.index], b, p).zero_()
            sections = self._buffer(st, b, run.comm.mesh.device, fill=0)  # none arrived on this rank: all zeros
            got = []

            def receive(numel, dtype, got=got):  # (scratch: given back to the spare memory as the bucket lands)
                got.append(st.spare.take(numel, dtype))
                return got[-1]

            st.flights.append(run.comm.reduce_each(list(sections), f"bucket{b.index}", empty=receive))
            st.received.append(got)
            st.next += 1
            self._replicate(run, st, st.next - 1)  # (2-D: the bucket before this one's, once its reduces are done)

    def _scatter(self, run, st: _Pending) -> None:
        """Give each unit whose bucket has landed its reduced gradient shard: its run of this rank's section (a
        view; with ``per_unit`` the whole section, a tensor of its own)."""
        order, rank = st.plan.complete_order, run.comm.mesh.shard_rank
        while st.given < len(order) and st.plan.mine[order[st.given]][0] < st.landed:
            name = order[st.given]
            st.given += 1
            i, at, n = st.plan.mine[name]
            section = st.buffers[i][rank]
            g = section if at == 0 and n == section.numel() else section[at:at + n]
            unit = run.units[name]
            run.grad_ready(unit, g if g.dtype == unit.layout.dtype else g.to(unit.layout.dtype))


def _spot(sections: list, b: _Bucket, p: _Piece) -> torch.Tensor:
    """Where piece ``p`` sits: its rank's section of bucket ``b``."""
    at = p.at - b.sections[p.rank][0]
    return sections[p.rank][at:at + p.hi - p.lo]


class bucket_reduce(Transform):
    """Reduce gradients in flat buckets of whole units, at most ``bucket_mb`` MiB each (a larger unit is a bucket
    of its own), each launched asynchronously as soon as backward has produced all of it, and waited for before the
    update.

    reduce_dtype: reduce in this dtype (e.g. torch.float32 for bf16 gradients); by default the gradients' own.
    op: "avg" (scale by 1/N, then sum: DDP's order, bitwise at 2 ranks) or "sum".
    per_unit: each unit's gradient is one bucket, whatever ``bucket_mb`` says (FSDP2 reduce-scatters each module's
      gradients the same way): each unit's gradient shard is then a tensor of its own, which an update begun during
      backward frees once it has consumed it (fs.offload_state(store, params=True) with donate=True), where shards
      that are views of a shared bucket stay until the update.
    """

    name = "bucket_reduce"
    stages = {"reduce": "set"}

    def __init__(self, bucket_mb: float = 25, reduce_dtype: torch.dtype | None = None, op: str = "avg",
                 per_unit: bool = False):
        if not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise ArgumentError(f"fs.bucket_reduce: bucket_mb must be a number > 0, got {bucket_mb!r}.")
        if op not in ("avg", "sum"):
            raise ArgumentError(f"fs.bucket_reduce: op must be 'avg' or 'sum', got {op!r}.")
        if reduce_dtype is not None and (not isinstance(reduce_dtype, torch.dtype)
                                         or not reduce_dtype.is_floating_point):
            raise ArgumentTypeError(
                f"fs.bucket_reduce: reduce_dtype must be a floating torch.dtype, got {reduce_dtype!r}.")
        if not isinstance(per_unit, bool):
            raise ArgumentTypeError(f"fs.bucket_reduce: per_unit must be True or False, got {per_unit!r}.")
        self.bucket_mb, self.reduce_dtype, self.op, self.per_unit = bucket_mb, reduce_dtype, op, per_unit

    def wrap_reduce(self, reduce: ReducePolicy) -> ReducePolicy:
        return BucketReduce(int(self.bucket_mb * 2**20), self.reduce_dtype, self.op, self.per_unit)

    def __repr__(self) -> str:
        if self.per_unit:
            return f"fs.bucket_reduce(per_unit=True, op={self.op!r})"
        return f"fs.bucket_reduce(bucket_mb={self.bucket_mb}, op={self.op!r})"
