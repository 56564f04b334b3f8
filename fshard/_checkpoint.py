"""fs.save / fs.load: TrainState checkpoints through torch.distributed.checkpoint (DCP).

The checkpoint is a DCP directory that FSDP2 and plain torch can read, in the layout FSDP2's users already have:

- ``"model"``: keyed like ``model.state_dict()`` (every name of a tied parameter, persistent buffers). Each rank
  writes only its shard of each parameter, as boxes with true offsets (fshard/_dcp.py), so DCP reshards.
- ``"optim"``: ``get_optimizer_state_dict``'s layout, keyed by parameter name: ``state[name]`` holds ``step`` (a
  0-dim fp32 tensor, as torch's AdamW keeps it), ``exp_avg`` and ``exp_avg_sq`` (boxes as above); parameters that
  were never updated have no entry, as in torch. ``param_groups`` lists the hyperparameters, one group per weight
  decay. Moments in a store (fs.offload_state) stream through it chunk by chunk, on save and on load.
- ``"fshard"``: the step and skip counts, ``transform_state`` (the loss scale, ...), non-persistent buffers, and a
  description of the layout for the error messages.

A save is visible only complete (a rename after DCP's metadata and fshard's manifest of file CRCs, in
fshard/_ckpt_files.py); ``load`` checks every file's size and CRC before DCP reads, so a damaged file is an error
that names it. ``blocking=False`` runs the save in a thread of its own, over a process group of its own, on the
state as it is: a state is immutable unless donated, so the save needs no copy (fs.SaveHandle).
"""
from __future__ import annotations

import json
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ._ckpt_files import FORMAT, MANIFEST, commit, latest, prepare, verify  # noqa: F401 (latest: fs.latest)
from ._dcp import _Boxes, _Chunks, _LoadPlanner, _SavePlanner, _StreamingReader, slot_boxes
from ._errors import ArgumentError, ArgumentTypeError, CheckpointError
from ._offload import offload_state
from ._place import choose_stores
from ._optim import AdamWState
from ._state import TrainState
from ._stored import Stored, StoredParam, _chunks, _Items, _location, _stored_state

__all__ = ["save", "load", "latest", "SaveHandle"]


def _layout_of(state: TrainState) -> dict:
    return {"format": FORMAT, "world_size": state.spec.mesh.world_size, "step": int(state.step),
            "params": {s.name: list(s.shape) for u in state.spec.units for s in u.slots},
            "dtypes": {u.name: str(u.dtype) for u in state.spec.units}}


