"""fs.load: a TrainState from a checkpoint of fs.save (at any world size) or of FSDP2 + DCP, read in phases that
every rank ends at the same check (fshard/dist/_call.py): the manifest, every file's size and CRC, the metadata (read
without running anything: checkpoint/_read.py) and the plan, DCP's read. New shards shaped like ``like`` are filled;
moments and parameters in a store are streamed into it chunk by chunk (fshard/checkpoint/_dcp.py)."""
from __future__ import annotations

import json
import os
import uuid
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from .. import _pages
from ..dist._call import Call
from ._save import _dcp, _entries
from ._files import MANIFEST, check_files, read_manifest
from ._read import check_consistent, read_metadata, saved_hparams, warn_hparams
from ._dcp import _Boxes, _Chunks, _LoadPlanner, _StreamingReader
from ..errors import ArgumentError, ArgumentTypeError, CheckpointError
from ..optim._protocol import count_key_of, initial_rows, row_names, row_numel
from ..state._placement import Placement, check_placement, placement_for, placement_of
from ..state._stored import StoredParam, _chunks, _Items, _location, stored_state
from ..state._train_state import TrainState

__all__ = ["load"]


def load(path, like: TrainState, *, offload: Placement | None = None) -> TrainState:
    """Collective: a new TrainState shaped like ``like`` (its model, units, world size, optimizer and transforms)
    holding the values saved at ``path``, by fs.save at any world size or by FSDP2 + DCP (``model`` and
    ``get_optimizer_state_dict`` entries). ``like``'s own values are not read or changed. Parameters the checkpoint
    lacks are an error; optimizer state it lacks (parameters never updated) starts at zero, as in torch.

    The moments go where ``like`` keeps them: in memory, or in its store, streamed into it one chunk item at a time
    (so a state whose moments only fit in a store loads); so do the parameters (``offload_state(params=True)``).
    ``offload=``: the ``fs.offload_state`` the step is composed with (any ``fs.state.Placement``), to place them as
    that step would (its stores, fractions, chunk size and ``params``) rather than as ``like`` has them
    (``fs.state.placement_of(like)``), e.g. when ``like`` is fresh from ``fs.init``.

    Nothing in the checkpoint is run (fshard/checkpoint/_read.py); every file is checked against fshard's manifest first
    (none for FSDP2's), and a manifest in a newer format, or one that contradicts the metadata, is refused. The
    optimizer's hyperparameters are ``like``'s, with a warning naming each that the checkpoint's ``param_groups``
    give otherwise. A failure on one rank is an fshard error on every rank."""
    if not isinstance(like, TrainState):
        raise ArgumentError(f"fs.load(path, like): like must be an fs.TrainState (from fs.init), not "
                            f"{type(like).__name__}.")
    mesh = like.spec.mesh
    mesh.check_alive()
    call = Call(mesh, "fs.load", "Nothing was loaded, and like is unchanged")
    path, m = call.run("its start", lambda: _open(path, offload), differ=(
        "Every rank must load the same checkpoint: pass the same path (fs.latest(directory, mesh=mesh) gives "
        "every rank the same one), on a filesystem every rank shares."),
        same=lambda r: (str(r[0]), f"manifest crc {zlib.crc32(json.dumps(r[1], sort_keys=True).encode()):08x}"))
    if m is not None:
        check_files(path, m, call)  # every file's size and CRC before anything is read (every rank raises alike)
    want, made = call.run(f"planning the read of {path}", lambda: _plan(path, m, like, offload))
    return call.run(f"reading {path}", lambda: _read(call, path, like, want, *made))


