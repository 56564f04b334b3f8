"""The state leaves of offload_state: ``Stored``, one row of a unit's optimizer-state chunks held in a store; ``StoredParam``, a
unit's parameter shard held in a store (``offload_state(params=True)``); and what a store needs on disk
(``_disk_need``, for the message of a full disk).

It is data like any other leaf: ``print(state)`` shows its key, bytes and location, and ``load()`` reads it back.
``_Items`` ties the chunk keys of one version to the leaves that refer to them: once no state refers to them any
more, the store is told to delete them (``store.delete_later``), whichever step function wrote them.
"""
from __future__ import annotations

import shutil
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import ArgumentError
from ..store._protocol import locked

READS_IN_FLIGHT = 4  # chunk reads a parameter shard's load keeps in flight


class _Items:
    """The chunk items of one version of one unit's optimizer rows (item i: the rows, stacked in the optimizer's
    declared order, over elements ``chunks[i]``; ``rows``: their names), or of a parameter shard (``("param",)``).
    When the last Stored leaf referring to them is collected, their keys go to ``store.delete_later``: the store
    deletes them at its next operation (the finalizer may run in any thread, in the middle of another store
    operation)."""

    def __init__(self, store, key: str, chunks, rows: tuple[str, ...]):
        self.store, self.key, self.chunks, self.rows = store, key, tuple(chunks), rows
        weakref.finalize(self, store.delete_later, [(key, i) for i in range(len(self.chunks))])

    def item_keys(self):
        return [(self.key, i) for i in range(len(self.chunks))]


class _Flat:
    """What a stored leaf answers as a flat tensor would: its shape, device (where ``load()`` puts it) and bytes."""

    numel: int
    dtype: torch.dtype
    is_meta = False  # (TrainState.abstract asks every parameter leaf)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.numel,)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class Stored(_Flat):
    """A state leaf whose data is in a store: row ``row`` (in the optimizer's declared order) of a unit's chunks."""

    items: _Items = field(repr=False)
    row: int
    numel: int
    dtype: torch.dtype
    location: str

    @property
    def key(self) -> str:
        return self.items.key

    def load(self) -> torch.Tensor:
        """The tensor, read back from the store (for inspection and tests)."""
        out = torch.empty(self.numel, dtype=self.dtype)
        for (lo, hi), k in zip(self.items.chunks, self.items.item_keys()):
            if lo < self.numel:  # (a compact row stacked with longer ones ends before the items do: put_moments)
                out[lo:min(hi, self.numel)] = self.items.store.get(k).wait()[self.row, :min(hi, self.numel) - lo]
        return out

    def __repr__(self) -> str:
        return f"Stored({self.key!r} {self.items.rows[self.row]}, {self.nbytes:,} B, {self.location})"