def _entries(state: TrainState, params, opt_state, buffers, for_load: bool, window: _Chunks):
    """The DCP state dict of a state's tensors (``params``/``opt_state`` may be new tensors to load into); moments
    in a store become boxes of its chunk items, read (save) or filled (load) through ``window``."""
    spec, rank = state.spec, state.spec.mesh.rank
    template = spec.template
    canonical = {id(p): n for n, p in template.named_parameters()}
    buffer_of = {id(b): n for n, b in template.named_buffers()}  # a shared buffer's first name, as state.buffers
    slot = {s.name: (u, s) for u in spec.units for s in u.slots}
    model, persistent = {}, set()
    for key, t in template.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and id(t) in canonical:
            u, s = slot[canonical[id(t)]]
            p = params[u.name]
            model[key] = (slot_boxes(u, s, rank, p.dtype, flat=p) if not isinstance(p, StoredParam) else
                          slot_boxes(u, s, rank, p.dtype, stored=_param_items(p, s, window, spec, u)))
        elif isinstance(t, torch.Tensor) and id(t) in buffer_of:
            persistent.add(buffer_of[id(t)])
            model[key] = buffers[buffer_of[id(t)]]
    optim, groups = {}, {}
    opt = spec.optimizer
    for order, u in enumerate(spec.units):
        st = opt_state.get(u.name)
        if st is None:
            continue
        rows = [dict(dtype=m.dtype, **(dict(stored=(m.items, r, window, order)) if isinstance(m, Stored) else
                                       dict(flat=m))) for r, m in enumerate((st.exp_avg, st.exp_avg_sq))]
        for k, s in enumerate(u.trainable):
            groups.setdefault(opt.decays(u)[k], []).append(s.name)  # every trainable name, as torch's groups
            if not for_load and int(st.count[k]) == 0:
                continue  # never updated: torch keeps no state for it
            optim[s.name] = {"step": torch.tensor(float(st.count[k]), dtype=torch.float32),
                             "exp_avg": slot_boxes(u, s, rank, **rows[0]),
                             "exp_avg_sq": slot_boxes(u, s, rank, **rows[1])}
    param_groups = [{"lr": opt.lr if not callable(opt.lr) else opt.lr_at(int(state.step)), "betas": opt.betas,
                     "eps": opt.eps, "weight_decay": wd, "amsgrad": False, "maximize": False, "foreach": None,
                     "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                     "params": names} for wd, names in groups.items()]
    extra = {n: b for n, b in buffers.items() if n not in persistent}
    return {"model": model, "optim": {"state": optim, "param_groups": param_groups},
            "fshard": {"step": state.step, "skipped": state.skipped, "buffers": extra,
                       "transform_state": dict(state.transform_state), "layout": json.dumps(_layout_of(state))}}


class _Shifted:
    """A stored parameter's tail items as the boxes of a save see them: chunk bounds counted from the shard's
    first element (the tail's own count from its first, ``opt_numel``)."""

    def __init__(self, items, base: int):
        self.store, self.key, self.rows = items.store, items.key, items.rows
        self.chunks = tuple((lo + base, hi + base) for lo, hi in items.chunks)


def _param_items(p: StoredParam, s, window, spec, u) -> tuple:
    """``slot_boxes``' ``stored`` for slot ``s`` of a parameter shard in a store: its head's items for a trainable
    slot, its tail's for a frozen one; sorted after every moment chunk (``order``), so each item is read once."""
    n, i = len(spec.units), spec.units.index(u)
    tail = None if p.tail is None else _Shifted(p.tail, p.opt_numel)
    if s.requires_grad:  # (a part that is None holds none of the slot's elements on this rank: either serves)
        return (p.head or tail, 0, window, n + i)
    return (tail or p.head, 0, window, 2 * n + i)


def _cause(e: BaseException) -> str:
    """One line for an error of DCP's: a CheckpointException's per-rank failures, by rank."""
    if isinstance(e, CheckpointException):
        by = {}
        for rank, (exc, _) in sorted(e.failures.items()):
            by.setdefault(f"{type(exc).__name__}: {exc}", []).append(rank)
        return "; ".join(f"{msg} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for msg, r in by.items())
    return f"{type(e).__name__}: {e}"


def _stores(state: TrainState) -> list:
    return [st.exp_avg.items.store for st in state.opt_state.values() if isinstance(getattr(st, "exp_avg", None),
                                                                                      Stored)]


def save(path, state: TrainState, *, keep_last: int | None = None, blocking: bool = True):
    """Collective: write ``state`` as a DCP checkpoint at ``path`` (a directory), every rank its own shards. The
    checkpoint appears at ``path`` only once complete; an existing one at ``path`` is replaced only then.
    ``keep_last=N``: afterwards, delete all but the N newest complete checkpoints (by step) in ``path``'s parent
    directory. Moments in a store are read from it one chunk item at a time, never all at once.

    Returns the path; with ``blocking=False``, at once a ``SaveHandle`` whose ``wait()`` returns it, while the save
    runs in a thread beside training. The state needs no copy, as a step that does not donate never changes its
    input; a step composed with ``donate=True`` refuses a state whose save was not waited for. Moments in a store
    are read under ``store.session_lock``, which the step's offload holds while it streams, so the two take turns;
    the items the save reads stay on disk until it is done (a step writes new versions beside them)."""
    if not isinstance(state, TrainState):
        raise ArgumentError(f"fs.save(path, state): state must be an fs.TrainState, not {type(state).__name__}.")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ArgumentError(f"fs.save: keep_last must be an int >= 1 or None, got {keep_last!r}.")
    state.check_usable()
    mesh = state.spec.mesh
    mesh.check_alive()
    path = Path(path)
    if blocking:
        return _write(path, state, mesh.group, keep_last)
    unlocked = {type(s).__name__ for s in _stores(state) if getattr(s, "session_lock", None) is None}
    if unlocked:
        raise CheckpointError(f"fs.save(..., blocking=False): this state's moments are in a store without a "
                              f"session_lock ({', '.join(sorted(unlocked))}), which the step's offload would use at "
                              "the same time; give the store a `session_lock` (a threading.RLock, as CPUStore and "
                              "NVMeStore have) or save with blocking=True.")
    group, pool = mesh.background()  # the save's collectives never interleave with the step's
    handle = SaveHandle(str(path), pool.submit(_write, path, state, group, keep_last), state.donation)
    state.donation.saves.append(handle)
    return handle


def _write(path: Path, state: TrainState, group, keep_last) -> str:
    mesh = state.spec.mesh
    tmp = path.with_name(path.name + ".partial")
    prepare(tmp, mesh.rank, group)
    sd = _entries(state, state.params, state.opt_state, state.buffers, for_load=False, window=_Chunks())
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), planner=_SavePlanner(),
                 process_group=group)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"fs.save: writing {tmp} failed ({_cause(e)}); {path} is unchanged.") from e
    commit(tmp, path, _layout_of(state), mesh.rank, mesh.world_size, group, keep_last)
    return str(path)


