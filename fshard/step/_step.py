"""fs.compose: build ``step(state, batch) -> (new_state, metrics)`` from a loss function and transforms.

The data flow of one step, as the code below reads:

    check   ranks agree on the step, model, optimizer, transforms and batch structure   (one tiny all-reduce)
    forward gather each unit, bind it, compute, free it                     (policy.gather)
    backward re-gather units autograd needs; reduce each unit's gradient     (policy.gather, policy.reduce)
    agree   mean loss, which parameters got a gradient, same collectives     (one tiny all-reduce)
    grads   transform the gradient shards, link after link                   (policy.grads)
    update  optimizer on the shards -> new TrainState                        (policy.update)
    commit  did any rank fail? every rank returns, or every rank raises     (one tiny all-reduce)

``Step.__call__`` reads as that flow, inside the envelope it shares with ``step.eval`` (fshard/step/_envelope.py: what
keeps ranks together, fshard/dist/_agreement.py): a rank that raises tells the others at their next check, and the
step ends with a commit vote.
"""
from __future__ import annotations

import threading
import time
import weakref

import torch

from .._frames import dynamo_import_collected
from ..transforms._accumulate import Accumulator
from ..protocol._stages import Grads
from ..dist._agreement import agree, check_ranks, small_hash
from ..dist._collectives import Comm
from ..dist._replay import Sequences, checksum
from ._envelope import envelope
from ._eval import evaluate, train_mode
from ._guards import (check_empty, check_loss, check_template, check_usable, checked_update, meta_reads,
                      spec_of)
from ..errors import ArgumentTypeError, LossError, RankDivergenceError, TransformConflictError
from ..state._flat import ROOT
from ._plan import Plan, new_state_bytes, peak_bytes, state_figures
from ._dry_run import plan
from ..run._dispatch import UnitCompiler, bound_at
from ..state._train_state import TrainState
from ..state._stored import in_store
from ..protocol._transform import fold
from ..run._run import StepRun


