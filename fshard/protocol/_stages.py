"""The stage protocols: what a policy of each stage receives, what it returns, and what it may touch.

A step has five stages (design/ARCHITECTURE.md). A transform changes a stage by giving it a policy: an object
that follows that stage's protocol below (the grads stage is a chain: a transform adds a link, a
``GradsPolicy``). Every hook a stage may have is declared here, with a no-op default, so
a policy subclasses its protocol and overrides what it changes; the step calls the declared hooks and nothing
else (it never probes a policy for an attribute).

What policies receive is described here too: ``StepView`` (one micro-batch of a running step), ``UnitView`` (one
unit in it), ``Collectives`` (the step's collectives, declared beside them in fshard/dist/_protocol.py and
re-exported here); ``Grads``, the value the grads stage transforms, is in fshard/protocol/_grads.py. The runtime
objects behind the views are private; a policy uses only what the views name.

Rules every policy keeps:

- A policy never inspects another policy. What one stage must know of another is declared: the grads chain says
  whether it leaves the gradients as they are (``GradsPolicy.changes_grads``, combined by ``fs.compose`` into
  ``StepView.grads_unchanged``).
- Per-step state lives in ``step.scratch(self)``, never in attributes of the step objects. What outlives a step
  and changes a result is training state, and lives in the ``TrainState``.
- A policy that holds threads or other resources releases them in ``close()`` (``step.close()`` calls it).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import PolicyError
from ..dist._protocol import Collectives, InFlight  # noqa: F401 (what policies receive of the collectives: re-exported)
from ._grads import Grads  # noqa: F401 (the value the grads stage transforms: a protocol name, re-exported here)

if TYPE_CHECKING:
    from ..state._flat import UnitLayout
    from ..state._train_state import ShardSpec, TrainState


# --- what policies receive --------------------------------------------------------------------------------------

class UnitView(Protocol):
    """One unit during one micro-batch of a step.

    Attributes:
      name: the unit's name (``layout.name``).
      layout: its ``fs.state.UnitLayout`` (slots, sizes, dtype, this rank's ranges).
      trainable: whether it has trainable parameters.
      shard: this rank's parameter shard (read it; never write it); without storage when it lives in a store.
      grad: this rank's reduced gradient shard, once the reduce policy handed it over (``StepView.grad_ready``);
        None before.
      alive: whether its gathered buffer holds memory (gathered or being gathered).
      in_flight: whether a gather into its buffer was launched and nobody has waited on it yet.
    """

    name: str
    layout: UnitLayout
    trainable: bool
    shard: torch.Tensor
    grad: torch.Tensor | None
    alive: bool
    in_flight: bool

    def launch(self) -> None:
        """Start gathering the unit into its buffer, if it is not alive; returns at once."""

    def acquire(self) -> None:
        """Make the gathered buffer live and its data ready (launching the gather if nobody did)."""

    def release(self) -> None:
        """Free the gathered buffer (waiting first for a gather still writing into it)."""

    def got_all(self) -> bool:
        """Whether every trainable parameter of the unit got a gradient on this rank in this step so far (then it
        is active on every rank, whatever the agreement after backward says)."""


class StepView(Protocol):
    """One micro-batch of a running step, as policies see it.

    Attributes:
      spec: the static half of the state (``fs.state.ShardSpec``: template, unit layouts, mesh, optimizer).
      state: the step's input ``TrainState`` (read it; never write its tensors).
      comm: the step's ``Collectives``.
      units: unit name -> ``UnitView``, in layout order.
      order: the units forward has called so far in this micro-batch, in order (a unit used twice appears twice).
      phase: "forward" or "backward".
      last: whether this is the step's last micro-batch (the one whose backward reduces).
      grads_unchanged: whether the composed grads stage hands the reduced shards to the update unchanged (no
        global clip, no skip), so an update may begin before the grads stage has run.
      grads_unread: moreover, no grads policy reads the shards (``reads_grads``): an early update may free them.
      training: False in an eval pass (``step.eval``): forward only, under ``torch.no_grad``; no backward, no
        reduction, no update. A gather policy then frees what it would keep for backward.
      donate: the step updates its input in place (``compose(..., donate=True)``); an update begun during
        backward may too, after ``step.state.donation.take(step)`` (a failing step's input then refuses use).
      param_dtype, param_copies: what the gather policy declares (the dtype units compute in, None: their own;
        whether the state keeps copies of the shards in it, ``TrainState.copies``).
    """

    spec: ShardSpec
    state: TrainState
    comm: Collectives
    units: Mapping[str, UnitView]
    order: Sequence[str]
    phase: str
    last: bool
    grads_unchanged: bool
    grads_unread: bool
    training: bool
    donate: bool
    param_dtype: torch.dtype | None
    param_copies: bool

    def scratch(self, owner: object) -> dict:
        """The per-step scratch space of ``owner`` (a policy): a dict shared by the micro-batches of one step and
        dropped when the step returns or raises."""

    def grad_ready(self, unit: UnitView, shard: torch.Tensor) -> None:
        """Hand over ``unit``'s reduced gradient shard (``unit.layout.shard_numel`` elements of its dtype; else
        ``PolicyError``). The reduce policy calls it exactly once per unit it was given, by the time its ``finish``
        returns; in the last micro-batch it also offers the unit to the update policy's ``overlap``."""

    def grad_freed(self, unit: UnitView) -> None:
        """Say that ``unit``'s gradient shard has been freed (an update during backward consumed it, when
        ``grads_unread``), so the step's count of shards held at once (``mem/grad_shard_peak_bytes``) drops. Any
        thread may call it until the step returns."""

    def record(self, lane: str, label: str, t0: float, t1: float) -> None:
        """Add a span (``lane``: the kind of work, e.g. "store"; ``label``: what ran, e.g. "write blocks.0"; ``t0``,
        ``t1``: ``time.perf_counter()`` seconds) to this step's timeline when one is recorded (``fs.compose(...,
        timeline=True)``), else a no-op. For policies' own timed work (store I/O, a worker's update); any thread
        may call it until the step returns."""


# --- the stage protocols ----------------------------------------------------------------------------------------

class GatherPolicy(Protocol):
    """When each unit's flat buffer is gathered and freed, in forward and in backward.

    A gather policy calls only the ``UnitView`` methods (``launch``, ``acquire``, ``release``); the data a unit
    computes on is always its own gather's, so a policy changes when gathers happen, never a result.

    Attributes:
      gather_order: the order in which the step acquires units (an ``fs.GatherOrder``), for policies that follow
        one; None otherwise. ``step.gather_order`` shows it. Before any step, ``step.plan`` sets it, on its copy of
        the policy, to the order a first step records for a model that calls its units in layout order.
      param_dtype: the dtype units are gathered and computed in (None: each unit's own, its master dtype). The
        step casts the shard to it for each gather, and the floating-point tensors passed to a unit's call (as
        FSDP2's ``cast_forward_inputs``); gradients then arrive in it (``fs.mixed_precision`` sets it).
      param_copies: whether units are gathered from persistent copies in ``param_dtype`` (``TrainState.copies``)
        instead of a cast of the shard per gather. The step makes the copies the state lacks (``Step.init``: one
        cast each) and drops them when this is False; the update keeps them equal to the new shards.
    """

    gather_order: Any = None
    param_dtype: torch.dtype | None = None
    param_copies: bool = False

    def start(self, step: StepView) -> None:
        """Before each micro-batch's forward."""

    def before_forward(self, step: StepView, unit: UnitView) -> None:
        """Before a call of the unit in forward (the root unit: before the whole forward). Must leave the unit
        acquired."""
        unit.acquire()

    def after_forward(self, step: StepView, unit: UnitView) -> None:
        """After that call."""
        unit.release()

    def before_backward(self, step: StepView, unit: UnitView) -> None:
        """Whenever backward is about to use the unit: a gradient reached an output of one of its calls, autograd
        reads a saved tensor of it, or an activation checkpoint recomputes its call. Must leave it acquired."""
        unit.acquire()

    def after_backward(self, step: StepView, unit: UnitView) -> None:
        """When one use of the unit has finished backward."""
        unit.release()

    def finish(self, step: StepView) -> dict:
        """After each micro-batch's backward (the step then releases what is left).

        Returns:
          metrics for the step so far; the step reports those of its last micro-batch (carry counts across
          micro-batches in ``step.scratch(self)``).
        """
        return {}

    def close(self) -> None:
        """Release the policy's resources (``step.close()``)."""


class ReducePolicy(Protocol):
    """How the gradient of a unit's flat buffer becomes this rank's reduced gradient shard (last micro-batch).

    Attributes:
      reduce_dtype: the dtype it reduces in (None: the gradient's own). With micro-batches (``fs.accumulate``)
        the step sums each unit's gradient in it before the one reduction, as FSDP2 accumulates unsharded
        gradients in its ``reduce_dtype``, so fp16/bf16 gradients are not summed in their own precision.
      widens: ``reduce`` takes a gradient narrower than the dtype it is wrapped to reduce in (bf16 for fp32) and
        widens it piece by piece as it copies it into its own buffers, with the same values as a cast first; so a
        wrapper that would cast the whole gradient (fs.mixed_precision) hands it over as it is, and the unit's
        gradient is never held twice at once (bucket_reduce: 192 MiB less per 50M-parameter unit). Default False.
      per_slot: ``reduce`` takes the gradient as a ``SlotGrad`` (fshard/state/_slot_grad.py: each parameter's
        gradient as autograd made it) and copies it out slot by slot (``grad_parts``), so the step never assembles
        the unit's flat gradient only for the policy to copy it again (bucket_reduce: the ``cat`` of 4% of a
        two-rank step). At world size 1 every policy is given one (it reads as the flat tensor to any op). Default
        False: the flat gradient.
    """

    reduce_dtype: torch.dtype | None = None
    widens: bool = False
    per_slot: bool = False

    def reduce(self, step: StepView, unit: UnitView, grad: torch.Tensor) -> None:
        """Start reducing ``grad`` (the unit's whole flat gradient, summed over the step's micro-batches).

        Args:
          step: the last micro-batch of the step.
          unit: the unit (each unit with a gradient is given once per step).
          grad: ``unit.layout.numel`` elements; the policy may reuse its memory.

        The policy must hand the reduced shard over with ``step.grad_ready(unit, shard)``, now or later, but by
        the time ``finish`` returns: the step checks this, and an update may begin as soon as it happens.
        """
        raise PolicyError(f"{type(self).__name__} is a ReducePolicy without reduce(step, unit, grad); define it.")

    def finish(self, step: StepView) -> None:
        """After backward: every reduction is complete, and every shard handed over, when it returns."""

    def close(self) -> None:
        """Release the policy's resources (``step.close()``)."""


class GradsPolicy(Protocol):
    """A link of the grads chain: what happens to the reduced gradient shards between the agreement after backward
    and the update. The step runs the links in composition order, each on the previous one's result; no link holds
    another (a transform adds one with ``Transform.grads`` or ``Transform.grads_link``).

    Attributes (read by ``fs.compose`` alone, to derive what the step needs of the chain):
      changes_grads: whether this link may change what the update does with the shards: their values, ``scale``
        or ``skip``. A link that only reads them and adds metrics says False, and updates may then begin during
        backward (``StepView.grads_unchanged``).
      scales_loss: whether this link scales the loss before backward (``loss_scale``); at most one link of a
        step's chain does.
      reads_grads: whether this link reads the shards at all (``StepView.grads_unread`` when none does).
    """

    changes_grads: bool = True
    scales_loss: bool = False
    reads_grads: bool = True

    def loss_scale(self, state: TrainState) -> float:
        """The factor backward multiplies the loss by, in the step on ``state`` (read only when ``scales_loss``).
        The gradients then arrive multiplied by it, and the step starts ``Grads.scale`` at its reciprocal, so
        the update applies the unscaled gradients with no extra pass (fp16 loss scaling)."""
        return 1.0

    def __call__(self, comm: Collectives, grads: Grads) -> Grads:
        """Args:
          comm: the step's collectives (same calls on every rank, in the same order).
          grads: the value so far.

        Returns:
          a new ``Grads`` (or ``grads`` itself).
        """
        return grads

    def close(self) -> None:
        """Release the policy's resources (``step.close()``)."""


class UpdatePolicy(Protocol):
    """Where and how the optimizer runs on the shards."""

    def __call__(self, step: StepView, state: TrainState, grads: Grads, active: Mapping[str, Sequence[bool]],
                 donate: bool) -> tuple[dict, dict, dict, dict]:
        """Apply one optimizer step.

        Args:
          step: the last micro-batch of the step (``scratch`` holds what ``overlap`` began).
          state: the input state.
          grads: the grads stage's result (``scale`` to fuse; ``skip`` is never set here: the step skips).
          active: unit name -> per trainable parameter, whether it got a gradient on any rank.
          donate: whether the input state's tensors may be updated in place.

        Returns:
          ``(params, opt_state, metrics, copies)``: the new state's unit name -> shard and unit name -> optimizer
          state mappings, metrics to report, and the new ``TrainState.copies``: for each unit of
          ``state.copies``, the cast of its new shard to the copy's dtype (round to nearest), written in the same
          pass as the shard where the kernel can (``fs.adamw``'s ``update(copy=...)``); a unit it did not update
          keeps its copy. A wrapping policy returns what the policy it wraps returns, changed or not.
        """
        raise PolicyError(f"{type(self).__name__} is an UpdatePolicy without __call__(step, state, grads, active, "
                          "donate); define it.")

    def overlap(self, step: StepView, unit: UnitView) -> None:
        """Called in the last micro-batch as soon as ``unit``'s reduced shard is final, while backward still runs.
        The policy may begin that unit's update here (only when ``step.grads_unchanged``), keeping the work in
        ``step.scratch(self)`` for ``__call__`` to take."""

    def abort(self, step: StepView) -> None:
        """Called at the end of every step that began a micro-batch: drop what ``overlap`` began and ``__call__``
        did not take (the step failed, ``__call__`` included, or skipped the update), losing nothing of the input
        state. After a successful ``__call__`` there is nothing left to drop."""

    def plan(self, step: StepView, state: TrainState, active: Mapping[str, Sequence[bool]],
             donate: bool) -> Mapping[str, int] | None:
        """What ``__call__`` will allocate and move, for ``step.plan`` (no work is done). ``step`` is a simulated
        step: its layouts and mesh are real, its units hold no data (a unit's ``grad`` is set, as a meta tensor,
        where the real step's would be); ``active`` is what ``__call__`` would be given.

        Returns:
          metric name -> bytes, for the names the update's metrics measure: ``mem/new_state_bytes`` (tensors the
          new state holds that the input does not), ``io/read_bytes`` and ``io/write_bytes`` (store traffic),
          assuming every trainable parameter gets a gradient. None (the default): unknown, and ``print(plan)``
          says so.
        """
        return None

    def read_ahead(self, leaf, dtype: torch.dtype, record, label: str, pin: bool = False):
        """Start reading ``leaf``, a parameter shard held outside memory (``fs.state.in_store``: it has
        ``load(dtype, pin)``), on a thread this policy owns, ahead of its unit's gather. ``record(lane, label, t0,
        t1)`` takes the read's span for the timeline; ``pin``: into pinned memory (bound for a GPU).

        Returns:
          A ``concurrent.futures.Future`` of the CPU tensor in ``dtype``, or None (the default): no reader, the step
          reads the leaf itself at the gather. ``fs.offload_state``'s policy reads on its reader thread.
        """
        return None

    def close(self) -> None:
        """Release the policy's resources, threads included (``step.close()``)."""


class BatchesPolicy(Protocol):
    """How the step's batch splits into micro-batches whose gradients are summed."""

    def __call__(self, batch: Any) -> list:
        """Returns: the micro-batches (a list of at least one)."""
        return [batch]

    def close(self) -> None:
        """Release the policy's resources (``step.close()``)."""