@dataclass(frozen=True, eq=False)
class StoredParam(_Flat):
    """A state leaf in ``state.params``: a unit's parameter shard (its master weights) held in a store. ``head``:
    items ``(key, i)`` of shape ``(1, n)`` over the shard's optimizer range ``[0, opt_numel)``, chunked as its
    moments are (item i holds the parameters of moment item i), so the update streams both side by side and writes
    a new version of the head each step. ``tail``: items over the rest of the shard (frozen parameters and padding),
    never written, shared by every version. Either is None when empty."""

    head: _Items | None = field(repr=False)
    tail: _Items | None = field(repr=False)
    numel: int
    opt_numel: int
    dtype: torch.dtype
    location: str

    @property
    def key(self) -> str:
        return (self.head or self.tail).key

    def load(self, dtype: torch.dtype | None = None, pin: bool = False) -> torch.Tensor:
        """The shard, read back from the store into a new CPU tensor, cast to ``dtype`` (its own by default) as each
        item lands. Each store operation holds the store's lock (``locked(store)``) by itself, so a thread that
        streams an update through the same store interleaves with these reads item by item. ``READS_IN_FLIGHT``
        items are read at a time, each into the store's own memory (in place, no staging), then copied (cast)
        into the result: the shard in its stored dtype is never whole in memory. A store with ``read_into`` (the
        CPUStore) copies each item straight into the result, cast, in one pass. ``pin``: the result in pinned
        memory, for an asynchronous copy to a GPU."""
        out = torch.empty(self.numel, dtype=self.dtype if dtype is None else dtype, pin_memory=pin)
        store, pending = (self.head or self.tail).store, deque()
        # (looked up on the class: a wrapper that forwards other calls through __getattr__ keeps its own get)
        if getattr(type(store), "read_into", None) is not None:
            read_into = store.read_into
            for part, base in ((self.head, 0), (self.tail, self.opt_numel)):
                for (lo, hi), k in zip(part.chunks, part.item_keys()) if part is not None else ():
                    with locked(store):
                        read_into(k, out[base + lo:base + hi])
            return out

        def land():
            (lo, hi), h = pending.popleft()
            with locked(store):
                t = h.wait()
            out[lo:hi].copy_(t.view(-1))  # (the cast, outside the lock)

        for part, base in ((self.head, 0), (self.tail, self.opt_numel)):
            for (lo, hi), k in zip(part.chunks, part.item_keys()) if part is not None else ():
                if len(pending) == READS_IN_FLIGHT:
                    land()
                with locked(store):
                    pending.append(((base + lo, base + hi), store.get(k)))
        while pending:
            land()
        return out

    def direct(self, device: torch.device) -> bool:
        """Whether the shard can go to ``device`` straight from the store's memory: a GPU, and a store that lends
        its items (``borrow``, looked up on its class) and pins them (a CPUStore made with ``pin=True``, its
        default where CUDA is present)."""
        store = (self.head or self.tail).store
        return (device.type == "cuda" and getattr(type(store), "borrow", None) is not None
                and bool(getattr(store, "pin", False)))

    def upload(self, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The shard on ``device`` in ``dtype`` (``direct`` stores): each item copied from the store's pinned memory
        to the device asynchronously on the current stream, then cast there. No host copy, no reader thread: the
        copy engine does the work (FSDP2's CPU offload moves its parameters so). An item deleted meanwhile (an old
        version) is not reused under its copy: the pinned allocator waits for the copies recorded on it."""
        store = (self.head or self.tail).store
        out = torch.empty(self.numel, dtype=self.dtype, device=device)
        for part, base in ((self.head, 0), (self.tail, self.opt_numel)):
            for (lo, hi), k in zip(part.chunks, part.item_keys()) if part is not None else ():
                with locked(store):
                    src = store.borrow(k)
                out[base + lo:base + hi].copy_(src.view(-1), non_blocking=True)
        return out if dtype is None or dtype == self.dtype else out.to(dtype)

    def renewed(self, head: _Items | None) -> "StoredParam":
        """The same shard with a new version of its head (the tail is shared)."""
        return StoredParam(head, self.tail, self.numel, self.opt_numel, self.dtype, self.location)

    def __repr__(self) -> str:
        return f"StoredParam({self.key!r}, {self.nbytes:,} B, {self.location})"


def put_param(store, key: str, p: torch.Tensor, opt_numel: int, chunk: int, created: list) -> StoredParam:
    """The parameter shard ``p`` written to ``store`` (the caller holds its lock): its head ``[0, opt_numel)`` as
    items ``(key, i)`` chunked as the moments, its tail as items ``(key + "/tail", i)``; keys noted in ``created``.
    Each item is put straight from ``p`` wherever it is (a GPU shard goes down item by item into the store's pinned
    memory), never through a host copy of the whole shard."""
    p = p.detach()
    parts = []
    for k, (lo, hi) in ((key, (0, opt_numel)), (key + "/tail", (opt_numel, p.numel()))):
        if hi <= lo:
            parts.append(None)
            continue
        chunks, handles = _chunks(hi - lo, chunk), []
        for i, (a, b) in enumerate(chunks):
            handles.append(store.put((k, i), p[lo + a:lo + b].reshape(1, -1)))
            created.append((k, i))
        for h in handles:
            h.wait()
        parts.append(_Items(store, k, chunks, rows=("param",)))
    return StoredParam(parts[0], parts[1], p.numel(), opt_numel, p.dtype, _location(store))


def param_key(key: str) -> str:
    """The key of a stored parameter's head written beside moments under ``key``."""
    return key + "/param"


def put_moments(store, key: str, s, names: tuple[str, ...], chunk: int, created: list):
    """``s``'s rows (named ``names``, the optimizer's declared rows) written to ``store`` (the caller holds its lock)
    as chunk items ``(key, i)``, the rows stacked, each key noted in ``created`` as it is written: the same state
    with Stored leaves. Rows of different lengths (compact rows: fs.partition's, fs.adafactor's) are stacked zero
    padded at their end to the longest one, so element f of every row sits at column f - lo of chunk (lo, hi)."""
    rows = s.rows
    if not rows:  # an optimizer without per-parameter rows (plain SGD): nothing to keep in the store
        return s
    if len({r.dtype for r in rows}) > 1:
        raise ArgumentError(f"fs.offload_state keeps a unit's optimizer rows stacked in one store item, so they need "
                            f"one dtype; the rows {names} are {[r.dtype for r in rows]}. Keep this optimizer's state "
                            "on the device (offload_state(fraction=0) or no offload).")
    items = _Items(store, key, _chunks(max(r.numel() for r in rows), chunk), names)
    write_rows(items, rows, created)
    return stored_state(s, items, s.count, tuple(r.numel() for r in rows), rows[0].dtype, _location(store))


def write_rows(items: _Items, rows, created: list) -> None:
    """``rows`` (tensors, one per name of ``items``) written as ``items``' chunk items, stacked, each zero padded at
    its end to the longest (the caller holds the store's lock); each key noted in ``created``. An item already
    there is replaced (the store keeps the previous version until the new one is complete). A store with
    ``put_stacked`` (the CPUStore) copies the rows straight into its item, with no stacked temporary of the item's
    size."""
    handles, even = [], len({r.numel() for r in rows}) == 1  # (even: every row the same length, as AdamW's)
    put_stacked = _put_stacked(items.store)
    for k, (lo, hi) in zip(items.item_keys(), items.chunks):
        if put_stacked is not None:
            handles.append(put_stacked(k, [r[lo:hi] for r in rows], hi - lo))
            created.append(k)
            continue
        if even:
            item = torch.stack([r[lo:hi] for r in rows])
        else:
            item = torch.zeros(len(rows), hi - lo, dtype=rows[0].dtype)
            for j, r in enumerate(rows):
                item[j, :max(0, min(hi, r.numel()) - lo)] = r[lo:hi].detach().to("cpu")
        handles.append(items.store.put(k, item))
        created.append(k)
    for h in handles:
        h.wait()


def _put_stacked(store):
    """``store.put_stacked`` where the class that defines the store's ``put`` defines it too, else None: a wrapper
    that forwards other calls (``__getattr__``), or a subclass that overrides ``put`` alone, keeps its own ``put``."""
    for c in type(store).__mro__:
        if "put" in vars(c):
            return store.put_stacked if "put_stacked" in vars(c) else None
    return None


def stored_state(like, items: _Items, count, numel, dtype, location: str):
    """A unit state of ``like``'s kind whose rows are the rows of ``items`` (``Stored`` leaves), with ``count``;
    ``numel``: every row's elements, or a sequence of one per row (compact rows)."""
    numels = (numel,) * len(items.rows) if isinstance(numel, int) else tuple(numel)
    return like.with_rows(count, [Stored(items, r, numels[r], dtype, location) for r in range(len(items.rows))])


def in_store(leaf) -> Stored | StoredParam | None:
    """The one question the core asks of a state leaf: is it held in a store? The leaf itself if so (it answers
    ``numel``, ``dtype``, ``nbytes``, ``location`` and ``load()``, and a parameter shard ``direct``/``upload``),
    None for a tensor in memory. The only place outside fshard/offload/ that tells the leaf kinds apart."""
    return leaf if isinstance(leaf, _Flat) else None


def stored_items(s) -> _Items | None:
    """The chunk items that hold unit state ``s``'s rows in a store (all its rows share them), or None: ``s`` is in
    memory, or absent, or its optimizer keeps no rows."""
    rows = () if s is None else s.rows
    return rows[0].items if rows and isinstance(rows[0], Stored) else None


def resident(t):
    """A parameter leaf as a tensor: a leaf in a store read back, a tensor as it is."""
    return t.load() if in_store(t) is not None else t


def _location(store) -> str:
    d = store.directory
    return f"nvme:{d} ({getattr(store, 'backend', '?')})" if d else type(store).__name__.removesuffix("Store").lower()


def _disk_need(store, state, chosen) -> str:
    """What the store needs at its peak on this rank, what its directory has free, and the options that lower it."""
    moments = sum(r.nbytes for n, s in state.opt_state.items() if n in chosen for r in s.rows)  # every row
    free = ""
    if store.directory is not None:
        try:
            free = f", and {store.directory} has {_bytes(shutil.disk_usage(store.directory).free)} free"
        except OSError:
            pass
    return (f"This rank's store needs about {_bytes(2 * moments)} at its peak (2x its {_bytes(moments)} of "
            "moments: a step writes the new version beside the input state's, "
            f"design/OFFLOAD.md){free}. Free space there, choose a larger directory, offload less "
            "(fs.offload_state(store, fraction=...)), or compose with donate=True and "
            "fs.offload_state(..., overlap_backward=False), which writes in place (about 1.3x measured).")


def _bytes(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def _chunks(n: int, chunk: int):
    return [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)] or [(0, 0)]
