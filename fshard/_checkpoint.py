"""fs.save / fs.load / fs.latest: TrainState checkpoints through torch.distributed.checkpoint (DCP).

The checkpoint is a DCP directory that FSDP2 and plain torch can read, in the layout FSDP2's users already have:

- ``"model"``: keyed like ``model.state_dict()`` (every name of a tied parameter, persistent buffers). Each rank
  writes only its shard of each parameter. A shard is a contiguous range of the flattened parameter, which is not
  one box of the parameter's shape when it starts or ends mid-row, so it is written as the few boxes that tile it
  (``_boxes``: at most 2 * ndim - 1), each with its true offsets: DCP's planner then reads any other tiling from
  them, FSDP2's row shards, a whole tensor, or fshard's at another world size.
- ``"optim"``: ``get_optimizer_state_dict``'s layout, keyed by parameter name: ``state[name]`` holds ``step`` (a
  0-dim fp32 tensor, as torch's AdamW keeps it), ``exp_avg`` and ``exp_avg_sq`` (boxes as above); parameters that
  were never updated have no entry, as in torch. ``param_groups`` lists the hyperparameters, one group per weight
  decay.
- ``"fshard"``: the step and skip counts, ``transform_state`` (the loss scale, ...), non-persistent buffers, and a
  description of the layout for the error messages.

A save writes into ``<path>.partial`` and renames it to ``<path>`` once DCP has written its metadata (last, after
every rank's data) and rank 0 has written ``fshard.json`` (the step and a CRC-32 and size of every file): a
checkpoint is visible only complete, and a killed save leaves the previous one as it was. ``load`` checks the sizes
and CRCs (each rank a share of the files) before DCP reads, so a truncated or corrupted file is an error that names
it, not garbage in the parameters.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ._errors import ArgumentError, CheckpointError
from ._optim import AdamWState
from ._state import TrainState

FORMAT = 1
MANIFEST = "fshard.json"


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
    for its chunks (save and load) and the planners below for a box's tensor by its offsets."""

    def __init__(self, shape, flat: torch.Tensor | None, boxes: list):
        self.shape, self.flat, self.boxes = torch.Size(shape), flat, boxes
        self._by_offset = {tuple(o): (s, f) for o, s, f in boxes}

    def get(self, offsets) -> torch.Tensor:
        sizes, f = self._by_offset[tuple(offsets)]
        n = math.prod(sizes)
        return self.flat[f:f + n].view(sizes)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self.boxes]

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.flat.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.shape))
                for c in self.__create_chunk_list__()]


class _SavePlanner(DefaultSavePlanner):
    def resolve_data(self, write_item):
        obj = self.state_dict.get(write_item.index.fqn)
        if isinstance(obj, _Boxes):
            return obj.get(write_item.index.offset)
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
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


def _slot_boxes(u, s, rank: int, flat: torch.Tensor, base: int = 0) -> _Boxes:
    """Slot s of unit u as boxes of ``flat``, this rank's piece of the unit (element ``base`` of ``flat`` is
    element ``lo`` of the rank's shard)."""
    lo, hi = u.shard_range(rank)
    a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
    if s.numel == 0:  # an empty parameter: one empty box, from rank 0, so that the checkpoint lists it
        return _Boxes(s.shape, flat, [((0,) * len(s.shape), tuple(s.shape), 0)] if rank == 0 else [])
    boxes = [(o, sz, s.offset + f - lo + base) for o, sz, f in _boxes(s.shape, a - s.offset, b - s.offset)]
    return _Boxes(s.shape, flat, boxes)


def _layout_of(state: TrainState) -> dict:
    return {"format": FORMAT, "world_size": state.spec.mesh.world_size, "step": int(state.step),
            "params": {s.name: list(s.shape) for u in state.spec.units for s in u.slots},
            "dtypes": {u.name: str(u.dtype) for u in state.spec.units}}