class SaveHandle:
    """An asynchronous save (``fs.save(path, state, blocking=False)``), running in the mesh's background thread over
    its background process group (``Mesh.background``), after any save started before it. ``wait()`` returns the
    checkpoint's path once it is complete and visible, or raises the save's ``CheckpointError``; call it on every
    rank before a step that donates the state."""

    def __init__(self, path: str, future, donation):
        self.path, self._future, self._donation = path, future, donation

    def done(self) -> bool:
        """Whether the save has finished (written, or failed) on this rank."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save is complete; return its path. Raises ``CheckpointError`` if it failed, or if
        ``timeout`` seconds passed first (then the save goes on: wait again)."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise CheckpointError(f"fs.save(..., blocking=False) of {self.path} did not finish within {timeout} s; "
                                  "it is still running: call wait() again.") from None
        finally:
            if self._future.done() and self in self._donation.saves:
                self._donation.saves.remove(self)

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, {'done' if self.done() else 'running'})"


def load(path, like: TrainState, *, offload: offload_state | None = None) -> TrainState:
    """Collective: a new TrainState shaped like ``like`` (its model, units, world size, optimizer and transforms)
    holding the values saved at ``path``, by fs.save at any world size or by FSDP2 + DCP (``model`` and
    ``get_optimizer_state_dict`` entries). ``like``'s own values are not read or changed. Parameters the checkpoint
    lacks are an error; optimizer state it lacks (parameters never updated) starts at zero, as in torch.

    The moments go where ``like`` keeps them: in memory, or in its store, streamed into it one chunk item at a time
    (so a state whose moments only fit in a store loads); so do the parameters (``offload_state(params=True)``).
    ``offload=``: the ``fs.offload_state`` the step is composed with, to place them as that step would (its stores,
    fractions, chunk size and ``params``) rather than as ``like`` has them, e.g. when ``like`` is fresh from
    ``fs.init``."""
    if not isinstance(like, TrainState):
        raise ArgumentError(f"fs.load(path, like): like must be an fs.TrainState (from fs.init), not "
                            f"{type(like).__name__}.")
    if offload is not None and not isinstance(offload, offload_state):
        raise ArgumentTypeError(f"fs.load(..., offload=): pass the fs.offload_state(...) the step is composed with, "
                                f"not {type(offload).__name__}.")
    mesh, spec = like.spec.mesh, like.spec
    mesh.check_alive()
    path = Path(path)
    if (path / MANIFEST).exists() or not (path / ".metadata").is_file():
        verify(path, mesh)  # an fshard checkpoint (or nothing): check every file first
    reader = _StreamingReader(str(path), {}, _Chunks())
    saved = reader.read_metadata().state_dict_metadata
    dev = mesh.device
    opt_state = _new_moments(like, offload, reader.targets)
    params = _new_params(like, offload, reader.targets)
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


def _new_params(like: TrainState, offload, targets: dict) -> dict:
    """Zeroed parameter shards to load into: in memory, or new items in their unit's store where the step keeps its
    parameters there (``offload_state(params=True)``: its placement; without ``offload``, where ``like`` has them),
    filled chunk by chunk as stored moments are (``targets``: rows of one), so a model whose parameters fit only in
    a store loads. The head is chunked as the unit's moments, the tail (frozen parameters) apart, as
    fshard/_stored.py lays them out; the ``order`` keys are the ones fs.save's boxes use (fshard/_checkpoint.py's
    ``_param_items``)."""
    spec, rank, dev = like.spec, like.spec.mesh.rank, like.spec.mesh.device
    if offload is not None:
        where = choose_stores(spec, like.opt_state, offload.stores, offload.fractions) if offload.params else {}
    else:
        where = {n: (p.head or p.tail).store for n, p in like.params.items() if isinstance(p, StoredParam)}
    n_units, tag, out = len(spec.units), uuid.uuid4().hex[:8], {}
    for i, u in enumerate(spec.units):
        store = where.get(u.name)
        if store is None:
            out[u.name] = torch.zeros(u.shard_numel, dtype=u.dtype, device=dev)
            continue
        head_n = u.opt_numel(rank)
        old = like.params[u.name] if offload is None else None  # (like's own chunks, matching its moments')
        parts = []
        for suffix, n, order, mine in (("param", head_n, n_units + i, old and old.head),
                                       ("tail", u.shard_numel - head_n, 2 * n_units + i, old and old.tail)):
            if n <= 0:
                parts.append(None)
                continue
            chunks = mine.chunks if mine is not None else _chunks(n, offload.chunk_numel if offload else n)
            parts.append(_target(targets, order, _Items(store, f"{u.name}@load-{tag}/{suffix}", chunks,
                                                        rows=("param",)), u.dtype))
        out[u.name] = StoredParam(parts[0], parts[1], u.shard_numel, head_n, u.dtype, _location(store))
    return out


def _new_moments(like: TrainState, offload, targets: dict) -> dict:
    """Zeroed optimizer states to load into: in memory, or new items in a store (``targets`` gets each chunk to
    fill, in order: ``_target``)."""
    spec, rank = like.spec, like.spec.mesh.rank
    chosen = {} if offload is None else choose_stores(spec, like.opt_state, offload.stores, offload.fractions)
    tag = uuid.uuid4().hex[:8]
    out = {}
    for order, u in enumerate(spec.units):
        st = like.opt_state.get(u.name)
        if st is None:
            continue
        n, count = u.opt_numel(rank), torch.zeros(len(u.trainable), dtype=torch.int64)
        if offload is not None:
            where = (chosen[u.name], _chunks(n, offload.chunk_numel)) if u.name in chosen else None
        else:
            where = (st.exp_avg.items.store, st.exp_avg.items.chunks) if isinstance(st.exp_avg, Stored) else None
        if where is None:
            out[u.name] = AdamWState(count, torch.zeros(n, dtype=u.dtype, device=spec.mesh.device),
                                     torch.zeros(n, dtype=u.dtype, device=spec.mesh.device))
            continue
        items = _target(targets, order, _Items(where[0], f"{u.name}@load-{tag}", where[1]), u.dtype)
        out[u.name] = _stored_state(items, count, n, u.dtype, _location(where[0]))
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

