"""step.plan(state, batch): what one step will cost on this rank, before it runs.

The plan runs the step's own policies on a simulated step: units whose shards are meta tensors (no data), the
gather, reduce and grads policies called in the order a step calls them, and a dry ``Comm`` (``dry=True``: the
step's own bookkeeping of every collective, with no transport) that counts what each would move. The order is the
schedule the gather policy holds, else the one the last step of this step function observed (which units forward
called and backward read, and which parameters got a gradient), else, before any step, the layout's order with
every unit called once and every parameter used. So a custom policy is planned by the same code that runs it, and
no stage needs a cost model of another. The update stage, which touches state rather than layouts, says what it
will write and read through ``UpdatePolicy.plan``. Nothing of the model's compute runs: activations are not in the
plan (they are the model's, as in DDP or FSDP2), and neither are the framework's own allocations. The plan
assumes the update runs: a step that skips it (non-finite gradients, an fp16 overflow) makes no new state and
writes nothing to a store.

Every figure is a metric name: after a step, ``metrics`` carries the same names, measured (tests/test_plan.py
checks they agree within 5%). Policies are copied before the simulation, so planning changes no schedule or
bucket plan of the real step.
"""
from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import optree
import torch

from ._accumulate import Accumulator
from ._errors import MemoryBudgetError
from ._base import Grads, UpdatePolicy
from ._agreement import CHECKED, agree
from ._collectives import Comm, CollectivesView
from ._init import ROOT
from ._state import NAMESPACE
from ._stored import StoredParam
from ._unit import StepRun