class Step:
    """A composed step. Call it as ``new_state, metrics = step(state, batch)``.

    The input state is never modified unless ``donate=True``: then the update runs in place on its tensors
    (no copies, less memory traffic) and the donated state refuses further use (``state.donation``).

    A step function may hold threads (``fs.offload_state``'s worker, the reader of parameter shards in a store):
    ``step.close()``, or ``with fs.compose(...) as step:``, ends them; a closed step refuses further calls. A step
    function dropped without ``close()`` ends them when it is collected (``weakref.finalize``), or at exit.
    """

    def __init__(self, loss_fn, transforms=(), *, donate: bool = False, trace: bool = False, mesh=None,
                 timeline: bool = False, check_collectives: bool | None = None, compile: bool | dict = False):
        if not callable(loss_fn):
            raise ArgumentTypeError(f"fs.compose: loss_fn must be callable as loss_fn(module, batch), got "
                                    f"{loss_fn!r}.")
        self.loss_fn, self.transforms = loss_fn, tuple(transforms)
        self.donate, self.trace, self.mesh, self.timeline = donate, trace, mesh, bool(timeline)
        self.check_collectives = None if check_collectives is None else bool(check_collectives)
        self._checked = False  # a step has completed (until then every collective is checked first)
        self._busy = threading.Lock()  # held while a step or eval pass runs (_exclusive)
        self.policy = fold(self.transforms)
        self._fingerprints = tuple(t.fingerprint() for t in self.transforms)  # each transform's fields
        self._chain = small_hash(list(self._fingerprints))  # ranks compare it (check_ranks)
        self._streams: dict = {}
        self._closed = False
        self._observed = None  # (forward order, backward order, active) of the last step past its agreement
        self._sequences = Sequences()  # the collectives of the steps before: followed unchecked once stable
        self._compiled = None if compile is False else UnitCompiler(compile)
        self._held: tuple = ()  # the last step's gradient shards, until the next call's envelope (_envelope.py)
        # A step function dropped without close() ends its threads as it dies (or at exit, if it lives that long):
        # the finalizer holds what it closes, never the step.
        self._finalizer = weakref.finalize(self, _close, self.policy)

    def _gather_stream(self, device: torch.device):
        """CUDA: one side stream per device for this step function's gathers, so they overlap compute."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def plan(self, state: TrainState, batch, max_memory: int | None = None) -> Plan:
        """What ``step(state, batch)`` will hold and move on this rank, before it runs: an ``fs.Plan`` (``print``
        it). No collective and no compute: the step's policies run on a simulated step (fshard/step/_dry_run.py) of
        ``step.init(state)`` (which casts the parameter copies a state lacks, with ``param_copies``); after the
        step, its metrics carry the same figures, measured. ``max_memory`` (bytes): raise ``MemoryBudgetError``,
        which names the budget and what to offload, if ``plan.predicted_rss`` (this process's peak) is over it."""
        spec_of(state)  # the checks of a step's call
        check_usable(self, state)
        self._held = ()  # (as the step it plans for does first: the RSS it starts from has no gradients)
        with dynamo_import_collected():  # (its forward on the meta device: dropout, layer norm; fshard/_frames.py)
            return plan(self, self.init(state), batch, self._observed).check(max_memory)

    def init(self, state: TrainState) -> TrainState:
        """``state`` with each transform's state in ``transform_state`` (``Transform.init_state``): the initial one
        where the state holds none (a state from ``fs.init``), else the state's own, carried on; and with the
        parameter copies the gather policy asks for (``GatherPolicy.param_copies``: each unit's shard cast once to
        ``param_dtype``, into ``state.copies``; dropped when it asks for none). A step does this itself; call it to
        checkpoint or print a state as its first step will see it. Returns ``state`` itself when nothing changes."""
        entries, owners, changed = dict(state.transform_state), {}, False
        for t in self.transforms:
            old = entries.get(t.name)
            new = t.init_state(state.spec, old)
            if new is None:
                continue
            if t.name in owners:
                raise TransformConflictError(f"fs.compose: {owners[t.name]!r} and {t!r} both keep state under "
                                             f"{t.name!r} in state.transform_state; pass one of them.")
            owners[t.name] = t
            if new is not old:
                entries[t.name], changed = new, True
        copies = _copies(state, self.policy.gather)
        if copies is not state.copies:
            changed = True
        return state.replace(transform_state=entries, copies=copies) if changed else state

    @property
    def gather_order(self):
        """The order this step's gather policy follows (an ``fs.GatherOrder`` with gather_ahead, once a step has
        recorded it), or None."""
        return self.policy.gather.gather_order

    def close(self) -> None:
        """End every policy's threads and resources; idempotent. Stores stay open: the caller's ``store.close()``."""
        self._closed, self._held = True, ()
        self._finalizer()  # (once: a second call does nothing)

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"fs.compose({getattr(self.loss_fn, '__name__', self.loss_fn)}, {', '.join(map(repr, self.transforms))})"

    def __call__(self, state: TrainState, batch):
        """One step: the module docstring's data flow, in the envelope a step and an eval pass share
        (fshard/step/_envelope.py: the checks, the failure posted to the other ranks, the runs closed)."""
        with envelope(self, state, "step {}", train=True) as env:
            comm, runs, spec = env.comm, env.runs, state.spec
            state = self.init(state)  # the transforms' state and the parameter copies
            self._check_ranks(comm, state, batch)  # first: a bad batch fails every rank
            micro = self.policy.batches(batch)
            acc, scratch, losses, accum = Accumulator(len(micro)), {}, [], 0
            buffers = state.buffers if self.donate else {k: b.clone() for k, b in state.buffers.items()}
            loss_scale = self.policy.loss_scale(state)  # fp16: backward runs on loss * loss_scale
            t1 = time.perf_counter()
            with train_mode(spec.template, True):  # chosen per call: step.eval runs module.eval()
                for i, mb in enumerate(micro):  # gather, forward, backward (which reduces each unit's gradient)
                    runs.append(StepRun(state, comm, self.policy, acc, scratch, last=i == len(micro) - 1,
                                        donate=self.donate, compiled=self._compiled, pool=env.pool))
                    mb_loss, gather_metrics = self._forward_backward(runs[-1], buffers, mb, len(micro), loss_scale)
                    losses.append(mb_loss)
                    accum = max(accum, sum(g.nbytes for g in acc.grads.values()))  # summed over micro-batches
            loss = sum(x / len(losses) for x in torch.stack(losses).tolist())  # one device sync for all of them
            t2 = time.perf_counter()
            issued, run = comm.end_sequence(), runs[-1]  # (what follows is checked: the agreement, the update)
            loss, active = self._agree(comm, run, acc, loss)
            acts = max(sum(r._activations.values()) for r in runs)  # what forward saved for backward, at most
            self._observed = (tuple(run.order), tuple(run._backward_order), active, acts)  # what step.plan assumes
            grads = Grads(run._grad_shards(), scale=1.0 / loss_scale, loss_scale=loss_scale, spec=spec, active=active,
                          transform_state=state.transform_state)
            for link in self.policy.grads:  # the grads chain, in composition order
                grads = link(run.comm, grads)
            t3 = time.perf_counter()
            new, update_metrics = self._update(run, state, grads, active, buffers)
            t4 = time.perf_counter()
            comm.span("update", "skipped" if grads.skip else "update", t3, t4)
            m = self._metrics(env, loss, new, {**gather_metrics, **grads.metrics, **update_metrics}, t1, t2, t3, t4)
            loaded = sum(r._loaded_bytes for r in runs)  # parameter shards gathers read from a store
            m.update(_measured(comm, runs, state, new, accum, grads.skip), **{
                "mem/activation_bytes": acts, "io/read_bytes": m.get("io/read_bytes", 0) + loaded,
                "io/param_read_bytes": loaded, "io/write_bytes": m.get("io/write_bytes", 0)})  # 0 without a store
            comm.vote("commit")  # every rank returns its new state, or every rank raises: none commits alone
            self._checked = True
            self._sequences.observed(spec.fingerprint, *issued)
            self._held = tuple(grads.shards.values())
            return new, m

    def _check_ranks(self, comm: Comm, state: TrainState, batch) -> None:
        """The rank check, which also compares the collectives of the steps before: where every rank holds the
        same, this step follows them unchecked up to the agreement after backward (fshard/dist/_replay.py)."""
        seq = self._sequences.to_follow(state.spec.fingerprint) if comm.verify else None
        comm.follow(seq if check_ranks(comm, state, batch, self._chain, self._fingerprints, checksum(seq)) else None)

    def _update(self, run: StepRun, state: TrainState, grads: Grads, active, buffers):
        """The new state and the update's metrics: the optimizer on the shards, or the input with the skip counted
        (``grads.skip``; the buffers forward updated are kept, as torch keeps them)."""
        run._comm.vote_next = True  # the update issues no collective: a failure from here on is posted at the vote
        if grads.skip:
            return state.replace(skipped=state.skipped + 1, transform_state=grads.transform_state,
                                 buffers=buffers), {}
        if self.donate:
            state.donation.take(int(state.step))  # from here on the input's tensors change in place
        params, opt_state, metrics, copies = checked_update(
            self.policy.update, self.policy.update(run, state, grads, active, self.donate), state)
        return TrainState(params, opt_state, state.step + 1, buffers, state.spec, skipped=state.skipped,
                          transform_state=grads.transform_state, copies=copies), metrics

    def eval(self, state: TrainState, batch) -> tuple[float, dict]:
        """Forward only: ``loss_fn(module, batch)`` with the units gathered as this step gathers them (prefetch
        included), in eval mode (``module.eval()``: dropout off), under ``torch.no_grad``. No gradient, no
        reduction, no new state: the input state is unchanged. Returns ``(loss, metrics)``, the loss averaged
        over ranks as a step's ``metrics["loss"]`` (fshard/step/_eval.py)."""
        with envelope(self, state, "eval at step {}", train=False) as env:
            return evaluate(self, env, state, batch)

    def _verify(self, mesh) -> bool:
        """Check every collective across ranks before it is issued (fshard/dist/_agreement.py)? ``check_collectives``
        if given (True: always, False: never); by default always on a CPU mesh, and until a step has completed on
        others (the check's all-gather reads its result on the host: on CUDA a device sync per collective)."""
        if self.check_collectives is not None:
            return self.check_collectives
        return mesh.device.type == "cpu" or not self._checked

    def _forward_backward(self, run: StepRun, buffers, batch, k: int, loss_scale: float):
        with run._active():
            tf = time.perf_counter()
            self.policy.gather.start(run)
            loss = self._forward(run, buffers, batch)
            tb = time.perf_counter()
            run.phase = "backward"
            leaves = [u.shard for u in run.units.values() if u._flat is not None and u.trainable]
            if leaves and not loss.requires_grad:
                raise LossError(
                    "loss_fn returned a loss with no path to any trainable parameter (loss.requires_grad is False), "
                    "so the step would train nothing: it ran under torch.no_grad(), or detached the loss (.item(), "
                    ".detach()), or computed it from the batch alone. Return the differentiable loss; to evaluate, "
                    "use step.eval(state, batch). Nothing was updated.")
            if loss.requires_grad and leaves:
                # gradients land in the units (reduce policy); k micro-batches: the average, as loss / k would
                out = loss if k == 1 else loss / k
                if loss_scale != 1.0:  # as torch.amp.GradScaler.scale: times a 1-element fp32 tensor
                    out = out * torch.full((1,), loss_scale, dtype=torch.float32, device=loss.device)
                _backward(run, buffers, out)
            run._end_backward()
            gather_metrics = self.policy.gather.finish(run)
        if run._comm.spans is not None:
            run._comm.span("compute", "forward", tf, tb)
            run._comm.span("compute", "backward", tb, time.perf_counter())
        run._release_all()
        return loss.detach(), gather_metrics

    def _forward(self, run: StepRun, buffers, batch) -> torch.Tensor:
        """loss_fn(template, batch), with the root unit and the buffers bound for the whole call (the gather policy
        the run was made with: step.plan's meta forward runs a copy)."""
        spec, root, gather = run.spec, run.units.get(ROOT), run._policy.gather
        binding = _buffer_names(spec, buffers)
        if root is not None:
            gather.before_forward(run, root)
            binding.update(root._bind([s.aliases for s in root.layout.slots]))
        with meta_reads(
                "a parameter was used while its unit was not gathered (outside a step, the template's tensors are "
                "on the meta device). fshard binds a unit's parameters only while the unit module itself is called: "
                "code that reaches into a unit (model.blocks[0].attn(x), model.blocks[0].weight) instead of calling "
                "it sees no data. Call the unit module, or choose units with fs.init(..., units=[...]) so that each "
                "parameter is used inside a call of its unit."):
            with bound_at(spec.owners, binding):
                loss = self.loss_fn(spec.template, batch)
        if root is not None:
            gather.after_forward(run, root)
        check_loss(loss)
        check_empty(loss, batch, run.spec.mesh.rank)
        check_template(run.spec)
        return loss

    def _agree(self, comm: Comm, run: StepRun, acc: Accumulator, loss: float):
        """Sum the loss and the got-a-gradient marks over ranks, and check every rank issued the same collectives."""
        got = [float(g) for name, u in run.units.items() for g in acc.got.get(name, u._got)]
        sums, (same_seq,) = agree(comm, [loss] + got, [comm.seq_hash])
        if not same_seq:
            raise comm.unanimous(RankDivergenceError(
                "ranks issued different collectives in this step (different units, order or sizes), so gathered "
                "parameters or reduced gradients may be mixed up. The state was not updated. Every rank must run "
                "the same units in the same order in forward and backward; make control flow independent of the "
                f"rank's data. This rank ran units in the order {run.order}."))
        active, i = {}, 1
        for name, u in run.units.items():
            active[name] = [s > 0 for s in sums[i:i + len(u._got)]]
            i += len(u._got)
            if any(active[name]) and u.grad is None:
                raise RankDivergenceError(f"unit {name!r} got a gradient on another rank but not on this one, so it "
                                          "was never reduced here; make the forward the same on every rank.")
        return sums[0] / comm.mesh.world_size, active

    def _metrics(self, env, loss, new, grad_metrics, t1, t2, t3, t4) -> dict:
        comm, runs, t0 = env.comm, env.runs, env.t0
        g = env.gather_figures()
        gather, exposed = g["time/gather"], g["time/gather_exposed"]
        reduce, r_exposed = comm.busy_seconds("reduce"), comm.seconds.get("reduce_exposed", 0.0)
        rep_exposed = comm.seconds.get("replica_exposed", 0.0)  # (2-D meshes: the replica all-reduces)
        m = {"loss": loss, "step": int(new.step), "skipped_total": int(new.skipped),
             "time/step": t4 - t0, "time/check": t1 - t0, "time/gather": gather, "time/gather_exposed": exposed,
             "gather/overlap": 0.0 if gather <= 0 else max(0.0, 1.0 - exposed / gather),
             "time/reduce": reduce, "time/reduce_exposed": r_exposed,
             "reduce/overlap": 0.0 if reduce <= 0 else max(0.0, 1.0 - r_exposed / reduce),
             "time/compute": max(0.0, t2 - t1 - exposed - r_exposed - rep_exposed), "time/update": t4 - t3,
             "time/control": comm.seconds.get("control", 0.0),
             "mem/peak_gathered_bytes": g["mem/peak_gathered_bytes"],
             "mem/peak_gathered_bytes_forward": max(r._phase_peak["forward"] for r in runs),
             "mem/peak_gathered_bytes_backward": max(r._phase_peak["backward"] for r in runs),
             "comm/gather_bytes": g["comm/gather_bytes"],
             "comm/reduce_bytes": comm.bytes.get("reduce_scatter", 0) + comm.bytes.get("reduce", 0),
             "comm/replica_bytes": comm.bytes.get("replica", 0), "comm/update_bytes": comm.bytes.get("exchange", 0),
             "optim/impl": "+".join(sorted({new.spec.optimizer.resolved_impl(new.spec.mesh.device, u.dtype)
                                            for u in new.spec.units if u.trainable})), **grad_metrics}
        return env.traced(m)


def _measured(comm, runs, state, new, accum: int, skipped: bool) -> dict:
    """The figures of ``step.plan``, measured in this step."""
    f = {"mem/unit_grad_bytes": max(r._unit_grad_bytes for r in runs), "mem/accum_bytes": accum,
         "mem/reduce_buffer_bytes": comm.reduce_buffer_bytes, "comm/control_bytes": comm.bytes.get("control", 0),
         "mem/grad_shard_bytes": sum(g.nbytes for g in runs[-1]._grad_shards().values()),
         "mem/grad_shard_peak_bytes": runs[-1]._grad_peak, "mem/param_read_bytes": max(r._read_peak for r in runs),
         "mem/new_state_bytes": 0 if skipped else new_state_bytes(state, new), **state_figures(state)}
    f["mem/peak_bytes"] = peak_bytes({"mem/peak_gathered_bytes": max(r._peak_bytes for r in runs), **f})
    return f


def _backward(run: StepRun, buffers, out) -> None:
    """Backward, with the step's buffers bound: an activation checkpoint's recompute may read them. ``backward``
    rather than ``grad(out, leaves)``, which a reentrant checkpoint refuses: the leaves (shards) get no ``.grad``,
    since gradients end at ``_Gather.backward``, in the units."""
    with meta_reads(
            "backward read a parameter whose unit was not gathered: an activation checkpoint recomputed code that "
            "uses parameters of the root unit, or of a unit it does not call. fshard gathers a unit for a "
            "recompute when backward enters one of its calls; make each checkpointed module a unit, or a part of "
            "one (fs.init(..., units=[...]))."):
        with bound_at(run.spec.owners, _buffer_names(run.spec, buffers)):
            torch.autograd.backward(out)


def _buffer_names(spec, buffers: dict) -> dict:
    """The step's buffers under every name each has in the template (one tensor at several paths), to bind."""
    return {a: b for n, b in buffers.items() for a in spec.buffer_aliases[n]}


def _close(policy) -> None:
    """``Step.close`` and the step's finalizer: end every policy's threads (offload_state's reader and worker)."""
    policy.close()


def _copies(state: TrainState, gather):
    """The parameter copies a step with this gather policy keeps: ``state.copies`` itself when it holds exactly
    those; else each unit's shard cast once to ``param_dtype`` (round to nearest, as a gather would cast it), or
    none when the policy gathers without copies. A shard in a store (offload_state(params=True)) has no copy: each
    gather reads it and casts it."""
    dtype = gather.param_dtype if gather.param_copies else None
    if dtype is None:
        return state.copies if not state.copies else {}
    want = {u.name for u in state.spec.units if u.dtype != dtype and in_store(state.params[u.name]) is None}
    if set(state.copies) == want and all(c.dtype == dtype for c in state.copies.values()):
        return state.copies
    return {n: state.params[n].detach().to(dtype) for n in sorted(want)}


def compose(loss_fn, *transforms, donate: bool = False, trace: bool = False, mesh=None,
            timeline: bool = False, check_collectives: bool | None = None, compile: bool | dict = False) -> Step:
    """``step = fs.compose(loss_fn, *transforms)``; ``loss_fn(module, batch)`` returns a scalar tensor.

    donate: update the input state's tensors in place instead of copies (the input state is then unusable).
    trace: add ``metrics["trace/collectives"]``, the collectives this rank issued, in order.
    mesh: if given, the state must have been made on this mesh.
    timeline: add ``metrics["trace/timeline"]``, this rank's spans ``(lane, label, start_s, end_s)`` since the
      step began (compute, gathers, reductions, control all-reduces, update, store I/O, exposed waits); draw them
      with ``fs.timeline(metrics, path)``.
    check_collectives: before each collective, one tiny all-gather checks that all ranks are about to issue the same
      one and that none has failed (fshard/dist/_agreement.py): divergence is a ``RankDivergenceError`` and an error on
      one rank a ``RankFailedError`` on the others, on every rank at the same point, where gloo would abort the
      process or the others would wait for the timeout. Once two steps in a row issued the same collectives, a
      step compares that whole sequence once, at its start, and then issues each of it unchecked while it is the
      one expected; a rank that fails or takes another path issues the rest with zeros first, so the guarantees
      hold (fshard/dist/_replay.py). None (the default): on CPU meshes at every step (the 27.4M GPT at two ranks
      with gather_ahead + bucket_reduce: as fast as unchecked, benchmarks/RESULTS.md "Session 35"); on CUDA
      until a step has completed (each check reads its result on the host). True: every step; False: never, so a
      divergence is found only at the step's end and an error on one rank reaches the others only at the commit
      vote (a rank that fails before it leaves them waiting in a collective until the timeout: ``CollectiveError``).
      Whatever the setting, what remains are the step's own agreements: before the first gather one all-reduce that
      compares the ranks' step, model, optimizer, transforms and batch structure; after backward one that sums the
      loss and compares the sequences of collectives each rank issued; and the commit vote at the end (a check),
      so a step returns on every rank or raises on every rank.
    compile: ``torch.compile`` each unit's forward (True: torch.compile's defaults; a dict: its keyword arguments,
      e.g. ``{"mode": "max-autotune"}``), as torchtitan compiles each block under FSDP2: the unit's own forward
      with its gathered parameters as inputs, while the gathers, reductions and hooks around it run as they do
      uncompiled. Units of one class share their compiled code. The glue between units (embeddings, the loss)
      is the loss function's: compile it with ``torch.compile(loss_fn)`` (units stay opaque to it).
    """
    return Step(loss_fn, transforms, donate=donate, trace=trace, mesh=mesh, timeline=timeline,
                check_collectives=check_collectives, compile=compile)
