"""offload_state's whole-unit path, for an optimizer whose rows cannot stream through per-run updates
(``streamable`` is False: fs.muon's collective update, fs.partition's compact rows, fs.adafactor's factored rows).

Each unit in turn, in model order: its rows (and, with ``params=True``, its parameter shard) are read from the store
into memory, the optimizer's ordinary in-memory ``update`` runs on them (with the step's collectives where it
declares ``collective``), the new rows are written back (a new version; with ``donate``, over the input's items),
and the tensors are dropped before the next unit is read. So memory holds one unit's rows beyond the in-memory
case's working set, and the result is bitwise the in-memory update's (the same call on the same values). Units
kept in memory are updated in the same loop, so every rank calls ``update`` for the same units in the same order
whichever units its own placement put in a store (the collectives inside match). design/OFFLOAD.md, "Optimizers
that cannot stream".
"""
from __future__ import annotations

import time

import torch

from ..state._stored import StoredParam, _Items, param_key, stored_items, stored_state, write_rows
from ..store._protocol import locked


def whole_units(policy, step, state, grads, active, donate, created, m):
    """Every active unit's update, whole, in model order (see the module docstring): ``(params, opt_state,
    metrics, copies)`` as an update policy returns them. Keys written go to ``created``; ``m`` gets the traffic."""
    spec, opt = step.spec, step.spec.optimizer
    rank, params, opt_state = spec.mesh.shard_rank, dict(state.params), dict(state.opt_state)
    copies = dict(state.copies)
    kw = {"comm": step.comm} if getattr(opt, "collective", False) else {}
    m["offload/whole_unit_peak_bytes"] = 0  # the most read into memory at once: one unit's rows (and shard)
    for u in spec.units:
        s = state.opt_state.get(u.name)
        if s is None or not any(active[u.name]):
            continue
        held, p = stored_items(s), state.params[u.name]
        if held is None and not isinstance(p, StoredParam):  # in memory: the update DeviceUpdate would run
            params[u.name], opt_state[u.name], copy = opt.update(
                u, rank, p, grads.shards[u.name], s, active[u.name], donate, grad_scale=grads.scale,
                updates=int(state.step), copy=copies.get(u.name), **kw)
            if copy is not None:
                copies[u.name] = copy
            continue
        t0 = time.perf_counter()
        dev = grads.shards[u.name].device  # (a GPU mesh: the update runs where the gradient shard is)
        rows = [r.load().to(dev) if held is not None else r for r in s.rows]
        ps = p.load().to(dev) if isinstance(p, StoredParam) else p
        read = sum(r.nbytes for r in rows) * (held is not None) + (ps.nbytes if ps is not p else 0)
        m["io/read_bytes"] += read
        m["offload/whole_unit_peak_bytes"] = max(m["offload/whole_unit_peak_bytes"], read)
        t1 = time.perf_counter()
        # what was read is this update's own: updated in place (donate); a parameter in memory follows ``donate``
        new_p, new_s, copy = opt.update(
            u, rank, ps, grads.shards[u.name], s.with_rows(s.count, rows), active[u.name],
            donate or (held is not None and isinstance(p, StoredParam)),
            grad_scale=grads.scale, updates=int(state.step),
            copy=None if isinstance(p, StoredParam) else copies.get(u.name), **kw)
        t2 = time.perf_counter()
        # donate: written back under the input's own keys (its items serve the new state, as the stream's do);
        # else a new version, the input's items left readable
        key = policy._key(u.name)
        written = [] if donate else created  # (in place: a failure cannot give the donated input back anyway)
        if held is not None:
            items = held if donate else _Items(held.store, key, held.chunks, held.rows)
            with locked(held.store):
                write_rows(items, new_s.rows, written)
            m["io/write_bytes"] += sum(r.nbytes for r in new_s.rows)
            new_s = stored_state(new_s, items, new_s.count, [r.numel() for r in new_s.rows], new_s.rows[0].dtype,
                                 s.rows[0].location)
        if isinstance(p, StoredParam):
            new_p = _renew_head(p, new_p, None if donate else param_key(key), written)
            m["io/write_bytes"] += p.opt_numel * p.dtype.itemsize
        elif copy is not None:
            copies[u.name] = copy
        params[u.name], opt_state[u.name] = new_p, new_s
        del rows, ps  # the unit's tensors go before the next unit is read
        step.record("store", f"read {u.name}", t0, t1)
        step.record("update", f"{u.name} (whole)", t1, t2)
        step.record("store", f"write {u.name}", t2, time.perf_counter())
    return params, opt_state, {}, copies


def _renew_head(p: StoredParam, shard: torch.Tensor, key: str | None, created: list) -> StoredParam:
    """``p`` with the optimizer range of ``shard`` (the updated parameters) written as its head, chunked as before:
    under ``key`` (a new version), or over the old head (``key`` None: donated). Its tail (frozen parameters) is
    shared."""
    if p.head is None:
        return p
    head = p.head if key is None else _Items(p.head.store, key, p.head.chunks, rows=p.head.rows)
    with locked(head.store):
        write_rows(head, [shard[:p.opt_numel]], created)
    return p if key is None else p.renewed(head)