def _open(path, offload) -> tuple[Path, dict | None]:
    """fs.load's checks on this rank before anything is read: the arguments, and the manifest (None: a checkpoint
    without one, FSDP2's)."""
    if offload is not None:
        check_placement(offload, "fs.load(..., offload=)")
    if path is None:
        raise CheckpointError("fs.load(None, like): no checkpoint path. fs.latest(directory) returns None when the "
                              "directory holds no complete checkpoint: start from fs.init's state instead.")
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"fs.load(path, like): path must be a str or a path, not {type(path).__name__}.")
    path = Path(os.path.abspath(path))
    if (path / MANIFEST).exists() or not (path / ".metadata").is_file():
        return path, read_manifest(path)  # an fshard checkpoint (or nothing)
    return path, None


def _plan(path: Path, m: dict | None, like: TrainState, offload):
    """The metadata (read without running anything: fshard/checkpoint/_read.py), checked against the manifest and
    ``like``; the new tensors to load into, and the DCP state dict of what to read into them."""
    md = read_metadata(path)
    check_consistent(path, m, md)
    reader = _StreamingReader(str(path), {}, _Chunks(), md)
    saved = md.state_dict_metadata
    dev = like.spec.mesh.device
    where = placement_of(like) if offload is None else placement_for(
        offload, [u for u in like.spec.units if like.opt_state.get(u.name) is not None], like.spec.mesh.shard_rank,
        "fs.load(..., offload=)")
    opt_state = _new_moments(like, where, reader.targets)
    params = _new_params(like, where, reader.targets)
    buffers = {n: torch.empty(b.shape, dtype=b.dtype, device=dev) if b.is_meta else b.detach().clone()
               for n, b in like.buffers.items()}  # (an abstract like's meta buffers: the checkpoint must hold them)
    full = _entries(like, params, opt_state, buffers, for_load=True, window=reader.window)
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
    filled = {id(v) for v in want.values()}
    unset = [n for n, b in like.buffers.items() if b.is_meta and id(buffers[n]) not in filled]
    if unset:
        raise CheckpointError(f"fs.load: {path} has no value for the buffer(s) {', '.join(unset)}, and like is "
                              "abstract (fs.init(..., abstract=True)), so there is no initial value to keep either. "
                              "Make like with fs.init without abstract=True.")
    ts_keys = [k for k in saved if k.startswith("fshard.transform_state.")]
    for k in ts_keys + saved_hparams(md):
        want[k] = None
    return want, (reader, params, opt_state, buffers, ts_keys)


def _read(call, path: Path, like: TrainState, want: dict, reader, params, opt_state, buffers, ts_keys) -> TrainState:
    """DCP fills ``want``; the new state from it."""
    _dcp(call, f"reading {path}", "like is unchanged", dcp.load, want, storage_reader=reader, planner=_LoadPlanner())
    opt = like.spec.optimizer
    rows = row_names(opt)
    for u in like.spec.units:  # torch's per-parameter step, back to fshard's counts
        for k, s in enumerate(u.trainable):
            count_key = count_key_of(opt, s.name)  # (None: the optimizer saves no counts)
            step = want.get(f"optim.state.{s.name}.{count_key}") if count_key is not None else None
            if step is None and count_key is None and any(f"optim.state.{s.name}.{r}" in want for r in rows):
                step = 1  # state but no count (Muon's): updated at least once, so a later save keeps its state
            if step is not None and u.name in opt_state:
                opt_state[u.name].count[k] = int(step)
    warn_hparams(path, like, {**{k: v for k, v in want.items() if k.startswith("optim.param_groups.")},
                              **({"step": int(want["fshard.step"])} if "fshard.step" in want else {})})
    transform_state = {k.removeprefix("fshard.transform_state."): want[k] for k in ts_keys}
    return TrainState(params=params, opt_state=opt_state, step=want.get("fshard.step", like.step.clone()),
                      buffers=buffers, spec=like.spec, skipped=want.get("fshard.skipped", like.skipped.clone()),
                      transform_state=transform_state or dict(like.transform_state), copies={})