def _entries(state: TrainState, params, opt_state, buffers, for_load: bool):
    """The DCP state dict of a state's tensors (``params``/``opt_state`` may be new tensors to load into)."""
    spec, rank = state.spec, state.spec.mesh.rank
    template = spec.template
    canonical = {id(p): n for n, p in template.named_parameters()}
    buffer_of = {id(b): n for n, b in template.named_buffers()}  # a shared buffer's first name, as state.buffers
    slot = {s.name: (u, s) for u in spec.units for s in u.slots}
    model, persistent = {}, set()
    for key, t in template.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and id(t) in canonical:
            u, s = slot[canonical[id(t)]]
            model[key] = _slot_boxes(u, s, rank, params[u.name])
        elif isinstance(t, torch.Tensor) and id(t) in buffer_of:
            persistent.add(buffer_of[id(t)])
            model[key] = buffers[buffer_of[id(t)]]
    optim, groups = {}, {}
    opt = spec.optimizer
    for u in spec.units:
        st = opt_state.get(u.name)
        if st is None:
            continue
        for k, s in enumerate(u.trainable):
            groups.setdefault(opt.decays(u)[k], []).append(s.name)  # every trainable name, as torch's groups
            if not for_load and int(st.count[k]) == 0:
                continue  # never updated: torch keeps no state for it
            optim[s.name] = {"step": torch.tensor(float(st.count[k]), dtype=torch.float32),
                             "exp_avg": _slot_boxes(u, s, rank, st.exp_avg),
                             "exp_avg_sq": _slot_boxes(u, s, rank, st.exp_avg_sq)}
    param_groups = [{"lr": opt.lr if not callable(opt.lr) else opt.lr_at(int(state.step)), "betas": opt.betas,
                     "eps": opt.eps, "weight_decay": wd, "amsgrad": False, "maximize": False, "foreach": None,
                     "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                     "params": names} for wd, names in groups.items()]
    extra = {n: b for n, b in buffers.items() if n not in persistent}
    return {"model": model, "optim": {"state": optim, "param_groups": param_groups},
            "fshard": {"step": state.step, "skipped": state.skipped, "buffers": extra,
                       "transform_state": dict(state.transform_state), "layout": json.dumps(_layout_of(state))}}


def _cause(e: BaseException) -> str:
    """One line for an error of DCP's: a CheckpointException's per-rank failures, by rank."""
    if isinstance(e, CheckpointException):
        by = {}
        for rank, (exc, _) in sorted(e.failures.items()):
            by.setdefault(f"{type(exc).__name__}: {exc}", []).append(rank)
        return "; ".join(f"{msg} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for msg, r in by.items())
    return f"{type(e).__name__}: {e}"


def _barrier(mesh) -> None:
    if mesh.group is not None:
        dist.barrier(group=mesh.group)


def save(path, state: TrainState, *, keep_last: int | None = None) -> str:
    """Collective: write ``state`` as a DCP checkpoint at ``path`` (a directory), every rank its own shards, and
    return the path. The checkpoint appears at ``path`` only once complete (module docstring); an existing one at
    ``path`` is replaced only then. ``keep_last=N``: afterwards, delete all but the N newest complete checkpoints
    (by step) in ``path``'s parent directory. Offloaded moments (``fs.offload_state``) are not written yet: a
    state holding them raises ``CheckpointError``."""
    if not isinstance(state, TrainState):
        raise ArgumentError(f"fs.save(path, state): state must be an fs.TrainState, not {type(state).__name__}.")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ArgumentError(f"fs.save: keep_last must be an int >= 1 or None, got {keep_last!r}.")
    state.check_usable()
    mesh = state.spec.mesh
    mesh.check_alive()
    _in_memory(state, "fs.save: this state")
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
        tmp.mkdir(parents=True)
    _barrier(mesh)
    sd = _entries(state, state.params, state.opt_state, state.buffers, for_load=False)
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), planner=_SavePlanner(),
                 process_group=mesh.group)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"fs.save: writing {tmp} failed ({_cause(e)}); {path} is unchanged.") from e
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    mine = {n: _crc(tmp / n) for n in files[mesh.rank::mesh.world_size]}  # each rank sums a share
    sums = [None] * mesh.world_size
    if mesh.group is not None:
        dist.all_gather_object(sums, mine, group=mesh.group)
    else:
        sums = [mine]
    if mesh.rank == 0:
        manifest = {**_layout_of(state), "time": time.time(), "files": {k: v for d in sums for k, v in d.items()}}
        _write_json(tmp / MANIFEST, manifest)
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last is not None:
            for p in _complete(path.parent)[:-keep_last]:
                shutil.rmtree(p, ignore_errors=True)
    _barrier(mesh)
    return str(path)