# (metric, what it is): the rows of print(plan), in order
MEMORY = (
    ("mem/params_bytes", "parameter shards"),
    ("mem/copies_bytes", "their low-precision copies (param_copies)"),
    ("mem/opt_state_bytes", "optimizer state in memory"),
    ("mem/buffers_bytes", "buffers (replicated)"),
    ("mem/new_state_bytes", "new state the update writes (0 with donate)"),
    ("mem/peak_gathered_bytes", "gathered units, at most at once"),
    ("mem/unit_grad_bytes", "one unit's gradient before reduction, largest"),
    ("mem/reduce_buffer_bytes", "one reduction's buffer, largest"),
    ("mem/grad_shard_bytes", "gradient shards (held until the update)"),
    ("mem/grad_shard_peak_bytes", "of those, held at once (an update during backward frees them)"),
    ("mem/accum_bytes", "gradients summed over micro-batches"),
    ("mem/param_read_bytes", "parameter shards read from a store for gathers, at once"),
)
TRAFFIC = (
    ("comm/gather_bytes", "all-gathers (gathered bytes)"),
    ("comm/reduce_bytes", "reductions (bytes reduced)"),
    ("comm/control_bytes", "control all-reduces"),
    ("io/read_bytes", "store reads"),
    ("io/write_bytes", "store writes"),
)
FIGURES = tuple(k for k, _ in MEMORY + TRAFFIC) + ("mem/store_bytes", "mem/state_bytes", "mem/peak_bytes")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one step will hold and move on this rank (``step.plan(state, batch)``); ``print(plan)`` is a table.

    Attributes:
      figures: metric name -> bytes. ``mem/peak_bytes`` is the peak of fshard-owned memory: the state, plus the
        sum of the peaks of what the step adds (new state, gathered units, gradients and reduction buffers); the
        model's activations and the framework's own memory come on top.
      rank, world_size, micro_batches, donate, params: the setting it was made for (params: parameters in the
        model, for the DDP comparison line).
      unknown: stages whose policy says nothing of its cost (their figures count as 0).
      bounds: figures a step does not measure, name -> bytes: ``store/peak_bytes``, the most the optimizer's store
        (fs.offload_state) holds on this rank during the step (on disk for an NVMeStore; tests/test_reliability.py
        samples it); ``store/buffer_bytes``, the store's pool buffers its streams use at most (host memory);
        ``mem/activation_bytes``, the storages the last step's forward saved for backward (activations; measured
        by the step as ``metrics["mem/activation_bytes"]``; absent before the step function's first step).
    """

    figures: dict
    rank: int
    world_size: int
    micro_batches: int
    donate: bool
    params: int
    unknown: tuple = ()
    bounds: dict = dataclasses.field(default_factory=dict)
    baseline_rss: int = 0

    def __getitem__(self, key: str) -> int:
        return self.figures[key]

    @property
    def predicted_rss(self) -> int:
        """This process's peak RSS during the step, predicted: ``baseline_rss`` (its RSS when planned, less what the
        state and the store's buffers held in memory then: the interpreter, torch, the model's template), plus the
        peak of fshard-owned memory, plus the store's stream buffers, plus the activations the last step's forward
        saved for backward (``bounds["mem/activation_bytes"]``; none before a step function's first step).
        Allocator slack is not in it (benchmarks/RESULTS.md, "Parameter offload", measures how close it comes)."""
        return (self.baseline_rss + self.figures["mem/peak_bytes"] + self.bounds.get("store/buffer_bytes", 0)
                + self.bounds.get("mem/activation_bytes", 0))

    def check(self, max_memory: int) -> "Plan":
        """Raise ``MemoryBudgetError`` if ``predicted_rss`` is over ``max_memory`` bytes, naming the budget, the
        largest parts of the prediction and what would lower them; else return the plan."""
        if self.predicted_rss <= max_memory:
            return self
        f, parts = self.figures, [("process baseline", self.baseline_rss)]
        parts += [(what, f[k]) for k, what in MEMORY if f[k] and k != "mem/grad_shard_bytes"]  # (its peak counts)
        parts.append(("store buffers", self.bounds.get("store/buffer_bytes", 0)))
        top = ", ".join(f"{w} {_size(b).strip()}" for w, b in sorted(parts, key=lambda x: -x[1])[:4])
        over = self.predicted_rss - max_memory
        fixes, big = [], lambda b: b >= 0.1 * over  # a fix worth naming recovers a tenth of the excess or more
        if big(f["mem/opt_state_bytes"]):
            fixes.append(f"keep the optimizer moments ({_size(f['mem/opt_state_bytes']).strip()}) in a store: "
                         "fs.offload_state(fs.NVMeStore(dir)) in the step, and fs.init(..., offload=) the same")
        if big(f["mem/params_bytes"] + f["mem/copies_bytes"]):
            fixes.append(f"keep the parameter shards ({_size(f['mem/params_bytes'] + f['mem/copies_bytes']).strip()}"
                         ") there too: fs.offload_state(store, params=True), without param_copies")
        if big(f["mem/grad_shard_peak_bytes"]) and f["mem/grad_shard_peak_bytes"] == f["mem/grad_shard_bytes"]:
            fixes.append("free gradient shards during backward: params=True with donate=True, no bucket_reduce")
        if not self.donate and big(f["mem/new_state_bytes"]):
            fixes.append(f"compose with donate=True (the update writes {_size(f['mem/new_state_bytes']).strip()} "
                         "of new state otherwise)")
        raise MemoryBudgetError(
            f"step.plan: this step needs about {_size(self.predicted_rss).strip()} on rank {self.rank} at its peak, "
            f"over max_memory={_size(max_memory).strip()}. Largest parts: {top}. To fit: "
            + ("; or ".join(fixes) if fixes else "a smaller model or batch, or more ranks") + ". Nothing ran.")

    def __str__(self) -> str:
        f = self.figures
        lines = [f"fshard step plan: rank {self.rank} of {self.world_size}, {self.micro_batches} micro-batch(es), "
                 f"donate={self.donate}", "memory on this rank"]
        lines += [f"  {what:48s}{_size(f[k])}" for k, what in MEMORY]
        lines += [f"  {'optimizer state in a store':48s}{_size(f['mem/store_bytes'])}"]
        if "store/peak_bytes" in self.bounds:
            lines.append(f"  {'the store at its peak (disk for NVMe), at most':48s}"
                         f"{_size(self.bounds['store/peak_bytes'])}")
        lines += [f"  {'peak of fshard-owned memory':48s}{_size(f['mem/peak_bytes'])}  (+ activations)",
                  f"  {'peak RSS of this process, predicted':48s}{_size(self.predicted_rss)}",
                  "moved per step by this rank"]
        lines += [f"  {what:48s}{_size(f[k])}" for k, what in TRAFFIC]
        ddp = 16 * self.params  # fp32 param + grad + two moments, replicated
        lines.append(f"DDP with fp32 AdamW would hold {_size(ddp).strip()} of parameters, gradients and moments per "
                     f"rank; this step holds {_size(f['mem/state_bytes'] + f['mem/grad_shard_peak_bytes']).strip()}")
        if self.unknown:
            lines.append(f"(not planned: {', '.join(self.unknown)}: its policy has no plan)")
        return "\n".join(lines)


def _rss() -> int:
    """This process's resident set now (Linux; elsewhere its peak so far)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _size(b: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:9.1f} {unit}"
    return f"{b:9d} B  "


def state_figures(state) -> dict:
    """Bytes of ``state`` on this rank (``TrainState.nbytes``): parameter shards, their low-precision copies,
    optimizer tensors in memory, buffers, and optimizer state held in a store."""
    nb = state.nbytes()
    f = {"mem/params_bytes": nb["params"], "mem/copies_bytes": nb["copies"], "mem/opt_state_bytes": nb["opt_state"],
         "mem/buffers_bytes": nb["buffers"], "mem/store_bytes": nb["stored"]}
    f["mem/state_bytes"] = nb["params"] + nb["copies"] + nb["opt_state"] + nb["buffers"]
    return f


def new_state_bytes(old, new) -> int:
    """Bytes of tensors in ``new`` (params, their copies and optimizer state) that ``old`` does not hold: what the
    update allocated."""
    def tensors(s):
        leaves = optree.tree_leaves((s.params, s.copies, s.opt_state), namespace=NAMESPACE)
        return [t for t in leaves if isinstance(t, torch.Tensor)]
    have = {t.untyped_storage().data_ptr() for t in tensors(old)}
    return sum(t.nbytes for t in tensors(new) if t.untyped_storage().data_ptr() not in have)


def peak_bytes(f: dict) -> int:
    """The peak of fshard-owned memory, from the figures (planned or measured): state plus the peaks of what a
    step adds, summed (a bound: those peaks need not coincide)."""
    return f["mem/state_bytes"] + sum(f.get(k, 0) for k in (
        "mem/new_state_bytes", "mem/peak_gathered_bytes", "mem/unit_grad_bytes", "mem/reduce_buffer_bytes",
        "mem/grad_shard_peak_bytes", "mem/accum_bytes", "mem/param_read_bytes"))


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


def _dry_comm(mesh, device: str) -> Comm:
    group = "simulated" if mesh.group is not None else None
    return Comm(_PlanMesh(mesh.rank, mesh.world_size, mesh.backend, torch.device(device), group), dry=True)


def _copy(policy):
    """A copy that shares nothing the simulation changes (a wrapper's inner policy included); a policy that
    cannot be deep-copied (it holds a lock or a thread) is copied shallowly."""
    try:
        return copy.deepcopy(policy)
    except Exception:  # noqa: BLE001
        return copy.copy(policy)


class _NoUpdate(UpdatePolicy):
    """The simulated step begins no update during backward."""


def plan(step, state, batch, observed=None) -> Plan:
    """What ``step(state, batch)`` will cost on this rank (see the module docstring). Local: no collective.
    ``observed``: ``(forward, backward, active)`` of the last step this step function ran (the units forward called
    and backward read, in order, and which parameters got a gradient): the order used when the gather policy holds
    no schedule; before any step, the layout's order, reversed in backward, every parameter getting a gradient."""
    spec, mesh = state.spec, state.spec.mesh
    pol = step.policy
    sim = dataclasses.replace(pol, gather=_copy(pol.gather), reduce=_copy(pol.reduce),
                              update=_NoUpdate())  # copies: planning must not change the real policies
    comm = _dry_comm(mesh, "meta")  # units, gathers, reductions: no data
    ctrl = _dry_comm(mesh, "cpu")  # control messages: tiny real tensors, as agree() and the grads stage make them
    if mesh.world_size > 1:  # the rank check before any gather (check_ranks): five hashes
        agree(ctrl, [], [0] * CHECKED)
    k = len(pol.batches(batch))
    stored = {n: p for n, p in state.params.items() if isinstance(p, StoredParam)}  # (a gather counts, not reads)
    fake = SimpleNamespace(spec=spec, params={u.name: stored.get(u.name) or
                                              torch.empty(u.shard_numel, dtype=u.dtype, device="meta")
                                              for u in spec.units}, copies={})
    acc, scratch, runs, accum = Accumulator(k), {}, [], 0
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
    _copy(pol.grads)(CollectivesView(ctrl), Grads(ones, spec=spec, active=got, transform_state=state.transform_state))
    f = {"mem/peak_gathered_bytes": max(r._peak_bytes for r in runs),
         "mem/unit_grad_bytes": max(r._unit_grad_bytes for r in runs),
         "mem/reduce_buffer_bytes": comm.reduce_buffer_bytes,
         "mem/grad_shard_bytes": sum(g.nbytes for g in shards.values()), "mem/accum_bytes": accum,
         "mem/grad_shard_peak_bytes": sum(g.nbytes for g in shards.values()),  # (the update's plan may lower it)
         "mem/param_read_bytes": max(r._read_peak for r in runs),
         "comm/gather_bytes": comm.bytes.get("all_gather", 0),
         "comm/reduce_bytes": comm.bytes.get("reduce_scatter", 0) + comm.bytes.get("reduce", 0),
         "comm/control_bytes": ctrl.bytes.get("control", 0), "io/write_bytes": 0,
         "io/read_bytes": sum(r._loaded_bytes for r in runs),  # parameter shards a gather reads from a store
         "mem/new_state_bytes": 0, **state_figures(state)}
    unknown = ()
    active = {name: list(u._got) for name, u in run.units.items()}
    update = pol.update.plan(run, state, active, step.donate)  # while the simulated units still hold their grads
    for r in runs:
        r._close()
    if update is None:
        unknown = ("update",)
    else:
        f.update({k: f.get(k, 0) + v if k.startswith("io/") else v for k, v in update.items()})
    bounds = {k: f.pop(k) for k in ("store/peak_bytes", "store/buffer_bytes", "store/pool_bytes") if k in f}
    f["mem/peak_bytes"] = peak_bytes(f)
    params = sum(s.numel for u in spec.units for s in u.slots)
    held = f["mem/state_bytes"] + bounds.pop("store/pool_bytes", 0)  # in the process's RSS now, and in the plan
    if observed is not None and len(observed) > 3:  # what the last step's forward saved for backward
        bounds["mem/activation_bytes"] = observed[3]
    return Plan(f, mesh.rank, mesh.world_size, k, step.donate, params, unknown, bounds,
                max(0, _rss() - held))


def _simulate(pol, run: StepRun, observed) -> None:
    """One micro-batch's gather and reduce events, in the order a step makes them: the root bound around the
    whole forward, each unit called in the schedule's order; in backward each unit read, its use finished, its
    gradient handed to the reduce policy (the root's at the end), then the reduce policy's finish."""
    gather, units = pol.gather, run.units
    schedule = gather.schedule
    if schedule is not None:
        forward, backward = [n for n in schedule.forward if n != ROOT], list(schedule.backward)
    elif observed is not None:
        forward, backward = list(observed[0]), list(observed[1])
    else:
        forward = [n for n in units if n != ROOT]
        backward = ([ROOT] if ROOT in units else []) + forward[::-1]
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
        run._grad_arrived(unit, torch.empty(unit.layout.numel, dtype=run._param_dtype or unit.layout.dtype,
                                            device="meta"))
