"""Transforms, the blocking policies a step uses when no transform changes a stage, and ``fold``.

A transform is a small named value: its fields are its repr and its cross-rank fingerprint, and it is frozen once
made (``Transform``). For each stage it returns the policy it was given, or a policy of its own; it declares which
stages it changes and how (``Transform.stages``):

- ``"set"``: its policy takes the stage over (it may still call the policy it was given, as offload_state does
  for the units it leaves in memory). A stage is set by at most one transform.
- ``"wrap"``: its policy calls the one it was given and changes its result. Wrappers compose, in the order given.

The grads stage is not wrapped: it is a chain, a tuple of links (``GradsPolicy``) the step runs in order,
``for link in policy.grads: grads = link(comm, grads)``. A transform adds at most one link
(``Transform.grads_link``); no link holds another, and ``Policy.close`` closes each.

``fs.compose`` folds the transforms over the blocking policies, left to right (``fold``). Two transforms that set
the same stage, or one that sets a stage another already wraps, are a ``TransformConflictError``: the later one
would silently replace the earlier.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._fields import FROZEN, describe, fields
from ._stages import BatchesPolicy, Collectives, GatherPolicy, Grads, GradsPolicy, ReducePolicy, UpdatePolicy
from ..errors import ArgumentTypeError, FrozenStateError, TransformConflictError

if TYPE_CHECKING:
    from ..state._train_state import ShardSpec, TrainState

STAGES = ("gather", "reduce", "update", "batches")  # the wrapped stages; grads is a chain of links
PROTOCOLS = {"gather": GatherPolicy, "reduce": ReducePolicy, "update": UpdatePolicy, "batches": BatchesPolicy}


class _TransformType(type):
    """``Transform``'s metaclass: an instance is frozen once its class's ``__init__`` has returned."""

    def __call__(cls, *args, **kwargs):
        t = super().__call__(*args, **kwargs)
        object.__setattr__(t, FROZEN, True)
        return t


class Transform(metaclass=_TransformType):
    """Base class: every stage unchanged.

    A transform is a value: its fields (what ``__init__`` set on it; a dataclass's fields) are its repr and its
    cross-rank fingerprint, and it is frozen once made, so two ranks that compose it with different arguments
    fail the step's rank check (``RankDivergenceError``) whatever its author wrote. ``rank_local`` names the fields
    that may differ between ranks (a rank's own directory), left out of the fingerprint.

    A subclass changes a stage in one of two ways:

    - ``grads(self, comm, grads) -> grads``, a method: its link of the grads chain, run after the links of the
      transforms before it. ``changes_grads`` and ``reads_grads`` (class attributes) say what it does to the
      shards (``fs.protocol.GradsPolicy``). A link with state of its own, or one that scales the loss, is a
      ``GradsPolicy`` returned by ``grads_link(self)`` instead (fs.mixed_precision's fp16 loss scale).
    - ``wrap_<stage>(policy) -> policy``, for gather, reduce, update and batches, declared in ``stages`` (stage ->
      "set" or "wrap"): a policy following the stage's protocol (fshard/protocol/_stages.py), which may call the
      one it was given.

    ``name`` (default: the class's name) keys its entry in ``TrainState.transform_state`` and names it in
    messages."""

    name = "transform"
    stages: Mapping[str, str] = {}
    rank_local: tuple[str, ...] = ()
    changes_grads: bool = True  # (of a grads link: what each means is fs.protocol.GradsPolicy's)
    reads_grads: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__
        if "wrap_grads" in cls.__dict__ or "grads" in cls.stages:
            raise ArgumentTypeError(
                f"{cls.__qualname__} wraps the grads stage, which is a chain of links that hold no other: define "
                "grads(self, comm, grads) -> grads, or grads_link(self) returning a fs.protocol.GradsPolicy (for a "
                "link with state), and no wrap_grads or stages['grads'].")
        if cls.grads is not Transform.grads and cls.grads_link is not Transform.grads_link:
            raise ArgumentTypeError(
                f"{cls.__qualname__} defines both grads (its link of the grads chain) and grads_link (a link made "
                "otherwise); define one of them.")

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get(FROZEN):
            raise FrozenStateError(
                f"{self!r} is frozen: its fields are its fingerprint, which ranks compare when a step composed with "
                f"it runs. Make another one with the {name} you want.")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get(FROZEN):
            raise FrozenStateError(f"{self!r} is frozen; make another one without {name}.")
        object.__delattr__(self, name)

    def grads(self, comm: Collectives, grads: Grads) -> Grads:
        """A link of the grads chain (see the class docstring): the default, unchanged, adds no link."""
        return grads

    def wrap_gather(self, gather: GatherPolicy) -> GatherPolicy:
        return gather

    def wrap_reduce(self, reduce: ReducePolicy) -> ReducePolicy:
        return reduce

    def grads_link(self) -> GradsPolicy | None:
        """This transform's link of the grads chain (None: it adds none). The default is its ``grads`` method, if
        its class defines one; a transform returns a ``GradsPolicy`` of its own for a link with state, or one that
        scales the loss."""
        return None if type(self).grads is Transform.grads else _MethodLink(self)

    def wrap_update(self, update: UpdatePolicy) -> UpdatePolicy:
        return update

    def wrap_batches(self, batches: BatchesPolicy) -> BatchesPolicy:
        return batches

    def init_state(self, spec: ShardSpec, old: Any) -> Any:
        """This transform's entry in ``TrainState.transform_state`` (under its ``name``) for a step on a state of
        ``spec``, given the entry the state holds (``old``; None if none): the initial state, or ``old`` carried
        on (return it itself when nothing changes). None (the default): the transform keeps no state. A step
        calls it for each of its transforms before it runs (``Step.init``)."""
        return None

    def fingerprint(self) -> str:
        """What every rank must compose alike (the step's rank check compares the chain's): the class and every
        field but ``rank_local``, each written alike in every process (fshard/protocol/_fields.py). Not the repr,
        which a class may shorten for people."""
        t = type(self)
        kept = ", ".join(f"{k}={describe(v)}" for k, v in fields(self).items() if k not in self.rank_local)
        return f"{t.__module__}.{t.__qualname__}({kept})"

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={describe(v)}" for k, v in fields(self).items() if not k.startswith("_"))
        return f"{'fs.' if type(self).__module__.startswith('fshard.') else ''}{self.name}({shown})"


class _MethodLink(GradsPolicy):
    """A transform's ``grads`` method as a link of the grads chain, with what its class declares."""

    def __init__(self, transform: Transform):
        self.transform = transform
        self.changes_grads, self.reads_grads = transform.changes_grads, transform.reads_grads

    def __call__(self, comm, grads: Grads) -> Grads:
        return self.transform.grads(comm, grads)

    def __repr__(self) -> str:
        return f"{self.transform!r}.grads"


class BlockingGather(GatherPolicy):
    """Gather a unit right before it computes and free it right after, in forward and in backward (the protocol's
    defaults)."""


class BlockingReduce(ReducePolicy):
    """Reduce-scatter each unit's flat gradient as soon as backward has produced it, and wait for it.

    Gradients are scaled by 1/world_size before a SUM reduce-scatter, in the order DDP uses, so the average
    matches DDP's bit for bit wherever the summation order allows it. On a 2-D mesh the reduce-scatter sums over the
    shard group and an all-reduce of the shard over the replica group follows (``Comm.replicate``): the sum over
    every rank of gradient / world_size, as DDP's."""

    def reduce(self, step, unit, grad: torch.Tensor) -> None:
        mesh = step.comm.mesh
        full = grad.contiguous()  # the unit's gradient is the step's own (autograd made it for this unit alone):
        if mesh.world_size > 1:   # scaled in place, not into a second unit-sized buffer
            full.mul_(1.0 / mesh.world_size)
        if mesh.shard_size > 1:
            out = torch.empty(unit.layout.shard_numel, dtype=full.dtype, device=full.device)
        else:  # one rank: the shard is the whole unit, and its reduced gradient the gradient itself (no copy)
            out = full
        step.comm.reduce_scatter(out, full, unit.name).wait()
        if mesh.replicas > 1:
            step.comm.replicate(out, unit.name).wait()
        step.grad_ready(unit, out if out.dtype == unit.layout.dtype else out.to(unit.layout.dtype))


def run_pipeline(n: int, advance) -> None:
    """Run the phased updates of ``n`` units as ``DeviceUpdate`` does: each time a unit starts, every unit still
    paused, the new one included, runs its next phase, the newest first; after the last unit, the same until none is
    left. ``advance(i)`` runs unit i's next phase and returns whether it is still paused."""
    pending: list[int] = []  # oldest first
    for i in range(n):
        pending.append(i)
        pending = [j for j in reversed(pending) if advance(j)][::-1]
    while pending:
        pending = [j for j in reversed(pending) if advance(j)][::-1]


def pipeline(phases: list[int]) -> list[tuple[int, int]]:
    """``(unit, phase)`` in the order ``run_pipeline`` runs them, unit i having ``phases[i]`` phases (its pauses plus
    one): the order in which ``DeviceUpdate`` promises the update's exchanges."""
    order, at = [], [0] * len(phases)

    def advance(i: int) -> bool:
        order.append((i, at[i]))
        at[i] += 1
        return at[i] < phases[i]
    run_pipeline(len(phases), advance)
    return order


class DeviceUpdate(UpdatePolicy):
    """Run the optimizer on the shards where they live, one unit at a time (and the parameter copies, if the state holds
    them, in the same pass); an optimizer with ``update_all`` (the elementwise ones) takes every unit in one call, which
    plans them all before the first pass. An optimizer with ``update_phases`` (``fs.muon``: fshard/optim/_protocol.py)
    is pipelined across units: each time a unit's update starts, every unit still paused moves on by one phase, the
    newest first. Muon's three phases (pieces out; Newton-Schulz and results back; the step) of unit i thus run beside
    unit i + 1's and i + 2's, so its exchanges travel during other units' Newton-Schulz, and a rank that orthogonalises
    more of unit i than another catches up on unit i + 1 before it waits (every rank in the same order, so the
    collectives pair). The exchanges are checked across ranks once, up front (``Collectives.promise``, from the
    optimizer's ``exchange_plan``), not one by one: a check before each would bring the ranks together at each, and the
    pipeline's catching up with them."""

    def __call__(self, step, state, grads: Grads, active, donate):
        rank, params, opt_state = step.spec.mesh.shard_rank, dict(state.params), dict(state.opt_state)
        copies, opt = dict(state.copies), step.spec.optimizer
        todo = [u for u in step.spec.units if u.name in opt_state and any(active[u.name])]
        for u in todo:
            if not all(isinstance(r, torch.Tensor) for r in opt_state[u.name].rows) or not isinstance(
                    params[u.name], torch.Tensor):
                raise ArgumentTypeError(
                    f"unit {u.name!r} has its optimizer state or its parameters in a store (fs.offload_state); "
                    "compose this step with the same fs.offload_state(store, ...) to update it.")

        def keep(name, result):
            params[name], opt_state[name], copy = result
            if copy is not None:
                copies[name] = copy

        def call(method, u):  # (a collective optimizer gets the step's collectives)
            return method(u, rank, state.params[u.name], grads.shards[u.name], state.opt_state[u.name],
                          active[u.name], donate, grad_scale=grads.scale, updates=int(state.step),
                          copy=copies.get(u.name), **({"comm": step.comm} if getattr(opt, "collective", False) else {}))

        many = getattr(opt, "update_all", None)  # every unit's plan, then their passes back to back (Elementwise)
        if many is not None and not getattr(opt, "collective", False):
            done = many(rank, [(u, state.params[u.name], grads.shards[u.name], state.opt_state[u.name],
                                active[u.name], copies.get(u.name)) for u in todo],
                        donate, grad_scale=grads.scale, updates=int(state.step))
            for u, result in zip(todo, done, strict=True):
                keep(u.name, result)
            return params, opt_state, {}, copies
        if not hasattr(opt, "update_phases"):
            for u in todo:
                keep(u.name, call(opt.update, u))
            return params, opt_state, {}, copies
        plan = getattr(opt, "exchange_plan", None)  # (one check for the update's exchanges, not one each)
        if plan is not None and getattr(opt, "collective", False):
            phases = [plan(u, rank, active[u.name], step.spec.mesh.shard_size) for u in todo]
            if all(p is not None for p in phases):
                step.comm.promise([e for i, k in pipeline([len(p) for p in phases]) for e in phases[i][k]])
        gens = [call(opt.update_phases, u) for u in todo]  # (generators: nothing runs until advanced)

        def advance(i: int) -> bool:
            try:
                next(gens[i])
                return True
            except StopIteration as stop:
                keep(todo[i].name, stop.value)
                return False
        run_pipeline(len(todo), advance)
        return params, opt_state, {}, copies

    def plan(self, step, state, active, donate):
        """Each unit it updates (a parameter active) gets a new step-count tensor; without ``donate`` also a new
        parameter shard, new optimizer rows and a new parameter copy (the update writes into copies)."""
        def renewed(name, s):
            copy = state.copies.get(name)
            return state.params[name].nbytes + sum(r.nbytes for r in s.rows) + (0 if copy is None else copy.nbytes)
        sent = getattr(state.spec.optimizer, "exchange_bytes", None)  # (a collective update's own traffic: fs.muon)
        return {"mem/new_state_bytes": sum(s.count.nbytes + (0 if donate else renewed(name, s))
                                           for name, s in state.opt_state.items()
                                           if s is not None and any(active.get(name, ()))),
                "comm/update_bytes": 0 if sent is None else sum(
                    sent(u, state.spec.mesh.shard_rank, active[u.name], state.spec.mesh.shard_size)
                    for u in state.spec.units if state.opt_state.get(u.name) is not None
                    and any(active.get(u.name, ())))}


class OneBatch(BatchesPolicy):
    """The batch is one micro-batch (``fs.accumulate(k)`` makes it a list of k)."""


@dataclass(frozen=True)
class Policy:
    """A composed step's policies, and what ``fold`` derived from the grads chain's declarations: ``grads`` is the
    chain (empty: the reduced shards go to the update as they are); ``grads_unchanged`` is True when every link
    declares ``changes_grads = False`` (and none scales the loss), ``grads_unread`` when moreover none declares
    ``reads_grads``; ``loss_scaler`` is the one link that declares ``scales_loss`` (None: the loss is not
    scaled)."""

    gather: GatherPolicy
    reduce: ReducePolicy
    grads: tuple[GradsPolicy, ...]
    update: UpdatePolicy
    batches: BatchesPolicy
    grads_unchanged: bool
    loss_scaler: GradsPolicy | None = None
    grads_unread: bool = True

    def loss_scale(self, state: TrainState) -> float:
        """The factor backward multiplies the loss by in a step on ``state`` (1.0 without a loss scaler)."""
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.loss_scale(state))

    def close(self) -> None:
        for stage in STAGES:
            getattr(self, stage).close()
        for link in self.grads:
            link.close()


def fold(transforms) -> Policy:
    """The step's policies: the blocking ones, changed by each transform in turn (see the module docstring)."""
    policies = {"gather": BlockingGather(), "reduce": BlockingReduce(), "update": DeviceUpdate(),
                "batches": OneBatch()}
    changed: dict[str, list[tuple[Transform, str]]] = {s: [] for s in STAGES}  # stage -> [(transform, how)]
    links: list[GradsPolicy] = []
    unchanged, unread, scaler = True, True, None
    for t in transforms:
        if not isinstance(t, Transform):
            raise ArgumentTypeError(f"fs.compose: {t!r} is not an fshard transform (fs.gather_ahead(...), ...). Pass "
                                    "transforms after loss_fn: fs.compose(loss_fn, transform, ...).")
        wrap = {"gather": t.wrap_gather, "reduce": t.wrap_reduce, "update": t.wrap_update, "batches": t.wrap_batches}
        for stage in STAGES:
            given = policies[stage]
            new = wrap[stage](given)
            if new is given:
                continue
            how = t.stages.get(stage)
            if how not in ("set", "wrap"):
                raise ArgumentTypeError(f"{t!r} changes the {stage} stage but does not declare how: add "
                                        f"stages = {{{stage!r}: 'set' or 'wrap'}} to its class.")
            if PROTOCOLS[stage] not in type(new).__mro__:  # the step calls every declared hook: defaults needed
                raise ArgumentTypeError(
                    f"{t!r} gave the {stage} stage {new!r}, which is not a {PROTOCOLS[stage].__name__}: subclass "
                    f"fs.protocol.{PROTOCOLS[stage].__name__}, which declares every hook of the stage with its "
                    "default.")
            _check_conflict(t, stage, how, changed[stage])
            changed[stage].append((t, how))
            policies[stage] = new
        link = t.grads_link()
        if link is None:
            continue
        if GradsPolicy not in type(link).__mro__:  # the step calls every declared hook: defaults needed
            raise ArgumentTypeError(
                f"{t!r}.grads_link() gave {link!r}, which is not a GradsPolicy: subclass fs.protocol.GradsPolicy, "
                "which declares every hook of a grads link with its default (or define grads(self, comm, grads)).")
        # what the step needs of the chain, from each link's declarations (read here only, never by another link)
        unchanged = unchanged and not link.changes_grads and not link.scales_loss  # scaled shards change
        unread = unread and not link.reads_grads
        if link.scales_loss and scaler is not None:
            raise TransformConflictError(
                f"fs.compose: {scaler[0]!r} and {t!r} both scale the loss (fp16 loss scaling), and a step "
                "scales it once; pass one of them.")
        scaler = (t, link) if link.scales_loss else scaler
        links.append(link)
    return Policy(**policies, grads=tuple(links), grads_unchanged=unchanged, loss_scaler=scaler and scaler[1],
                  grads_unread=unchanged and unread)


def _check_conflict(t: Transform, stage: str, how: str, before: list[tuple[Transform, str]]) -> None:
    setter = next((b for b, h in before if h == "set"), None)
    if how == "set" and setter is not None:
        raise TransformConflictError(
            f"fs.compose: {setter!r} and {t!r} both set the {stage} stage, and a step has one {stage} policy: the "
            f"later would silently replace the earlier. Pass only one of them, e.g. fs.compose(loss_fn, ..., {t!r}).")
    if how == "set" and before:
        wrapper = before[-1][0]
        raise TransformConflictError(
            f"fs.compose: {t!r} sets the {stage} stage, which {wrapper!r} (passed before it) wraps: setting it "
            f"afterwards would drop {wrapper!r}. Pass {t!r} before {wrapper!r}.")