def _in_memory(state: TrainState, who: str) -> None:
    if any(not isinstance(t, torch.Tensor) for st in state.opt_state.values() if st is not None
           for t in (st.exp_avg, st.exp_avg_sq)):
        raise CheckpointError(f"{who} has its moments in a store (fs.offload_state); checkpoints of offloaded "
                              "moments are not supported yet. Save and load states whose moments are in memory "
                              "(a step without offload_state keeps them there).")


def _crc(p: Path) -> list[int]:
    crc = 0
    with open(p, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return [p.stat().st_size, crc]


def _write_json(p: Path, obj) -> None:
    with open(p, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest(path: Path) -> dict | None:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if (path / ".metadata").is_file() and isinstance(m, dict) and "step" in m else None


def _complete(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (by step, then time)."""
    found = []
    for p in Path(directory).iterdir() if Path(directory).is_dir() else []:
        if p.name.endswith(".old") and p.with_name(p.name[:-4]).exists():
            continue  # the replaced version of a checkpoint that exists (a save killed between its two renames
        m = _manifest(p) if p.is_dir() and not p.name.endswith(".partial") else None  # leaves only the .old)
        if m is not None:
            found.append((m["step"], m.get("time", 0.0), p))
    return [p for *_, p in sorted(found)]


def latest(directory) -> str | None:
    """The newest complete checkpoint (the highest step) that ``fs.save`` wrote into ``directory``, or None. A save
    still in progress, or one killed, is never returned."""
    found = _complete(Path(directory))
    return str(found[-1]) if found else None


def _verify(path: Path, mesh) -> dict:
    """The manifest, after each rank checked a share of the files' sizes and CRCs; raises naming a bad file."""
    m = _manifest(path)
    if m is None:
        raise CheckpointError(f"fs.load: {path} is not a complete fshard checkpoint (no .metadata or {MANIFEST}); "
                              f"a save that was interrupted leaves <path>.partial instead. fs.latest(directory) "
                              "finds the newest complete one.")
    names = sorted(m["files"])
    bad = []
    for n in names[mesh.rank::mesh.world_size]:
        try:
            got = _crc(path / n)
        except OSError as e:
            bad.append(f"{path / n}: {e.strerror}")
            continue
        if got != m["files"][n]:
            what = "truncated or extended" if got[0] != m["files"][n][0] else "corrupted (CRC-32 mismatch)"
            bad.append(f"{path / n}: {what}, {got[0]:,} bytes against {m['files'][n][0]:,} written")
    if mesh.group is not None:
        every = [None] * mesh.world_size
        dist.all_gather_object(every, bad, group=mesh.group)
        bad = [b for r in every for b in r]
    if bad:
        raise CheckpointError("fs.load: damaged checkpoint file(s): " + "; ".join(bad) + ". Load an earlier "
                              "checkpoint (fs.latest skips none that are complete; pass another path).")
    return m


def load(path, like: TrainState) -> TrainState:
    """Collective: a new TrainState shaped like ``like`` (its model, units, world size, optimizer and transforms)
    holding the values saved at ``path``, by fs.save at any world size or by FSDP2 + DCP (``model`` and
    ``get_optimizer_state_dict`` entries). ``like``'s own values are not read or changed. Parameters the checkpoint
    lacks are an error; optimizer state it lacks (parameters never updated) starts at zero, as in torch."""
    if not isinstance(like, TrainState):
        raise ArgumentError(f"fs.load(path, like): like must be an fs.TrainState (from fs.init), not "
                            f"{type(like).__name__}.")
    mesh, spec = like.spec.mesh, like.spec
    mesh.check_alive()
    _in_memory(like, "fs.load: like")
    path = Path(path)
    if (path / MANIFEST).exists() or not (path / ".metadata").is_file():
        _verify(path, mesh)  # an fshard checkpoint (or nothing): check every file first
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    dev = mesh.device
    params = {u.name: torch.zeros(u.shard_numel, dtype=u.dtype, device=dev) for u in spec.units}
    opt_state = {}
    for u in spec.units:
        st = like.opt_state.get(u.name)
        if st is not None:
            n = u.opt_numel(mesh.rank)
            opt_state[u.name] = AdamWState(torch.zeros(len(u.trainable), dtype=torch.int64),
                                           torch.zeros(n, dtype=u.dtype, device=dev),
                                           torch.zeros(n, dtype=u.dtype, device=dev))
    buffers = {n: b.detach().clone() for n, b in like.buffers.items()}
    full = _entries(like, params, opt_state, buffers, for_load=True)
    want = {}
    for key, v in full["model"].items():
        fqn = f"model.{key}"
        if fqn not in saved:
            if isinstance(v, _Boxes):
                raise CheckpointError(f"fs.load: {path} has no parameter {key!r} (model.{key}): it was saved from "
                                      "another model, or is not a model checkpoint.")
            continue  # a persistent buffer the checkpoint lacks keeps like's value
        _check_shape(path, fqn, saved[fqn], v)
        want[fqn] = v
    for name, entry in full["optim"]["state"].items():
        for k, v in entry.items():
            fqn = f"optim.state.{name}.{k}"
            if fqn in saved:
                _check_shape(path, fqn, saved[fqn], v)
                want[fqn] = v
    for key in ("step", "skipped"):
        if f"fshard.{key}" in saved:
            want[f"fshard.{key}"] = full["fshard"][key].clone()
    for n, b in full["fshard"]["buffers"].items():
        if f"fshard.buffers.{n}" in saved:
            want[f"fshard.buffers.{n}"] = b
    ts_keys = [k for k in saved if k.startswith("fshard.transform_state.")]
    for k in ts_keys:
        want[k] = None
    try:
        dcp.load(want, storage_reader=reader, planner=_LoadPlanner(), process_group=mesh.group)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"fs.load: reading {path} failed ({_cause(e)}).") from e
    for u in spec.units:  # torch's per-parameter step, back to fshard's counts
        for k, s in enumerate(u.trainable):
            step = want.get(f"optim.state.{s.name}.step")
            if step is not None and u.name in opt_state:
                opt_state[u.name].count[k] = int(step)
    transform_state = {k.removeprefix("fshard.transform_state."): want[k] for k in ts_keys}
    return TrainState(params=params, opt_state=opt_state, step=want.get("fshard.step", like.step.clone()),
                      buffers=buffers, spec=spec, skipped=want.get("fshard.skipped", like.skipped.clone()),
                      transform_state=transform_state or dict(like.transform_state), copies={})


def _check_shape(path: Path, fqn: str, md, v) -> None:
    shape = v.shape if isinstance(v, (_Boxes, torch.Tensor)) else None
    got = getattr(md, "size", None)
    if shape is not None and got is not None and tuple(got) != tuple(shape):
        raise CheckpointError(f"fs.load: {fqn} in {path} has shape {tuple(got)}, but the model's is {tuple(shape)}. "
                              "The checkpoint is of another model configuration.")