def _new_params(like: TrainState, where: dict, targets: dict) -> dict:
    """Zeroed parameter shards to load into: in memory, or new items in their unit's store where the placement
    (``where``: ``offload=``'s, else ``like``'s) keeps its parameters there (``Where.params``), filled chunk by chunk
    as stored moments are (``targets``: rows of one), so a model whose parameters fit only in a store loads. The head
    is chunked as the unit's moments, the tail (frozen parameters) apart, as state/_stored.py lays them out; the
    ``order`` keys are the ones fs.save's boxes use (checkpoint/_save.py's ``_param_items``)."""
    spec, rank, dev = like.spec, like.spec.mesh.shard_rank, like.spec.mesh.device
    n_units, tag, out = len(spec.units), uuid.uuid4().hex[:8], {}
    for i, u in enumerate(spec.units):
        w = where.get(u.name)
        if w is None or not w.params:
            out[u.name] = _pages.state_empty(u.shard_numel, u.dtype, dev, torch.Tensor.zero_)  # (huge pages)
            continue
        head_n, parts = u.opt_numel(rank), []
        for suffix, n, order in (("param", head_n, n_units + i), ("tail", u.shard_numel - head_n, 2 * n_units + i)):
            parts.append(None if n <= 0 else _target(targets, order, _Items(
                w.store, f"{u.name}@load-{tag}/{suffix}", _chunks(n, w.chunk), rows=("param",)), u.dtype))
        out[u.name] = StoredParam(parts[0], parts[1], u.shard_numel, head_n, u.dtype, _location(w.store))
    return out


def _new_moments(like: TrainState, where: dict, targets: dict) -> dict:
    """Zeroed optimizer states to load into, one zero row per row the optimizer declares: in memory, or new items in
    the store the placement (``where``) names (``targets`` gets each chunk to fill, in order: ``_target``)."""
    spec, rank, opt = like.spec, like.spec.mesh.shard_rank, like.spec.optimizer
    tag = uuid.uuid4().hex[:8]
    out = {}
    for order, u in enumerate(spec.units):
        st = like.opt_state.get(u.name)
        if st is None:
            continue
        n, count, w = u.opt_numel(rank), torch.zeros(len(u.trainable), dtype=torch.int64), where.get(u.name)
        if w is None or not opt.rows:
            out[u.name] = st.with_rows(count, initial_rows(opt, u, rank, u.dtype, spec.mesh.device))
            if hasattr(opt, "zero_extra"):  # state beside the rows (Adafactor's factors): new tensors to fill
                out[u.name] = opt.zero_extra(out[u.name])
            continue
        dtype = opt.rows[0].dtype_for(u.dtype)  # (stored rows share one dtype: state/_stored.py's put_moments)
        numels = [row_numel(opt, u, rank, i) for i in range(len(opt.rows))]  # (fewer for a compact row, padded)
        items = _target(targets, order, _Items(w.store, f"{u.name}@load-{tag}", _chunks(max(numels), w.chunk),
                                               row_names(opt)), dtype)
        out[u.name] = stored_state(st, items, count, numels, dtype, _location(w.store))
        if hasattr(opt, "zero_extra"):  # its state beside the rows stays in memory: new tensors to fill
            out[u.name] = opt.zero_extra(out[u.name])
    return out


def _target(targets: dict, order: int, items, dtype) -> "_Items":
    """Register each chunk item of ``items`` (new keys in a store) for the streaming reader to fill, as
    ``targets[(order, chunk)] = (items, numel, dtype, rows)``; return ``items``."""
    for c, (lo, hi) in enumerate(items.chunks):
        targets[(order, c)] = (items, hi - lo, dtype, len(items.rows))
    return items


def _check_shape(path: Path, fqn: str, md, v) -> None:
    shape = v.shape if isinstance(v, (_Boxes, torch.Tensor)) else None
    got = getattr(md, "size", None)
    if shape is not None and got is not None and tuple(got) != tuple(shape):
        raise CheckpointError(f"fs.load: {fqn} in {path} has shape {tuple(got)}, but the model's is {tuple(shape)}. "
                              "The checkpoint is of another model configuration.")

