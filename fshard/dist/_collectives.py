"""The collectives of one step: torch.distributed calls, plus a record of what was issued.

Every collective goes through a ``Comm``, which keeps (a) a hash of the sequence of collectives, which ranks
compare at the end of the step so that a divergence is an error rather than silently mixed data, and with
``verify`` checks each one across ranks before it is issued (fshard/dist/_agreement.py; ahead for a sequence of
exchanges, ``promise``, or the steps before's, ``follow``: _promises.py, _replay.py), (b) seconds spent per kind,
for the step's profile, (c) optionally the full list, which tests compare across ranks, and (d) optionally a
timeline of spans (``fs.compose(..., timeline=True)``, drawn by ``fs.timeline``).

On a 2-D mesh (HSDP) gathers and reductions run in the rank's shard group, ``replicate`` all-reduces a reduced shard
in its replica group (phase "replica"); checks, ``all_reduce`` (unless ``over="shard"``) and the vote: every rank.

Gathers return a ``Flight``, waited on right before the data is used. Time is kept two ways: ``exposed``, how long
compute waited on gathers, and ``busy``, the wall time with one in flight (equal when each is waited at once).

How a gather is done is chosen per backend from measurements (design/COLLECTIVES.md): on gloo, N broadcasts
(one per source rank, into views of the output), 0.43-0.82x the time of ``all_gather_into_tensor``, NCCL's native
ring; ``FSHARD_GATHER`` overrides it (read once: ``Mesh.gather_impl``). Each is an exact copy of every shard.
"""
from __future__ import annotations

import contextlib
import time
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from ..errors import ArgumentError
from ._bare import all_gather_single, bare, swap, swap_halves
from ._agreement import HASH_BITS, describe, exchange, wait_works
from ._promises import Promises
from ._replay import (Item, Replay, zeros_all_reduce, zeros_gather, zeros_reduce_each, zeros_reduce_scatter,
                      zeros_replicate)
from ._protocol import Exchange
from ._flight import Flight
from ._mesh import _FASTEST_GATHER, Mesh


