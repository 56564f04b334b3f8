"""step.plan(state, batch): what one step will cost on this rank, before it runs (the ``fs.Plan`` of step/_plan.py).

The plan runs the step's own policies on a simulated step: units whose shards are meta tensors (no data), the
gather, reduce and grads policies called in the order a step calls them, and a dry ``Comm`` (``dry=True``: the
step's own bookkeeping of every collective, with no transport) that counts what each would move. The order is the
gather order the gather policy holds, else the one the last step of this step function observed (which units forward
called and backward read, and which parameters got a gradient), else, before any step, the layout's order with
every unit called once and every parameter used. So a custom policy is planned by the same code that runs it, and
no stage needs a cost model of another. The update stage, which touches state rather than layouts, says what it
will write and read through ``UpdatePolicy.plan``. Nothing of the model's compute runs. Activations come from the
last step's measurement, or before the first step from one forward on the meta device (``activations``); the
framework's own allocations are not in the plan. Before any step, a gather policy that records its gather order is
planned with the one the first step will record (layout order), so the plan is of the steps that prefetch. The
plan assumes the update runs: a step that skips it (non-finite gradients, an fp16 overflow) makes no new state and
writes nothing to a store.

Every figure is a metric name: after a step, ``metrics`` carries the same names, measured (tests/test_plan.py
checks they agree within 5%). Policies are copied before the simulation, so planning changes no gather order or
bucket plan of the real step.
"""
from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import optree
import torch

from ..transforms._accumulate import Accumulator
from ..protocol._stages import Grads, UpdatePolicy
from ..dist._agreement import CHECKED, agree
from ..dist._collectives import Comm
from ..dist._view import CollectivesView
from ._eval import train_mode
from ..transforms._gather_ahead import GatherOrder
from ..state._flat import ROOT
from ._plan import Plan, peak_bytes, state_figures
from ..state._stored import in_store
from ..run._run import StepRun


