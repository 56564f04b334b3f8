"""fs.offload_state: keep optimizer moments (and, with ``params=True``, parameter shards) in a store (CPU memory or
NVMe) and stream them through the update.

The optimizer state of the chosen units lives in ``store`` as chunk items: item ``(key, i)`` holds the rows the
optimizer declares (AdamW's two moments), stacked, over elements ``chunks[i]`` of the unit's
optimizer range; they are ``Stored`` leaves in the state (parameters: ``StoredParam``, fshard/state/_stored.py). The
update streams every active offloaded chunk, read(i+1) || update(i) || write(i-1) with a bounded number of buffers,
through the same optimizer kernel on the same
elements as without offload (bitwise: chunk boundaries are multiples of 16 elements, so vector lanes see every
element in the same position). An optimizer whose rows cannot stream (fs.muon, fs.partition, fs.adafactor) is
updated a whole unit at a time instead: read, its in-memory update, written back (fshard/offload/_whole.py). On a
2-D mesh each rank keeps its shard's state, placed by its shard rank, so replicas hold equal bits.

Purity: without ``donate``, updated chunks go under a new version key and the input state's items stay readable;
an item is deleted once no state refers to it (``store.delete_later``, carried out at the store's next
operation, whichever step function made it). With ``donate=True`` chunks are written back under their own key (the
store keeps the previous version readable until the new one is complete). The first step moves the chosen units'
state into the store; a failed write there raises ``OffloadError`` with the input state unchanged and usable
(unless donated).

``fraction`` chooses whole units, in model order, until their moments make up ``fraction`` of all moment bytes;
other units go to the update policy this one was given. With ``overlap_backward`` a unit's update starts in a worker
thread once its gradient shard is final, while backward runs (design/OFFLOAD.md); stored parameter shards are read
ahead of their gathers on a reader thread the policy owns too (fshard/offload/_reader.py); ``step.close()`` ends both.
``placement`` states where the transform keeps each unit (``fs.state.Where``), which ``fs.init(..., offload=)`` and
``fs.load(..., offload=)`` follow.
"""
from __future__ import annotations

import numbers
from typing import Any

from ..protocol._stages import UpdatePolicy
from ..errors import ArgumentError, ArgumentTypeError
from ._tiers import choose_tiers
from ._update import OffloadUpdate
from ..state._placement import Where
from ..state._stored import _location
from ..protocol._transform import Transform
from ..store._protocol import is_store
from ..store._stream import check_depth

_ALIGN = 16  # elements: chunk boundaries keep SIMD lanes in place (bitwise equal to the unchunked update)


