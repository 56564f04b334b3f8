"""offload_state's whole-unit path, for an optimizer whose rows cannot stream through per-run updates
(``streamable`` is False: fs.muon's collective update, fs.partition's compact rows, fs.adafactor's factored rows).

Each unit in turn, in model order: its rows (and, with ``params=True``, its parameter shard) are read from the store
into memory, the optimizer's ordinary in-memory ``update`` runs on them (with the step's collectives where it
declares ``collective``), the new rows are written back under a new key, and the tensors are dropped before the next
unit is read. So memory holds one unit's rows beyond the in-memory case's working set, and the result is bitwise the
in-memory update's (the same call on the same values). Units kept in memory are updated in the same loop, so every
rank calls ``update`` for the same units in the same order whichever units its own placement put in a store (the
collectives inside match). design/OFFLOAD.md, "Optimizers that cannot stream".
"""
from __future__ import annotations

import time

import torch

from ..state._stored import StoredParam, _Items, param_key, put_moments, stored_items
from ..store._protocol import locked


def whole_units(policy, step, state, grads, active, donate, created, m):
    """Every active unit's update, whole, in model order (see the module docstring): ``(params, opt_state,
    metrics, copies)`` as an update policy returns them. Keys written go to ``created``; ``m`` gets the traffic."""
    spec, opt = step.spec, step.spec.optimizer
    rank, params, opt_state = spec.mesh.shard_rank, dict(state.params), dict(state.opt_state)
    copies, names = dict(state.copies), tuple(r.name for r in opt.rows)
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
        rows = [r.load() if held is not None else r for r in s.rows]
        ps = p.load() if isinstance(p, StoredParam) else p
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
        key = policy._key(u.name)
        if held is not None:
            with locked(held.store):
                new_s = put_moments(held.store, key, new_s, names, policy.chunk, created)
            m["io/write_bytes"] += sum(r.nbytes for r in new_s.rows)
        if isinstance(p, StoredParam):
            new_p = _renew_head(p, new_p, param_key(key), created)
            m["io/write_bytes"] += p.opt_numel * p.dtype.itemsize
        elif copy is not None:
            copies[u.name] = copy
        params[u.name], opt_state[u.name] = new_p, new_s
        del rows, ps  # the unit's tensors go before the next unit is read
        step.record("store", f"read {u.name}", t0, t1)
        step.record("update", f"{u.name} (whole)", t1, t2)
        step.record("store", f"write {u.name}", t2, time.perf_counter())
    return params, opt_state, {}, copies


def _renew_head(p: StoredParam, shard: torch.Tensor, key: str, created: list) -> StoredParam:
    """``p`` with the optimizer range of ``shard`` (the updated parameters) written as a new version of its head,
    chunked as the old one (its tail, frozen parameters, is shared)."""
    if p.head is None:
        return p
    store, handles = p.head.store, []
    with locked(store):
        for i, (lo, hi) in enumerate(p.head.chunks):
            handles.append(store.put((key, i), shard[lo:hi].detach().to("cpu").reshape(1, -1)))
            created.append((key, i))
        for h in handles:
            h.wait()
    return p.renewed(_Items(store, key, p.head.chunks, rows=p.head.rows))
