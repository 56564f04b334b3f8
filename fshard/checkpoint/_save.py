"""fs.save / fs.load: TrainState checkpoints through torch.distributed.checkpoint (DCP).

The checkpoint is a DCP directory that FSDP2 and plain torch can read, in the layout FSDP2's users already have:

- ``"model"``: keyed like ``model.state_dict()`` (every name of a tied parameter, persistent buffers). Each rank
  writes only its shard of each parameter, as boxes with true offsets (fshard/checkpoint/_dcp.py), so DCP reshards.
- ``"optim"``: ``get_optimizer_state_dict``'s layout, keyed by parameter name: ``state[name]`` holds the count under
  the optimizer's ``count_key`` (a 0-dim fp32 tensor, as torch's AdamW keeps ``step``) and each row the optimizer
  declares under its name (boxes as above: AdamW's two moments); parameters that were never updated have no entry,
  as in torch. ``param_groups`` is the optimizer's (``param_groups``: AdamW's, one group per weight decay). Rows in
  a store (fs.offload_state) stream through it chunk by chunk, on save and on load.
- ``"fshard"``: the step and skip counts, ``transform_state`` (the loss scale, ...), non-persistent buffers, and a
  description of the layout for the error messages.

A save is visible only complete (a rename after DCP's metadata and fshard's manifest of file CRCs, in
fshard/checkpoint/_files.py), and deletes nothing fshard did not write; ``load`` checks every file's size and CRC before
DCP reads, so a damaged file is an error that names it, and runs nothing a checkpoint holds (checkpoint/_read.py).
Both are phases ended by checks that every rank joins (fshard/dist/_call.py), so a failure on one rank is an fshard
error on every rank. ``blocking=False`` runs the save in a thread of its own, over a process group of its own, on
the state as it is: a state is immutable unless donated, so the save needs no copy (fs.SaveHandle).
"""
from __future__ import annotations

import json
import os
import traceback
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..dist._call import Call
from ..dist._agreement import explain
from ..dist._bare import bare
from ._files import (FORMAT, check_target, commit, crc_share, data_files, discard, latest,  # noqa: F401
                          start, token)  # (latest: fs.latest)
from ._dcp import _Boxes, _Chunks, _SavePlanner, slot_boxes
from ..errors import ArgumentError, ArgumentTypeError, CheckpointError, CollectiveError, copy_of_kept
from ..dist._mesh import Mesh
from ..state._train_state import TrainState
from ..optim._protocol import count_key_of, optimizer_of, row_names, row_ranges
from ..state._stored import StoredParam, in_store, stored_items

__all__ = ["save", "latest", "SaveHandle"]  # fs.load: fshard/checkpoint/_load.py


def _layout_of(state: TrainState) -> dict:
    return {"format": FORMAT, "world_size": state.spec.mesh.world_size, "step": int(state.step),
            "params": {s.name: list(s.shape) for u in state.spec.units for s in u.slots},
            "dtypes": {u.name: str(u.dtype) for u in state.spec.units}}


def template_keys(template: torch.nn.Module) -> tuple[tuple[str, str, str], ...]:
    """``(state_dict key, "param" or "buffer", the canonical name)`` of each tensor of the model's state dict (a
    tied or shared tensor's first name, as the state's slots and buffers are named). Read from the template module,
    so only where no step is running: a step rebinds the template's parameters while it runs (bound per call), and
    a background save reading them then saw untied names (a KeyError, 1 run in many)."""
    canonical = {id(p): n for n, p in template.named_parameters()}
    buffer_of = {id(b): n for n, b in template.named_buffers()}  # a shared buffer's first name, as state.buffers
    out = []
    for key, t in template.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and id(t) in canonical:
            out.append((key, "param", canonical[id(t)]))
        elif isinstance(t, torch.Tensor) and id(t) in buffer_of:
            out.append((key, "buffer", buffer_of[id(t)]))
    return tuple(out)