def _rss() -> int:
    """This process's resident set now (Linux; elsewhere its peak so far)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True)
class _PlanMesh:
    """The mesh a simulated step sees: the real rank and world size; unit data on meta. ``group`` is a stand-in
    (never used: the Comm is dry) that is set where the real mesh has a process group, so that the dry Comm counts
    exactly what the real one would."""

    rank: int
    world_size: int
    backend: str
    device: torch.device = torch.device("meta")
    group: object = None
    gather_impl: str = "auto"  # (a dry Comm moves nothing: how it would gather changes no figure)
    shard_size: int = 0  # the real mesh's shape (2-D: its groups stand-ins too)
    shard_group: object = None
    replica_group: object = None
    control_group: object = None

    shard_rank = property(lambda self: self.rank % self.shard_size)
    replicas = property(lambda self: self.world_size // self.shard_size)
    replica_rank = property(lambda self: self.rank // self.shard_size)


def _dry_comm(mesh, device: str) -> Comm:
    def stand_in(g):
        return "simulated" if g is not None else None
    return Comm(_PlanMesh(mesh.rank, mesh.world_size, mesh.backend, torch.device(device), stand_in(mesh.group),
                          shard_size=mesh.shard_size, shard_group=stand_in(mesh.shard_group),
                          replica_group=stand_in(mesh.replica_group),
                          control_group=stand_in(mesh.control_group)), dry=True)


def _copy(policy):
    """A copy that shares nothing the simulation changes (a wrapper's inner policy included); a policy that
    cannot be deep-copied (it holds a lock or a thread) is copied shallowly."""
    try:
        return copy.deepcopy(policy)
    except Exception:  # noqa: BLE001
        return copy.copy(policy)


class _NoUpdate(UpdatePolicy):
    """The simulated step begins no update during backward."""


def _simulated(pol):
    """The step's policies for a simulated step: copies (planning must not change the real policies), no update."""
    return dataclasses.replace(pol, gather=_copy(pol.gather), reduce=_copy(pol.reduce), update=_NoUpdate())


def _meta_state(spec, stored: dict | None = None) -> SimpleNamespace:
    """What a simulated step's units are made from: every shard a meta tensor (no data), except the leaves held in
    a store (``in_store``) in ``stored``, kept so that a gather counts their reads."""
    stored = stored or {}
    return SimpleNamespace(spec=spec, params={u.name: stored.get(u.name) or
                                              torch.empty(u.shard_numel, dtype=u.dtype, device="meta")
                                              for u in spec.units}, copies={})


def _layout_order(spec) -> tuple[list, list]:
    """(forward, backward) of a model that calls its units once each in layout order, without the root in forward
    (bound around all of it): backward begins at the root (its parameters are used around all the others)."""
    names = [u.name for u in spec.units if u.name != ROOT]
    root = [ROOT] if any(u.name == ROOT for u in spec.units) else []
    return names, root + names[::-1]


def plan(step, state, batch, observed=None) -> Plan:
    """What ``step(state, batch)`` will cost on this rank (see the module docstring). Local: no collective.
    ``observed``: ``(forward, backward, active)`` of the last step this step function ran (the units forward called
    and backward read, in order, and which parameters got a gradient): the order used when the gather policy holds
    no gather order; before any step, the layout's order, reversed in backward, every parameter getting a gradient."""
    spec, mesh = state.spec, state.spec.mesh
    pol = step.policy
    sim = _simulated(pol)
    if observed is None and sim.gather.gather_order is None:  # the steps after the first follow what it records
        _assume_order(sim.gather, spec)
    comm = _dry_comm(mesh, "meta")  # units, gathers, reductions: no data
    ctrl = _dry_comm(mesh, "cpu")  # control messages: tiny real tensors, as agree() and the grads stage make them
    if mesh.world_size > 1:  # the rank check before any gather (check_ranks): five hashes
        agree(ctrl, [], [0] * CHECKED)
    k = len(pol.batches(batch))
    fake = _meta_state(spec, {n: p for n, p in state.params.items() if in_store(p) is not None})
    acc, scratch, runs, accum = Accumulator(k), {}, [], 0
    try:  # the simulated runs bind the template in backward: closed (unbound) whatever happens
        for i in range(k):
            run = StepRun(fake, comm, sim, acc, scratch, last=i == k - 1, donate=step.donate)
            runs.append(run)
            _simulate(sim, run, observed)
            accum = max(accum, sum(g.nbytes for g in acc.grads.values()))
        run = runs[-1]
        agree(ctrl, [0.0] * (1 + sum(len(u._got) for u in run.units.values())), [0])  # the step's agreement
        shards = run._grad_shards()
        ones = {n: torch.zeros(1, dtype=g.dtype) for n, g in shards.items()}  # the grads stage's control messages
        got = {name: [bool(g) for g in u._got] for name, u in run.units.items()}
        g = Grads(ones, spec=spec, active=got, transform_state=state.transform_state)
        for link in pol.grads:  # the grads chain, link after link, as the step runs it
            g = _copy(link)(CollectivesView(ctrl), g)
        f = {"mem/peak_gathered_bytes": max(r._peak_bytes for r in runs),
             "mem/unit_grad_bytes": max(r._unit_grad_bytes for r in runs),
             "mem/reduce_buffer_bytes": comm.reduce_buffer_bytes,
             "mem/grad_shard_bytes": sum(g.nbytes for g in shards.values()), "mem/accum_bytes": accum,
             "mem/grad_shard_peak_bytes": sum(g.nbytes for g in shards.values()),  # (the update's plan may lower it)
             "mem/param_read_bytes": max(r._read_peak for r in runs),
             "comm/gather_bytes": comm.bytes.get("all_gather", 0),
             "comm/reduce_bytes": comm.bytes.get("reduce_scatter", 0) + comm.bytes.get("reduce", 0),
             "comm/replica_bytes": comm.bytes.get("replica", 0), "comm/update_bytes": 0,  # (the update's plan says)
             "comm/control_bytes": ctrl.bytes.get("control", 0), "io/write_bytes": 0,
             "io/read_bytes": sum(r._loaded_bytes for r in runs),  # parameter shards a gather reads from a store
             "mem/new_state_bytes": 0, **state_figures(state)}
        unknown = ()
        active = {name: list(u._got) for name, u in run.units.items()}
        update = pol.update.plan(run, state, active, step.donate)  # while the simulated units still hold their grads
    finally:
        for r in runs:
            r._close()
    if update is None:
        unknown = ("update",)
    else:
        f.update({k: f.get(k, 0) + v if k.startswith("io/") else v for k, v in update.items()})
    bounds = {k: f.pop(k) for k in ("store/peak_bytes", "store/buffer_bytes", "store/pool_bytes",
                                    "store/memory_peak_bytes", "offload/movable_bytes", "offload/device_bytes")
              if k in f}
    tiers = f.pop("offload/tiers", ())
    f["mem/peak_bytes"] = peak_bytes(f)
    params = sum(s.numel for u in spec.units for s in u.slots)
    held = f["mem/state_bytes"] + bounds.pop("store/pool_bytes", 0)  # in the process's RSS now, and in the plan
    if observed is not None and len(observed) > 3:  # what the last step's forward saved for backward
        bounds["mem/activation_bytes"] = observed[3]
    else:  # before the first step: what a forward on the meta device saves
        acts = activations(step, state, pol.batches(batch)[0])
        if acts is not None:
            bounds["mem/activation_bytes"] = acts
    return Plan(f, mesh.rank, mesh.world_size, k, step.donate, params, unknown, bounds,
                max(0, _rss() - held), tiers, mesh.device.type)


def _assume_order(gather, spec) -> None:
    """Before any step, a gather policy that follows a gather order it records (gather_ahead) is planned with the one
    the first step will record for a model that calls its units in layout order: forward the root then the units,
    backward the root then the units reversed (its prefetch in the later steps is what the plan is for)."""
    forward, backward = _layout_order(spec)
    try:
        gather.gather_order = GatherOrder(([ROOT] if backward[:1] == [ROOT] else []) + forward, backward)
    except AttributeError:  # a policy whose gather order cannot be set: planned as it is
        pass


def activations(step, state, batch) -> int | None:
    """The bytes forward saves for backward (activations: the storages autograd keeps, less the units' gathered
    buffers), counted as a step counts them (``metrics["mem/activation_bytes"]``), from one forward on the meta
    device: the template with every unit's parameters, the buffers and ``batch`` as meta tensors (no data, no
    compute, the RNG untouched). None when the model cannot run there (an op without a meta kernel, code that reads
    a value from a tensor): the plan then leaves activations out until a step has measured them."""
    spec = state.spec
    meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    sim = _simulated(step.policy)
    run = StepRun(_meta_state(spec), _dry_comm(spec.mesh, "meta"), sim, Accumulator(1), {}, last=True)
    try:
        with torch.random.fork_rng(devices=[]), train_mode(spec.template, True), run._active():
            sim.gather.start(run)
            step._forward(run, {k: meta(b) for k, b in state.buffers.items()},
                          optree.tree_map(meta, batch, none_is_leaf=True))
        return sum(run._activations.values())
    except Exception:  # noqa: BLE001 - not runnable on meta: unknown, not an error of the step
        return None
    finally:
        run._close()


def _simulate(pol, run: StepRun, observed) -> None:
    """One micro-batch's gather and reduce events, in the order a step makes them: the root bound around the
    whole forward, each unit called in the gather order; in backward each unit read, its use finished, its
    gradient handed to the reduce policy (the root's at the end), then the reduce policy's finish."""
    gather, units = pol.gather, run.units
    order = gather.gather_order
    if order is not None:
        forward, backward = [n for n in order.forward if n != ROOT], list(order.backward)
    elif observed is not None:
        forward, backward = list(observed[0]), list(observed[1])
    else:
        forward, backward = _layout_order(run.spec)
    if observed is not None:  # which parameters got a gradient, as in the last step
        for name, got in observed[2].items():
            if name in units:
                units[name]._got = list(got)
    else:
        for u in units.values():
            u._got = [True] * len(u._got)
    for u in units.values():  # a routed group's members move together here (below), not through its calls
        u._member = False
    gather.start(run)
    root = units.get(ROOT)
    if root is not None:
        gather.before_forward(run, root)
    for names in _chunks(forward, run.spec.groups):
        for name in names:
            run.order.append(name)
            gather.before_forward(run, units[name])
        for name in names:
            gather.after_forward(run, units[name])
    if root is not None:
        gather.after_forward(run, root)
    run.phase = "backward"
    last = {n: i for i, n in enumerate(backward)}
    i = 0
    for names in _chunks(backward, run.spec.groups):
        for name in names:
            gather.before_backward(run, units[name])
        for name in names:
            if name != ROOT:  # the root's use lasts to the end of backward (the embedding is the first layer)
                _finish_use(run, gather, units[name], i == last[name])
            i += 1
    for name in dict.fromkeys(forward):  # units whose parameters backward never reads: their gradient still comes
        if name not in last:
            _finish_use(run, gather, units[name], True)
    if root is not None:
        _finish_use(run, gather, root, True)
    run._end_backward()
    gather.finish(run)
    run._release_all()


def _chunks(order: list[str], groups) -> list[list[str]]:
    """``order`` cut into the steps a step takes: a routed group's members (consecutive, as its call gathers
    them) together, every other unit alone."""
    group_of = {m: tuple(members) for _, members in groups for m in members}
    out, i = [], 0
    while i < len(order):
        members = group_of.get(order[i])
        if members and tuple(order[i:i + len(members)]) == members:
            out.append(list(members))
            i += len(members)
        else:
            out.append([order[i]])
            i += 1
    return out


def _finish_use(run, gather, unit, last_use: bool) -> None:
    gather.after_backward(run, unit)
    if last_use and unit.trainable:
        run._grad_arrived(unit, torch.empty(unit.layout.numel, dtype=run.param_dtype or unit.layout.dtype,
                                            device="meta"))