class Comm:
    def __init__(self, mesh: Mesh, trace: bool = False, stream=None, timeline: bool = False, dry: bool = False,
                 verify: bool = False, context: str = ""):
        self.mesh = mesh
        self.verify = verify  # compare each collective across ranks before issuing it (``_check``)
        self.context = context  # where this Comm works, for messages ("step 5")
        self.closed = False  # every rank knows this step failed (a check said so, or the transport broke)
        self.vote_next = False  # the other ranks' next collective is the commit vote (a check), whatever ``verify``
        self.dry = dry  # step.plan: every collective is recorded and counted as usual, but moves nothing
        self.trace: list[tuple] | None = [] if trace else None
        # timeline=True: (lane, label, start, end) in perf_counter seconds, appended from any thread (list.append
        # is atomic); gathers and reductions are added from their flights by ``timeline()``; "wait" spans are
        # compute's time on a collective: issuing it, and blocking in wait() while it still ran
        self.spans: list[tuple] | None = [] if timeline else None
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.flights: dict[str, list[Flight]] = defaultdict(list)
        self.reduce_buffer_bytes = 0  # the largest buffer one reduction read (a unit's gradient, or a bucket)
        auto = _FASTEST_GATHER.get(mesh.backend, "all_gather")  # how gathers are done: the backend's measured
        self.impl = auto if mesh.gather_impl == "auto" else mesh.gather_impl  # fastest, or FSHARD_GATHER's
        # a shard group of two on gloo sums two by an exchange (``swap``), whatever the tensors: design/COLLECTIVES.md
        self.swaps = mesh.backend == "gloo" and mesh.shard_size == 2 and mesh.shard_group is not None
        self.stream = stream  # CUDA: the side stream gathers run on (None: the current stream)
        self._hash = 0
        self._promised = Promises()  # the exchanges checked ahead (``promise``), not issued yet
        self._replay: Replay | None = None  # the sequence of the steps before, checked once (``follow``)
        self._record: list[Item] | None = None  # what this step issues from ``follow`` on, for the steps after
        self._zeroing = False  # issuing the rest of a sequence with zeros (``Replay.leave``): nothing checked
        self._left = False  # this step left the sequence it followed

    def span(self, lane: str, label: str, t0: float, t1: float) -> None:
        """Add a span to this step's timeline, if one is being recorded."""
        if self.spans is not None:
            self.spans.append((lane, label, t0, t1))

    def timeline(self, origin: float) -> tuple:
        """The recorded spans and one per gather and reduction (issue to completion), in seconds since
        ``origin``, ordered by start."""
        flights = [(p, f.tag, f.t_issue, f.t_done if f.t_done is not None else f.t_issue)
                   for p in ("gather", "reduce", "replica", "exchange") for f in self.flights[p]]
        return tuple(sorted(((lane, label, a - origin, b - origin) for lane, label, a, b in self.spans + flights),
                            key=lambda s: s[2]))

    @property
    def seq_hash(self) -> int:
        return self._hash & ((1 << HASH_BITS) - 1)

    def _note(self, kind: str, tag: str, t: torch.Tensor, check: bool = True, sizes=None, nbytes=None,
              zeros=None) -> None:
        entry = (kind, tag, str(t.dtype).removeprefix("torch."), t.numel() if sizes is None else sizes)
        if check:
            self._check(entry, zeros=zeros)
        self._hash = zlib.crc32(repr(entry).encode(), self._hash)
        self.bytes[kind] += t.nbytes if nbytes is None else nbytes
        if self.trace is not None:
            self.trace.append(entry)

    def _check(self, entry: tuple, force: bool = False, zeros=None) -> None:
        """With ``verify`` (or ``force``): before a collective, one all-gather of two numbers tells whether every
        rank is about to issue the same one and none has failed (fshard/dist/_agreement.py: ``exchange``). Every rank
        raises at the same check, so none is left waiting, and gloo never sees collectives of different sizes
        (which it answers by aborting the process). Unchecked where it is the next collective of the sequence
        being followed (``follow``); ``zeros``: how to issue it with zeros, should a later step follow it."""
        if not force:
            self.vote_next = False  # an update policy's own collective: the others may be in it, not at the vote
        if self._zeroing:
            return  # (a sequence's rest, with zeros: the ranks still in it issue these unchecked)
        if self._record is not None and not force:
            self._record.append((entry, zeros))
        if self._replay is not None and not force:
            if self._replay.take(entry):
                return
            self.leave_sequence()
        self._promised.refuse(describe(entry))  # (the others are in, or on their way to, what was promised)
        if not (self.verify or force) or self.mesh.world_size == 1 or self.dry or self.closed:
            return  # (one rank, with or without a process group, has no other rank to disagree with)
        exchange(self, entry)

    def follow(self, items: list[Item] | None) -> None:
        """From here on, record what this step issues (``end_sequence``) and, if every rank agreed on ``items`` (the
        sequence of the steps before; ``check_ranks`` compared it), issue each collective unchecked while it is
        the next of them (fshard/dist/_replay.py). Only with ``verify``, on more than one rank."""
        if not self.verify or self.mesh.world_size == 1 or self.dry:
            return
        self._record = []
        self._replay = Replay(items) if items else None

    def leave_sequence(self) -> None:
        """Issue what is left of the sequence being followed with zeros, so that no rank still in it waits, and
        follow it no more (this rank's step took another path, or failed)."""
        replay, self._replay = self._replay, None
        if replay:
            self._left = self._zeroing = True
            try:
                replay.leave(self)
            finally:
                self._zeroing = False

    def end_sequence(self) -> tuple[list[Item] | None, bool]:
        """The end of what ``follow`` covers (the agreement after backward is next): the sequence's rest is issued
        with zeros. Returns what this step issued since ``follow`` (None: not recorded) and whether it left it."""
        self.leave_sequence()
        record, self._record = self._record, None
        return record, self._left

    def vote(self, tag: str) -> None:
        """A check with no collective after it, made whether or not ``verify`` is on: the step's commit. Returns on
        every rank or raises on every rank (``RankFailedError`` if one has failed)."""
        self._check(("vote", tag, "", 0), force=True)

    def fail(self, error: BaseException) -> bool:
        """This rank raised ``error`` mid-step: complete what is in flight, then post the failure at the other
        ranks' next check, where each raises ``RankFailedError`` naming this rank's error (exchanges promised and not
        issued yet are first issued with zeros, so that no rank waits in one). Only where every collective is
        checked, or checked ahead (otherwise the others may be waiting in a collective this rank never issues: they
        time out with a ``CollectiveError``); not for KeyboardInterrupt or SystemExit (every rank gets its own
        Ctrl-C; an exiting rank is a dead one to the others), nor when the ranks already know (``closed``).
        Returns whether the other ranks know (posted, or known before), for the failing rank's message."""
        self.drain()
        if self.closed or self.mesh.group is None or self.dry:
            return True
        if not (self.verify or self.vote_next) or not isinstance(error, Exception):
            return False
        try:
            self.leave_sequence()  # (before the failure is posted: the others may be in the sequence, not at a check)
            self._promised.keep(self)
            exchange(self, ("fail", "", "", 0), failure=error)
        except Exception:  # noqa: BLE001 - the transport broke too; the rank's own error is the one to report
            return False
        return True

    def unanimous(self, error: Exception) -> Exception:
        """Mark ``error`` as one every rank raises at this point (from values they agreed on): no rank posts it."""
        self.closed = True
        return error

    # --- gathers -------------------------------------------------------------------------------------------------

    def gather_scope(self):
        """Where a gather's output is allocated and its collective issued. On CUDA that is the gather stream, so
        the caching allocator ties the buffer to it (see ``before_free``); elsewhere nothing."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())  # the shard may have just been written
        return torch.cuda.stream(self.stream)

    def before_free(self) -> None:
        """Call before freeing a gathered buffer. On CUDA the buffer returns to the gather stream's pool at once,
        so the gather stream must not reuse it before compute has finished reading it: order the gather stream
        after everything compute has queued (FSDP2's alternative to ``record_stream``)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())

    def gather(self, out: torch.Tensor, shard: torch.Tensor, tag: str) -> Flight:
        """Start ``out <- concatenation of every rank's shard`` (the ranks of this rank's shard group); wait on the
        returned flight before reading out."""
        self._note("all_gather", tag, out, zeros=zeros_gather(out.numel(), out.dtype, tag))
        t0 = time.perf_counter()
        g, n, rank = self.mesh.shard_group, self.mesh.shard_size, self.mesh.shard_rank
        if self.stream is not None and shard.is_cuda:  # made on another stream (a cast): not reused under the gather
            shard.record_stream(self.stream)
        if self.dry:
            works = []
        elif n == 1:  # one rank: a local copy (casting, where the shard is not in the compute dtype), none at all
            if not _same(out, shard):  # where the gathered buffer is the shard itself (UnitRun._whole)
                out.copy_(shard)
            works = []
        elif self.impl == "all_gather":
            with bare():
                works = [all_gather_single(out, shard, g)]
        elif self.impl == "broadcast":
            parts = out.chunk(n)
            parts[rank].copy_(shard)
            with bare():
                works = [dist.broadcast(parts[r], group_src=r, group=g, async_op=True) for r in range(n)]
        else:  # all_reduce of a buffer that is -0.0 except this rank's shard: x + (-0.0) == x for every float x
            out.fill_(-0.0 if out.is_floating_point() else 0)
            out.chunk(n)[rank].copy_(shard)
            with bare():
                works = [dist.all_reduce(out, group=g, async_op=True)]
        return self._flight(works, t0, "gather", tag)

    def _flight(self, works: list, t0: float, phase: str, tag: str, then=None, scratch: tuple = ()) -> Flight:
        f = Flight(self, works, t0, phase, tag, then, scratch)
        self.flights[phase].append(f)
        self.seconds[phase + "_exposed"] += (t1 := time.perf_counter()) - t0  # issuing runs on the compute thread
        if self.spans is not None:  # so the timeline counts it as exposed, as a wait that blocked
            self.spans.append(("wait", f"{phase}:{tag}", t0, t1))
        return f

    def drain(self) -> None:
        """Complete every collective still in flight (after an error: nothing may write into freed memory, and
        the next step must not pair with this one's leftovers)."""
        for flights in self.flights.values():
            for f in flights:
                try:
                    f.wait()
                except Exception:  # noqa: BLE001 - already failing; the first error is the one reported
                    pass

    def busy_seconds(self, phase: str) -> float:
        """Wall time during which at least one collective of ``phase`` was in flight (the union of their
        intervals)."""
        total, end = 0.0, float("-inf")
        for f in sorted(self.flights[phase], key=lambda f: f.t_issue):
            done = f.t_done if f.t_done is not None else f.t_issue
            if done > end:
                total += done - max(f.t_issue, end)
                end = done
        return total

    # --- reductions ----------------------------------------------------------------------------------------------

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, tag: str) -> None:
        """Blocking gather (outside a step: fs.full_params)."""
        self.gather(out, shard, tag).wait()

    def gather_to_first(self, out: torch.Tensor | None, shard: torch.Tensor, tag: str) -> None:
        """Blocking gather of every rank's shard into rank 0's ``out`` (the others pass None and get nothing):
        fs.full_state_dict(rank0_only=True). On a 2-D mesh rank 0's shard group gathers; the other groups hold
        copies of the same shards and send nothing."""
        self._note("gather_to_first", tag, shard)
        mesh = self.mesh
        if mesh.shard_size == 1:  # (the shard is the whole unit)
            if out is not None:
                out.copy_(shard)
        elif not self.dry and mesh.replica_rank == 0:  # (waited for as every collective: interruptible, named)
            pieces = list(out.split(shard.numel())) if mesh.shard_rank == 0 else None
            with bare():
                work = dist.gather(shard, gather_list=pieces, group_dst=0, group=mesh.shard_group, async_op=True)
            wait_works([work], self, lambda: f"its gather of {tag!r} to rank 0")

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, tag: str) -> Flight:
        """Start ``out <- this rank's slice of the shard group's sum of full`` (2-D: ``replicate`` next). On gloo,
        in a group of two ``reduce_each``'s exchange into ``out``, ours added by the wait (2-6x faster; same bits)"""
        n = self.mesh.shard_size
        if out.numel() * n != full.numel() or out.dtype != full.dtype:  # (before the check, where the others raise)
            raise ArgumentError(f"Comm.reduce_scatter({tag!r}): out is {out.numel()} x {out.dtype} and full "
                                f"{full.numel()} x {full.dtype}; out takes 1/{n} of full, in full's dtype.")
        self._note("reduce_scatter", tag, full, zeros=zeros_reduce_scatter(full.numel(), full.dtype, tag))
        self.reduce_buffer_bytes = max(self.reduce_buffer_bytes, full.nbytes)
        t0 = time.perf_counter()
        g, then, scratch = self.mesh.shard_group, None, ()
        if self.dry:
            works = []
        elif n == 1:  # one rank: the sum is the gradient; a copy only into another buffer
            if not _same(out, full):
                out.copy_(full)
            works = []
        elif self.swaps:
            with bare():
                work, then, scratch = swap_halves(out, full, self.mesh.shard_rank, g)
            works = [work]
        else:
            with bare():
                works = [dist.reduce_scatter_tensor(out, full, group=g, async_op=True)]  # (SUM)
        return self._flight(works, t0, "reduce", tag, then, scratch)

    def reduce_each(self, sections: list[torch.Tensor], tag: str, empty=None) -> Flight:
        """Start one SUM reduce per rank of the shard group: ``sections[r]`` (sizes may differ) summed into shard
        rank r's. On gloo in a group of two an exchange (``swap``: the other's part of ours into a buffer from
        ``empty(numel, dtype)`` or new, in ``reduce_buffer_bytes``, added by the wait), else a ``reduce`` to each
        owner (bitwise both: design/COLLECTIVES.md)."""
        sizes = [t.numel() for t in sections]
        self._check(("reduce", tag, str(sections[0].dtype).removeprefix("torch."), "+".join(map(str, sizes))),
                    zeros=zeros_reduce_each(sizes, sections[0].dtype, tag))  # one check for the call's N reduces
        for r, t in enumerate(sections):
            self._note("reduce", f"{tag}/r{r}", t, check=False)
        g, then, scratch = self.mesh.shard_group, None, ()
        mine = sections[self.mesh.shard_rank] if self.swaps else None
        self.reduce_buffer_bytes = max(self.reduce_buffer_bytes, sum(t.nbytes for t in sections) + (
            mine.nbytes if self.swaps else 0))
        t0 = time.perf_counter()
        with bare():
            if g is None or self.dry or self.mesh.shard_size == 1:
                works = []
            elif self.swaps:  # (see the docstring)
                got = torch.empty_like(mine) if empty is None else empty(mine.numel(), mine.dtype)
                works = [swap(got, sections[1 - self.mesh.shard_rank], 1 - self.mesh.shard_rank, g)]
                then, scratch = (lambda: mine.add_(got)), (got,)
            else:
                works = [dist.reduce(t, group_dst=r, op=dist.ReduceOp.SUM, group=g, async_op=True)
                         for r, t in enumerate(sections)]
        return self._flight(works, t0, "reduce", tag, then, scratch)

    def promise(self, exchanges) -> None:
        """One check for the ``exchange`` calls about to follow (``Exchange`` tuples, in order; see
        ``fs.protocol.Collectives.promise``): each is then issued unchecked, so that the ranks are not brought
        together at each (fshard/dist/_promises.py). Without ``verify`` nothing is checked anyway, and nothing is
        kept."""
        plan = [Exchange(e[0], e[1], e[2], tuple(e[3]), tuple(e[4])) for e in exchanges]
        if not plan or not self.verify or self.mesh.shard_size == 1 or self.dry or self.closed:
            return
        self._check(self._promised.entry(plan))  # (refused there while exchanges promised before are left)
        self._promised.add(plan)

    def exchange(self, out, inp, out_splits: list, in_splits: list, tag: str, sizes: str) -> Flight:
        """Start an all-to-all in the shard group: piece r of ``inp`` (``in_splits``) to shard rank r, and rank r's
        piece for this rank into piece r of ``out``; ``sizes``: the group's table. Counted: the bytes sent away.
        Checked before it is issued, unless ``promise`` checked it ahead."""
        promised = self._promised.is_next(tag, sizes, inp.dtype, out_splits, in_splits)
        sent = inp.nbytes - in_splits[self.mesh.shard_rank] * inp.itemsize
        self._note("exchange", tag, inp, not promised, sizes, sent)
        t0, g, works = time.perf_counter(), self.mesh.shard_group, []
        if self.mesh.shard_size == 1 and not self.dry:  # one rank: every piece is its own
            out.copy_(inp)
        elif not self.dry:
            with bare():
                works = [dist.all_to_all_single(out, inp, out_splits, in_splits, group=g, async_op=True)]
        if promised:
            self._promised.issued()
        return self._flight(works, t0, "exchange", tag)

    def replicate(self, t: torch.Tensor, tag: str, sizes: str | None = None) -> Flight:
        """Start the SUM all-reduce of a reduced shard ``t`` over this rank's replica group (2-D meshes: the ranks
        holding the same shard; nothing on a 1-D mesh). ``sizes``: what every rank checks and hashes in place of
        ``t``'s size where shard ranks' sizes differ (a bucket's sections), so the entry is the same on every rank."""
        entry = ("all_reduce_replicas", tag, str(t.dtype).removeprefix("torch."), t.numel() if sizes is None else sizes)
        self._check(entry, zeros=zeros_replicate(t.numel(), t.dtype, tag, sizes))
        self._hash = zlib.crc32(repr(entry).encode(), self._hash)
        self.bytes["replica"] += t.nbytes
        if self.trace is not None:
            self.trace.append(entry)
        t0 = time.perf_counter()
        g = self.mesh.replica_group
        with bare():
            works = [] if g is None or self.dry or self.mesh.replicas == 1 else [
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g, async_op=True)]
        return self._flight(works, t0, "replica", tag)

    def all_reduce(self, t: torch.Tensor, tag: str, op=dist.ReduceOp.SUM, over: str = "world") -> torch.Tensor:
        """In-place all-reduce of a small control tensor; not hashed (it carries the hash check itself). ``over``:
        "world" (every rank) or "shard" (this rank's shard group: a sum over the shards of a 2-D mesh, each counted
        once, the replica groups each making the same one)."""
        entry = ("all_reduce", tag, str(t.dtype).removeprefix("torch."), t.numel())
        self._check(entry, zeros=zeros_all_reduce(t.numel(), t.dtype, tag, op, over))
        if self.trace is not None:
            self.trace.append(entry)
        t0 = time.perf_counter()
        if over not in ("world", "shard"):
            raise ArgumentError(f"Comm.all_reduce(over={over!r}): over is 'world' or 'shard'.")
        g, n = (self.mesh.control_group, self.mesh.world_size) if over == "world" else \
            (self.mesh.shard_group, self.mesh.shard_size)
        if g is not None and n > 1:  # (the sum over one rank is its own value)
            self.bytes["control"] += t.nbytes
            if not self.dry:
                with bare():
                    work = dist.all_reduce(t, op=op, group=g, async_op=True)
                wait_works([work], self, lambda: f"its {tag!r}")
        t1 = time.perf_counter()
        self.seconds["control"] += t1 - t0
        if self.spans is not None:
            self.spans.append(("control", tag, t0, t1))
        return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory, element for element (so a copy between them is a no-op)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)
