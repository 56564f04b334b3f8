"""What ``TrainState.replace`` checks: each changed field against the state's spec, so that a fractional step, a
shard one element short or a missing unit is an error that names the field and the fix at the call, not a raw
``RuntimeError``/``KeyError`` from deep inside the next step."""
from __future__ import annotations

import torch

from ..errors import ArgumentError
from ._stored import in_store


def _what(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    return f"{type(v).__name__} {v!r}"[:80]


def _fail(field: str, msg: str) -> None:
    raise ArgumentError(f"state.replace({field}=...): {msg}")


def _check_flat(field: str, key: str, t, numel: int, dtype) -> None:
    where = f"{field}[{key!r}]"
    if not isinstance(t, torch.Tensor):
        _fail(field, f"{where} is {_what(t)}, where a tensor is needed.")
    if t.dim() != 1 or t.numel() != numel:
        _fail(field, f"{where} has shape {tuple(t.shape)}, where a unit's shard is flat, of ({numel},) elements: "
                     f"take the shard from state.{field}[{key!r}] and change its values (a tensor of the same shape).")
    if dtype is not None and t.dtype != dtype:
        _fail(field, f"{where} is {t.dtype}, but unit {key!r} holds {dtype}: cast it with .to({dtype}).")


def _check_units(field: str, got, names, required: bool) -> None:
    extra = [n for n in got if n not in names]
    if extra:
        _fail(field, f"{field} has unit {extra[0]!r}, which the model's layout does not have (its units: "
                     f"{', '.join(list(names)[:6])}{', ...' if len(names) > 6 else ''}).")
    missing = [n for n in names if n not in got] if required else []
    if missing:
        _fail(field, f"{field} lacks unit(s) {', '.join(map(repr, missing[:6]))}: every unit needs its entry. Change "
                     f"entries on a copy, {{**state.{field}, name: value}}.")


def check_fields(state, changes) -> None:
    """Raise ``ArgumentError`` for the first field of ``changes`` that does not fit ``state.spec``."""
    spec = state.spec
    units = {u.name: u for u in spec.units}
    rank = spec.mesh.shard_rank  # (the layout's rank: of the shard group on a 2-D mesh)
    for f in ("step", "skipped"):
        v = getattr(state, f)
        if f in changes and not (isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.dim() == 0):
            _fail(f, f"{f} must be a 0-dim torch.int64 tensor (a count), got {_what(v)}; pass torch.tensor(n) "
                     "with an int n.")
    if "params" in changes:
        _check_units("params", state.params, units, required=True)
        for n, t in state.params.items():
            if in_store(t) is not None:  # a shard in a store (offload_state(params=True))
                if t.numel != units[n].shard_numel or t.dtype != units[n].dtype:
                    _fail("params", f"params[{n!r}] holds {t.numel} elements of {t.dtype} in its store, where unit "
                                    f"{n!r}'s shard has {units[n].shard_numel} of {units[n].dtype}.")
                continue
            _check_flat("params", n, t, units[n].shard_numel, units[n].dtype)
    if "copies" in changes:
        _check_units("copies", state.copies, units, required=False)
        for n, t in state.copies.items():
            _check_flat("copies", n, t, units[n].shard_numel, None)
    if "opt_state" in changes:
        trainable = {n: u for n, u in units.items() if u.trainable}
        _check_units("opt_state", state.opt_state, trainable, required=False)
        for n, s in state.opt_state.items():
            u = trainable[n]
            opt = spec.optimizer  # the rows it declares (fshard/optim/_protocol.py), checked one by one
            if not isinstance(s, opt.state_type):  # the optimizer's own node type
                _fail("opt_state", f"opt_state[{n!r}] is {_what(s)}, where an "
                                   f"fs.optim.{opt.state_type.__name__} is needed.")
            c = s.count
            if not (isinstance(c, torch.Tensor) and c.dtype == torch.int64 and tuple(c.shape) == (len(u.trainable),)):
                _fail("opt_state", f"opt_state[{n!r}].count must be an int64 tensor of ({len(u.trainable)},), one "
                                   f"count per trainable parameter of the unit; got {_what(c)}.")
            for i, (row, m) in enumerate(zip(opt.rows, s.rows, strict=True)):
                want_n = _row_numel(opt, u, rank, i)  # (opt_numel, or fewer for a compact row: a partition's)
                if in_store(m) is not None:
                    if m.numel != want_n:
                        _fail("opt_state", f"opt_state[{n!r}].{row.name} holds {m.numel} elements in its store, "
                                           f"where this rank's shard has {want_n} with optimizer state.")
                    continue
                if not isinstance(m, torch.Tensor) or tuple(m.shape) != (want_n,):
                    _fail("opt_state", f"opt_state[{n!r}].{row.name} is {_what(m)}, where this rank's shard has "
                                       f"({want_n},) elements with optimizer state.")
                want = row.dtype_for(u.dtype)
                if m.dtype != want:
                    _fail("opt_state", f"opt_state[{n!r}].{row.name} is {m.dtype}, but unit {n!r} keeps it in "
                                       f"{want}: cast it with .to({want}).")
    if "buffers" in changes:
        want = {n: b for n, b in spec.template.named_buffers()}
        for n in want:
            if n not in state.buffers:
                _fail("buffers", f"buffers lacks {n!r}: every buffer of the model needs its value. Change entries "
                                 "on a copy, {**state.buffers, name: value}.")
        for n, b in state.buffers.items():
            if n not in want:
                _fail("buffers", f"buffers has {n!r}, which is not a buffer of the model.")
            if not isinstance(b, torch.Tensor) or tuple(b.shape) != tuple(want[n].shape):
                _fail("buffers", f"buffers[{n!r}] is {_what(b)}, where the model's has shape {tuple(want[n].shape)}.")


def _row_numel(opt, u, rank: int, i: int) -> int:
    """Row ``i``'s elements on this rank: ``opt_numel``, or those of the slots it covers where the optimizer
    declares ``covers`` (fshard/optim/_protocol.py's ``row_numel``, which this package may not import)."""
    covers = getattr(opt, "covers", None)
    if covers is None:
        return u.opt_numel(rank)
    return sum(max(0, hi - lo) for (lo, hi), on in zip(u.trainable_ranges(rank), covers(u, i)) if on)