def _entries(state: TrainState, params, opt_state, buffers, for_load: bool, window: _Chunks, keys=None):
    """The DCP state dict of a state's tensors (``params``/``opt_state`` may be new tensors to load into); moments
    in a store become boxes of its chunk items, read (save) or filled (load) through ``window``. ``keys``: the
    template's (``template_keys``), read by the caller before a save goes to the background."""
    spec, rank = state.spec, state.spec.mesh.shard_rank  # (2-D: replicas write the same boxes; DCP keeps one)
    slot = {s.name: (u, s) for u in spec.units for s in u.slots}
    model, persistent = {}, set()
    for key, kind, name in (template_keys(spec.template) if keys is None else keys):
        if kind == "param":
            u, s = slot[name]
            p = params[u.name]
            model[key] = (slot_boxes(u, s, rank, p.dtype, flat=p) if in_store(p) is None else
                          slot_boxes(u, s, rank, p.dtype, stored=_param_items(p, s, window, spec, u)))
        else:
            persistent.add(name)
            model[key] = buffers[name]
    optim, opt = {}, spec.optimizer
    names = row_names(opt)  # the rows it declares, saved under their names (fshard/optim/_protocol.py)
    for order, u in enumerate(spec.units):
        st = opt_state.get(u.name)
        if st is None:
            continue
        rows = [dict(dtype=m.dtype, **(dict(stored=(m.items, r, window, order)) if in_store(m) is not None else
                                       dict(flat=m))) for r, m in enumerate(st.rows)]
        # where each row holds each slot: (lo - at) is how far a compact row (a partition's) is shifted from
        # the shard (fshard/optim/_protocol.py's covers); a row that covers every slot has at == lo
        shift = [{k: lo - at for k, lo, _, at in row_ranges(opt, u, rank, i)} for i in range(len(names))]
        extra = opt.extra_entries(u, st) if hasattr(opt, "extra_entries") else {}  # (whole tensors: Adafactor's)
        for k, s in enumerate(u.trainable):
            own = optimizer_of(opt, s.name)  # (a partition's member for the parameter)
            if not for_load and int(st.count[k]) == 0 and not getattr(own, "eager_state", False):
                continue  # never updated: torch keeps no state for it (Adagrad's makes it when built: eager_state)
            key = count_key_of(opt, s.name)
            entry = {} if key is None else {key: torch.tensor(float(st.count[k]), dtype=torch.float32)}
            entry.update((name, slot_boxes(u, s, rank, **row, shift=shift[i].get(k, 0)))
                         for i, (name, row) in enumerate(zip(names, rows, strict=True)) if k in shift[i])
            entry.update(extra.get(s.name, {}))
            scalars = getattr(own, "saved_scalars", None)  # 0-dim state that follows the count (from_torch's)
            if scalars is not None and not for_load and int(st.count[k]) > 0:  # (a load recomputes them)
                entry.update(scalars(int(st.count[k]), int(state.step), own.decays(u)[k]))
            optim[s.name] = entry
    param_groups = opt.param_groups(spec.units, int(state.step))
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
    return [items.store for st in state.opt_state.values() if (items := stored_items(st)) is not None]


