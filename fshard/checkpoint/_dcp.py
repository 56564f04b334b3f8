"""What fs.save and fs.load hand torch.distributed.checkpoint (DCP): a rank's flat shards as boxes with true
offsets, and moments in a store (fs.offload_state) streamed chunk by chunk instead of held.

A shard is a contiguous range of a flattened parameter, which is not one box of the parameter's shape when it
starts or ends mid-row, so it is written as the few boxes that tile it (``_boxes``: at most 2 * ndim - 1), each
with its true offsets: DCP's planner then reads any other tiling from them (FSDP2's row shards, a whole tensor,
fshard's at another world size).

Moments in a store are cut further at the store's chunk boundaries, so that every box lies in one chunk item. On
save, ``_SavePlanner`` orders the write items chunk by chunk and ``_Chunks`` keeps the one item last read, so each
item is read once and at most one item (both moments) plus one box is in memory. On load, ``_StreamingReader`` reads
the plan one target chunk at a time into one buffer and puts it into the store before the next: a target chunk may
draw on several saved files (another world size), and DCP's own reader goes file by file, which would keep every
chunk open at once.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint._traverse import set_element

from ._read import load_bytes
from ..store._protocol import locked


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """Boxes (offsets, sizes, flat start) that tile elements [lo, hi) of a row-major tensor of ``shape``, in order;
    each box is contiguous in the flat order, so it is a view of the flat range."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), lo)]
    inner = math.prod(shape[1:])
    out = []
    row = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        out += [((row, *o), (1, *s), row * inner + f) for o, s, f in _boxes(shape[1:], lo - row * inner,
                                                                             end - row * inner)]
        row, lo = row + 1, (row + 1) * inner
    last = hi // inner
    if lo < hi and last > row:  # whole rows
        out.append(((row, *[0] * (len(shape) - 1)), (last - row, *shape[1:]), lo))
    if lo < hi and hi % inner and last >= row:  # a partial last row
        out += [((last, *o), (1, *s), last * inner + f) for o, s, f in _boxes(shape[1:], 0, hi - last * inner)]
    return out


class _Boxes:
    """One parameter-shaped entry of the DCP state dict, held as this rank's boxes of a flat tensor: DCP asks it
    for its chunks (save and load) and the planners below for a box's tensor by its offsets. ``boxes``: (offsets,
    sizes, flat start, chunk index) with flat starts into ``flat``."""

    def __init__(self, shape, dtype: torch.dtype, flat: torch.Tensor | None, boxes: list):
        self.shape, self.dtype, self.flat, self.boxes = torch.Size(shape), dtype, flat, boxes
        self._by_offset = {tuple(o): (s, f, c) for o, s, f, c in boxes}

    def get(self, offsets) -> torch.Tensor:
        """A box's tensor: a view of ``flat`` (load fills it, save writes it as it is)."""
        sizes, f, _ = self._by_offset[tuple(offsets)]
        return self.flat[f:f + math.prod(sizes)].view(sizes)

    def chunk_of(self, offsets):
        """The store chunk a box lies in (None: not in a store)."""
        return None

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _, _ in self.boxes]

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.shape))
                for c in self.__create_chunk_list__()]


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous CPU view) as a tensor whose storage is exactly its bytes, sharing its memory: DCP's writer
    copies a view of a larger storage first (torch.save would write the whole storage), which for a box of a flat
    shard is a copy of the box. Through numpy, whose arrays own no more than they show, the copy is not needed."""
    if t.device.type != "cpu" or t.numel() == 0 or t.untyped_storage().nbytes() == t.nbytes:
        return t
    u8 = torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy())
    return u8.view(t.dtype).view(t.shape)


class _Chunks:
    """One save's or load's window on a store's chunk items: on save the item last read (both moments, rows 0 and
    1), on load the buffer of the target chunk being filled."""

    def __init__(self):
        self.key, self.tensor = None, None

    def read(self, items, c: int) -> torch.Tensor:
        if self.key != (items.key, c):
            self.tensor = None  # drop the previous item before reading the next
            with locked(items.store):  # a background save shares the store with the step's offload
                self.tensor = items.store.get((items.key, c)).wait()
            self.key = (items.key, c)
        return self.tensor


class _StoredBoxes(_Boxes):
    """Row ``row`` (in the optimizer's declared order) of a unit's state chunks in a store (``items``, a ``_stored._Items``),
    as boxes that each lie in one chunk; flat starts count from the unit's first moment element."""

    def __init__(self, shape, dtype, boxes: list, items, row: int, window: _Chunks, order: int):
        super().__init__(shape, dtype, None, boxes)
        self.items, self.row, self.window, self.order = items, row, window, order

    def get(self, offsets) -> torch.Tensor:
        sizes, f, c = self._by_offset[tuple(offsets)]
        n = math.prod(sizes)
        if n == 0:
            return torch.zeros(sizes, dtype=self.dtype)
        lo = self.items.chunks[c][0]
        if self.window.key == ("load", self.items.key, c):
            data = self.window.tensor
        else:
            data = self.window.read(self.items, c)
        return data[self.row, f - lo:f - lo + n].view(sizes)

    def chunk_of(self, offsets):
        return (self.order, self._by_offset[tuple(offsets)][2])


def slot_boxes(u, s, rank: int, dtype, flat=None, stored=None, shift: int = 0) -> _Boxes:
    """Slot ``s`` of unit ``u`` as boxes of this rank's piece of the unit: of ``flat`` (element 0 is the first of the
    rank's shard), or of a store's chunks (``stored``: (items, row, window, order)). ``shift``: how far a compact row
    (a partition's, fshard/optim/_protocol.py's covers) is shifted from the shard: its element 0 is the shard's
    element ``shift``."""
    lo, hi = u.shard_range(rank)
    a, b = max(s.offset, lo) - lo, min(s.offset + s.numel, hi) - lo  # shard-local
    if s.numel == 0:  # an empty parameter: one empty box, from rank 0, so that the checkpoint lists it
        boxes = [((0,) * len(s.shape), tuple(s.shape), 0, 0)] if rank == 0 else []
    else:
        cuts = [(a, b, None)] if stored is None else [
            (max(a, c0 + shift), min(b, c1 + shift), c) for c, (c0, c1) in enumerate(stored[0].chunks)
            if max(a, c0 + shift) < min(b, c1 + shift)]  # (chunk bounds count the row's elements: shifted)
        base = lo - s.offset  # shard-local index -> index in the flattened parameter
        boxes = [(o, sz, f - base - shift, c) for a2, b2, c in cuts
                 for o, sz, f in _boxes(s.shape, a2 + base, b2 + base)]
    if stored is None:
        return _Boxes(s.shape, dtype, flat, boxes)
    return _StoredBoxes(s.shape, dtype, boxes, *stored)


class _SavePlanner(DefaultSavePlanner):
    def create_local_plan(self):
        plan = super().create_local_plan()
        # Items of stored moments chunk by chunk (stable: model order within a chunk), so each is read once.
        key = lambda it: ((0,) if (c := self._chunk(it.index)) is None else (1, *c))  # noqa: E731
        return dataclasses.replace(plan, items=sorted(plan.items, key=key))

    def _chunk(self, index):
        obj = self.state_dict.get(index.fqn)
        return obj.chunk_of(index.offset) if isinstance(obj, _Boxes) else None

    def resolve_data(self, write_item):
        obj = self.state_dict.get(write_item.index.fqn)
        if isinstance(obj, _Boxes):
            return _exact(obj.get(write_item.index.offset))
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        # DCP's own reads a byte entry with torch.load(weights_only=False), which runs what it names
        fqn, v = read_item.dest_index.fqn, load_bytes(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], v)
        else:
            self.state_dict[fqn] = v

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        boxes = {k: v for k, v in state_dict.items() if isinstance(v, _Boxes)}
        super().set_up_planner(state_dict, metadata, is_coordinator)  # (its _init_state_dict sets unknown types None)
        for k, v in boxes.items():  # the dict is flat (keys "model.<name>"), so flattening kept the keys
            state_dict[k] = self.state_dict[k] = v

    def lookup_tensor(self, index):
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, _Boxes):
            return obj.get(index.offset)
        return super().lookup_tensor(index)

    def chunk_of(self, index):
        obj = self.state_dict.get(index.fqn)
        return obj.chunk_of(index.offset) if isinstance(obj, _Boxes) else None