class offload_state(Transform):
    """Keep ``fraction`` of the optimizer moments in ``store`` (``fs.CPUStore()`` or ``fs.NVMeStore(dir)``) and
    update them by streaming chunks of ``chunk_mb`` MiB per moment, ``depth`` reads ahead.

    Tiers: ``store`` may be a sequence of stores, nearest first (``(fs.CPUStore(), fs.NVMeStore(dir))``), with
    ``fraction`` a sequence of the same length: each store's share of the moment bytes, whole units in model
    order (the first units to the first store, the next ones to the second, ...); what the fractions leave stays
    on the device. So device, CPU memory and NVMe each hold a fraction, as ColossalAI's Gemini places chunks;
    ``step.plan(..., max_memory=)`` names fractions that fit a budget (``Plan.fractions``).

    overlap_backward: update a unit in a background thread as soon as its gradient shard is final, while backward
    goes on (identity grads stage, units whose parameters all got a gradient); the others are updated
    after backward. The result is bitwise the same either way. None (the default) turns it on when a store waits on
    a device (NVMeStore), whose I/O backward can hide, and off for in-memory stores, whose update is CPU work that
    would only compete with backward for the same cores (measured 1.9x slower on 2 cores), except on a GPU mesh,
    where backward runs on the device and the host's cores are free: on there (ZeRO-Offload's arrangement). On a
    GPU the gradient shards go down and parameters kept there come back through pinned memory on a copy stream
    (fshard/offload/_staging.py), and with ``params=True`` a pinned CPUStore's items go up straight to the gathers.
    worker_nice: how much lower the worker thread's CPU priority is than the caller's (Linux nice, 0-19), so that
    backward keeps the cores and the worker's I/O waits fill the gaps (5: uring steps 3-20% faster on 2 cores in
    all 7 A/B rounds, aio within noise; benchmarks/RESULTS.md, offload runs 6-7).
    params: keep the chosen units' fp32 parameter shards in the store too (``StoredParam``): each gather reads its
    unit's shard (ahead, on the reader thread this transform's policy owns), the update streams it beside the
    moments, and with donate + overlap_backward each unit's gradient shard is freed once updated, so memory holds a few units, not the model
    (design/OFFLOAD.md; a 4.87B GPT in 1.9 GiB per rank at world size 2, benchmarks/RESULTS.md). No
    ``param_copies`` for them: a gather casts what it reads.

    update_on: where a stored unit's update runs. "host" (the default): where the store is, by the host's cores
    (ZeRO-Offload's layout; on a GPU the gradient shards come down and parameters kept on the GPU go down and back).
    "device": on the mesh's device; each stored chunk (the optimizer's rows, and a stored parameter's head) goes up
    on a copy stream, is updated there beside the gradient, and comes back on another, after backward; up and down
    overlap (PCIe is full-duplex) with a pinned CPUStore updated in place (``pin=True``, ``donate=True``), and each
    chunk waits for its own copies otherwise. Use large chunks (``chunk_mb=64``): each costs Python a few launches.
    Which is faster is the host's memory bandwidth against the link's: the host update reads and writes 28 bytes of
    host memory a parameter (AdamW, fp32), the device update moves the rows' 8 bytes up and 8 down (12 and 12 with
    ``params=True``) by DMA (design/OFFLOAD.md, "On a GPU"). A number in (0, 1) uses both at once: that share of
    each step's stored units (by elements, whole units in model order) is updated on the device as "device" does
    and the rest by the host's cores as "host" does, a chunk of each in turn on the step's thread (the device's
    copies run on while the host's kernel does, where they write in place: ``pin=True``, ``donate=True``); the
    best share makes both end together (0.0 is "host", 1.0 "device"). The result is the same bits either way, as
    without offload. An optimizer that cannot stream is updated a whole unit at a time whatever ``update_on`` says
    (fshard/offload/_whole.py).

    Metrics: ``io/read_bytes``, ``io/write_bytes``, ``io/gbps``, ``time/io_wait`` (the step's wait on the store
    after backward: I/O nothing hid), ``update/overlapped_units`` and ``time/overlapped_update`` (units updated
    during backward, and the worker's time on them), ``store/resident_bytes``, and ``io/param_read_bytes`` (the
    gathers' reads of stored parameter shards, also in ``io/read_bytes``)."""

    name = "offload_state"
    stages = {"update": "set"}  # one policy per step; units it does not take go to the policy it was given

    def __init__(self, store: Any, fraction: float | tuple = 1.0, chunk_mb: float = 4, depth: int = 2,
                 overlap_backward: bool | None = None, worker_nice: int = 5, params: bool = False,
                 update_on: str | float = "host"):
        self.stores, self.fractions = _tiers(store, fraction)
        share = {"host": 0.0, "device": 1.0}.get(update_on, update_on) if isinstance(update_on, str) else update_on
        if isinstance(share, bool) or not isinstance(share, numbers.Real) or not 0.0 <= share <= 1.0:
            raise ArgumentError(f"fs.offload_state: update_on must be 'host' (the update runs where the store is: "
                                f"ZeRO-Offload's layout), 'device' (the stored chunks go to the mesh's device for "
                                f"the update and come back) or a share in [0, 1] of the units updated on the "
                                f"device while the host updates the rest (update_on=0.4), got {update_on!r}.")
        if share > 0 and overlap_backward:
            raise ArgumentError(f"fs.offload_state: update_on={update_on!r} streams the stored chunks through the "
                                f"device after backward, so overlap_backward=True cannot hold; leave "
                                f"overlap_backward out (or False), or use update_on='host' to update during backward.")
        if not chunk_mb > 0 or not isinstance(depth, int) or depth < 1:
            raise ArgumentError(f"fs.offload_state: chunk_mb must be > 0 and depth an int >= 1, got {chunk_mb!r}, "
                                f"{depth!r}.")
        if not isinstance(worker_nice, int) or not 0 <= worker_nice <= 19:
            raise ArgumentError(f"fs.offload_state: worker_nice must be an int in [0, 19], got {worker_nice!r}.")
        if not isinstance(params, bool):
            raise ArgumentTypeError(f"fs.offload_state: params must be True or False, got {params!r}.")
        # streams open at once on a store: the moments' (and the parameters'), on the device's side and the host's;
        # each holds depth + 2 pool buffers, and check_depth asks for its argument + 2
        streams = (2 if params else 1) * (2 if 0 < share < 1 else 1)
        for st in self.stores:
            check_depth(st, streams * (depth + 2) - 2, f"fs.offload_state(depth={depth}"
                        f"{', params=True' if params else ''}{f', update_on={share}' if 0 < share < 1 else ''})")
        self.params, self.chunk_mb, self.depth = params, chunk_mb, depth
        on_disk = any(st.directory is not None for st in self.stores)  # a store that waits on a device
        # None: decided per step by where the update runs against backward (OffloadUpdate.overlaps)
        self.overlap_backward = False if share > 0 else True if on_disk and overlap_backward is None else (
            None if overlap_backward is None else bool(overlap_backward))
        self.worker_nice, self.update_on = worker_nice, update_on
        self.device_share = float(share)  # of each step's stored units' elements, updated on the device

    @property
    def store(self):
        """The store (the farthest one, with tiers)."""
        return self.stores[-1]

    @property
    def fraction(self) -> float:
        """The share of the moment bytes offloaded, all tiers together."""
        return sum(self.fractions)

    @property
    def chunk_numel(self) -> int:
        """Elements of each moment per store item."""
        return max(_ALIGN, int(self.chunk_mb * 2**20) // 4 // _ALIGN * _ALIGN)  # fp32 moments

    def placement(self, units, rank: int) -> dict:
        """Unit name -> ``fs.state.Where`` (its tier's store, ``chunk_numel``, ``params``) for the units this
        transform keeps in a store, among ``units`` (those with optimizer state) on shard rank ``rank`` (a 2-D
        mesh's ``shard_rank``: replicas place alike): the ``Placement`` protocol
        (fshard/state/_placement.py), which ``fs.init(..., offload=)`` and ``fs.load(..., offload=)`` follow, so the
        step finds each unit where it would have put it."""
        tiers = choose_tiers(list(units), rank, self.fractions)
        return {name: Where(self.stores[t], self.chunk_numel, self.params) for name, t in tiers.items()}

    def wrap_update(self, update: UpdatePolicy) -> UpdatePolicy:
        return OffloadUpdate(update, self.stores, self.fractions, self.chunk_numel, self.depth, self.overlap_backward,
                             self.worker_nice, self.params, self.device_share)

    def init_state(self, spec, old):
        """No state of its own. An optimizer that cannot stream (fs.muon, fs.partition, fs.adafactor) is updated a
        whole unit at a time (fshard/offload/_whole.py); on a 2-D mesh each rank keeps its shard's state (its
        shard group's 1/k), and the replicas of a shard hold equal bits."""
        return None

    def fingerprint(self) -> str:
        """The kinds of store and the placement, not their directories: each rank may offload to a disk of its
        own."""
        return (f"fs.offload_state({', '.join(type(st).__name__ for st in self.stores)}, fraction={self.fractions}, "
                f"chunk_mb={self.chunk_mb}, depth={self.depth}, overlap_backward={self.overlap_backward}, "
                f"params={self.params}, update_on={self.device_share})")  # ("device" and 1.0 alike)

    def __repr__(self) -> str:
        extra = (", params=True" if self.params else "") + (f", update_on={self.update_on!r}" if self.device_share
                                                            else "")
        if len(self.stores) == 1:
            return f"fs.offload_state({_location(self.store)}, fraction={self.fractions[0]}{extra})"
        return f"fs.offload_state(({', '.join(map(_location, self.stores))}), fraction={self.fractions}{extra})"


def _tiers(store, fraction) -> tuple[tuple, tuple]:
    """(stores, fractions) from offload_state's arguments: one store and a float, or a sequence of stores and one
    fraction each, their sum at most 1."""
    many = isinstance(store, (tuple, list))
    stores = tuple(store) if many else (store,)
    bad = [st for st in stores if not is_store(st)]
    if not stores or bad:
        got = type(bad[0]).__name__ if bad else "an empty sequence"
        raise ArgumentTypeError(f"fs.offload_state: store must be an fs.CPUStore() or fs.NVMeStore(directory) (or "
                                f"have every method and attribute of fs.Store), or a sequence of them (tiers, nearest "
                                f"first), got {got}.")
    if len({id(st) for st in stores}) < len(stores):
        raise ArgumentError("fs.offload_state: a store appears twice among the tiers; give each tier its own store.")
    fracs = tuple(fraction) if isinstance(fraction, (tuple, list)) else (fraction,)
    if many and not isinstance(fraction, (tuple, list)):
        raise ArgumentTypeError(f"fs.offload_state: with {len(stores)} stores (tiers), fraction is a sequence of "
                                f"{len(stores)} fractions, one per store (e.g. fraction=(0.3, 0.5): 30% of the moments "
                                f"in the first store, 50% in the second, 20% on the device), got {fraction!r}.")
    if (len(fracs) != len(stores) or not all(isinstance(f, (int, float)) and 0.0 <= f <= 1.0 for f in fracs)
            or sum(fracs) > 1.0 + 1e-9):
        raise ArgumentError(f"fs.offload_state: fraction must be in [0, 1] (one per store, summing to at most 1), "
                            f"got {fraction!r} for {len(stores)} store(s).")
    return stores, tuple(float(f) for f in fracs)