def save(path, state: TrainState, *, keep_last: int | None = None, blocking: bool = True):
    """Collective: write ``state`` as a DCP checkpoint at ``path`` (a directory), every rank its own shards. The
    checkpoint appears at ``path`` only once complete; an existing one at ``path`` is replaced only then. A ``path``
    that exists and is not an fshard checkpoint (nor an empty directory) is refused: fs.save deletes nothing it did
    not write. ``keep_last=N``: afterwards, of the complete checkpoints in ``path``'s parent directory that are of
    ``path``'s series (the same name but for its numbers, ``step-00000100``, ``step-00000200``: checkpoint/_files.py),
    keep the N committed last, this one always among them, and delete the others. A failed save removes its
    ``<path>.partial`` and leaves ``path`` as it was; a failure on one rank raises on every rank: its own error there
    (an ``OSError``, DCP's as a ``CheckpointError``), ``RankFailedError`` naming it on the others. Moments
    in a store are read from it one chunk item at a time, never all at once.

    Returns the path; with ``blocking=False``, at once a ``SaveHandle`` whose ``wait()`` returns it, while the save
    runs in a thread beside training (the arguments and the target are checked before it returns). The state needs
    no copy, as a step that does not donate never changes its input; a step composed with ``donate=True`` refuses a
    state whose save was not waited for. Moments in a store are read under ``store.session_lock``, which the step's
    offload holds while it streams, so the two take turns; the items the save reads stay on disk until it is done
    (a step writes new versions beside them)."""
    if not isinstance(state, TrainState):
        raise ArgumentError(f"fs.save(path, state): state must be an fs.TrainState, not {type(state).__name__}.")
    mesh = state.spec.mesh
    mesh.check_alive()
    call = Call(mesh, "fs.save", "Nothing was written")
    given = path
    path = call.run("its arguments", lambda: _target(given, state, keep_last, blocking),
                    same=lambda p: (str(p), keep_last, blocking),
                    differ="Every rank must pass the same path, keep_last and blocking.")
    keys = template_keys(state.spec.template)  # (here, between steps: not in the background, beside one)
    if blocking:
        return _write(path, state, mesh, keep_last, str(Path(given)), keys)
    background = mesh.background()  # the mesh's worker: the save's collectives never interleave with the step's
    group = background.group
    on = mesh if group is None else Mesh(mesh.rank, mesh.world_size, "gloo", torch.device("cpu"), group, mesh.timeout)
    handle = SaveHandle(str(Path(given)), background.submit(_write, path, state, on, keep_last, str(Path(given)),
                                                            keys), state.donation)
    state.donation.saves.append(handle)
    return handle