class _StreamingReader(FileSystemReader):
    """DCP's file reader, asked for one target chunk of stored moments (or parameters) at a time (``targets``: (order,
    chunk index) -> (items, numel, dtype, rows), in the order to fill them): everything else first, then each
    chunk's reads into one zeroed buffer (what the checkpoint lacks stays zero, as a fresh moment), put into its
    store and waited for. ``metadata``: the checkpoint's, as fshard read it (fshard/checkpoint/_read.py: unpickled
    without running anything), which DCP gets instead of unpickling ``.metadata`` itself."""

    def __init__(self, path: str, targets: dict, window: _Chunks, metadata):
        super().__init__(path)
        self.targets, self.window, self.metadata = targets, window, metadata

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # (DCP's per-rank fallback: fshard and FSDP2 write one global file)
            raise FileNotFoundError("rank-local metadata is not read")
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan, planner):
        by_chunk: dict = {}
        for it in plan.items:
            by_chunk.setdefault(planner.chunk_of(it.dest_index), []).append(it)
        super().read_data(dataclasses.replace(plan, items=by_chunk.pop(None, [])), planner).wait()
        # one buffer per dtype serves every chunk in turn (a put's wait() lets the caller reuse its tensor): with a
        # fresh window a chunk, glibc's heap can keep freed ones (an RSS 24 MiB over the usual was seen once)
        need: dict = {}
        for _, n, dtype, rows in self.targets.values():
            need[dtype] = max(need.get(dtype, 0), rows * n)
        bufs = {dtype: torch.empty(k, dtype=dtype) for dtype, k in need.items()}
        for where, (items, n, dtype, rows) in self.targets.items():
            c = where[1]
            self.window.tensor = bufs[dtype][:rows * n].view(rows, n).zero_()
            self.window.key = ("load", items.key, c)
            if where in by_chunk:
                super().read_data(dataclasses.replace(plan, items=by_chunk[where]), planner).wait()
            with locked(items.store):
                items.store.put((items.key, c), self.window.tensor).wait()
            self.window.key = self.window.tensor = None
        done: Future = Future()
        done.set_result(None)
        return done