def _target(path, state: TrainState, keep_last, blocking) -> Path:
    """fs.save's checks on this rank, before anything is written: the arguments, the state, the target."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ArgumentError(f"fs.save: keep_last must be an int >= 1 or None, got {keep_last!r}.")
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"fs.save(path, state): path must be a str or a path, not {type(path).__name__}.")
    state.check_usable()
    unlocked = {type(s).__name__ for s in _stores(state) if getattr(s, "session_lock", None) is None}
    if not blocking and unlocked:
        raise CheckpointError(f"fs.save(..., blocking=False): this state's moments are in a store without a "
                              f"session_lock ({', '.join(sorted(unlocked))}), which the step's offload would use at "
                              "the same time; give the store a `session_lock` (a threading.RLock, as CPUStore and "
                              "NVMeStore have) or save with blocking=True.")
    path = Path(os.path.abspath(path))
    check_target(path)
    return path


def _write(path: Path, state: TrainState, mesh: Mesh, keep_last, shown: str, keys: tuple) -> str:
    """The save proper, in phases that every rank ends at the same check (fshard/dist/_call.py): the ``.partial``
    made, DCP's write, the files' checksums, rank 0's commit. Any failure removes the ``.partial`` (rank 0), before
    any rank returns where the ranks can still agree."""
    tmp = path.with_name(path.name + ".partial")
    call, rank, n = Call(mesh, "fs.save", f"{path} is unchanged"), mesh.rank, mesh.world_size
    mine = [""]
    shared = f"Every rank must see the same {tmp}: save to a filesystem that every rank shares."
    try:
        call.run(f"making {tmp}", (lambda: mine.__setitem__(0, start(tmp))) if rank == 0 else None)
        mine[0] = call.run(f"reading {tmp}'s marker", lambda: token(tmp), same=lambda t: t, differ=shared)
        sd = call.run("building the state dict", lambda: _entries(state, state.params, state.opt_state,
                                                                  state.buffers, for_load=False, window=_Chunks(),
                                                                  keys=keys))
        call.run(f"writing {tmp}", lambda: _dcp(call, f"writing {tmp}", f"{path} is unchanged", dcp.save, sd,
                                                storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                                                planner=_SavePlanner()))
        names = call.run(f"listing {tmp}", lambda: data_files(tmp), same=lambda x: x, differ=shared)
        sums = call.all_reduce(call.run(f"the checksums of {tmp}", lambda: crc_share(tmp, names, rank, n)),
                               f"the checksums of {tmp}")
        call.run(f"the commit of {path}", (lambda: commit(tmp, path, _layout_of(state), names, sums, mine[0],
                                                           keep_last)) if rank == 0 else None)
    except BaseException as e:
        remove = (lambda: discard(tmp, mine[0])) if rank == 0 else None
        if isinstance(e, Exception) and not isinstance(e, CollectiveError):
            try:  # every rank knows of the failure: none returns before the .partial is gone
                call.run(f"removing {tmp}", remove)
            except Exception:  # noqa: BLE001 - the save's own error is the one to report
                pass
        elif remove is not None:
            remove()  # (Ctrl-C, or the transport broke: no other rank can be waited for)
        # an async save's error is kept in its handle, which the state keeps until wait(): the finished frames'
        # locals (the state among them) would close a cycle through the traceback
        traceback.clear_frames(e.__traceback__)
        state = mesh = call = None  # noqa: F841 - (this frame, still running, is in the traceback too, as are the
        raise                       # lambdas' cells)
    return shown  # (the path as given; ``path`` is its absolute form, which every rank compared)


def _dcp(call, what: str, intact: str, fn, sd, **kw):
    """``fn`` (dcp.save or dcp.load) over ``call``'s mesh: without a process group, DCP's single-process mode
    (DCP would otherwise use the world group: a ``Mesh.local()`` state under torchrun). DCP tells every rank of a
    failure on one (``CheckpointException``), which becomes a ``CheckpointError``; a transport failure in DCP's own
    collectives, a ``CollectiveError``. DCP's collectives are issued as fshard's own: without the caller's
    saved-tensor hooks in their works (fshard/dist/_bare.py)."""
    group = call.mesh.group
    try:
        with bare():
            return fn(sd, process_group=group, no_dist=group is None, **kw)
    except (Exception, CheckpointException) as e:
        if not isinstance(e, CheckpointException) and _transport(e):
            raise CollectiveError(explain(call.comm, f"DCP's collectives while {what}", e)) from e
        raise CheckpointError(f"{call.name}: {what} failed ({_cause(e)}); {intact}.") from e


def _transport(e: BaseException) -> bool:
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        w in str(e) for w in ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "timed out")))


class SaveHandle:
    """An asynchronous save (``fs.save(path, state, blocking=False)``), running in the mesh's background thread over
    its background process group (``Mesh.background``), after any save started before it; ``mesh.close()`` waits for
    it and ends both. ``wait()`` returns the checkpoint's path once it is complete and visible, or raises the save's
    error; call it on every rank before a step that donates the state."""

    def __init__(self, path: str, future, donation):
        self.path, self._future, self._donation = path, future, donation

    def done(self) -> bool:
        """Whether the save has finished (written, or failed) on this rank."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save is complete; return its path. Raises the save's error if it failed (a copy of it at
        each call: as ``fs.save`` raises, this rank's own error or ``RankFailedError``), or ``CheckpointError`` if
        ``timeout`` seconds passed first (then the save goes on: wait again)."""
        try:
            error = self._future.exception(timeout)
        except FutureTimeout:
            raise CheckpointError(f"fs.save(..., blocking=False) of {self.path} did not finish within {timeout} s; "
                                  "it is still running: call wait() again.") from None
        finally:
            if self._future.done() and self in self._donation.saves:
                self._donation.saves.remove(self)
        if error is None:
            return self._future.result()
        raise copy_of_kept(error)  # (not the kept error itself: fshard/errors.py)

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, {'done' if self.done() else 'running'})"
