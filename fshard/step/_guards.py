"""What a step checks before and while it runs, so that a misuse is an error naming the fix and changes nothing:
the state is usable and its mesh alive, one step at a time per step function and per model template, the loss is a
differentiable scalar (and not the NaN of an empty batch), forward created no parameter, the update policy returned
what the protocol says."""
from __future__ import annotations

import contextlib

import optree
import torch

from ..errors import (ArgumentTypeError, ConcurrentStepError, EmptyBatchError, InitError, LossError,
                      MeshMismatchError, PolicyError, StepClosedError, UnboundParameterError)
from ..state._train_state import ShardSpec, TrainState
from ..state._stored import in_store


def spec_of(state) -> ShardSpec:
    """The state's static half, after the checks without which no collective can be made."""
    if not isinstance(state, TrainState):
        raise ArgumentTypeError(f"step(state, batch): state must be the fs.TrainState from fs.init or a previous "
                                f"step, got {type(state).__name__}.")
    state.spec.mesh.check_alive()
    return state.spec


def check_usable(step, state) -> None:
    """Checks of the call that the other ranks learn of if they fail on one rank (``Comm.fail``)."""
    if step._closed:
        raise StepClosedError(f"{step!r} was closed (step.close(), or the end of its with block); compose a "
                              "new step function with fs.compose(...) to go on training.")
    state.check_usable()
    if step.donate:
        state.donation.check_not_saving()
    if step.mesh is not None and not step.mesh.same_as(state.spec.mesh):
        raise MeshMismatchError(
            f"this step runs on {step.mesh} but the state was made on {state.spec.mesh}. Shards belong to the "
            "mesh they were made on: build the state on this mesh with fs.init(model, mesh, opt), or compose the "
            "step with the state's mesh (fs.compose(loss_fn, mesh=state.mesh)).")


@contextlib.contextmanager
def exclusive(step, spec):
    """One step (or eval pass) at a time per step function and per model template (states of one ``fs.init``
    share it, and a step swaps its tensors): a second, concurrent one is refused, not interleaved."""
    if not step._busy.acquire(blocking=False):
        raise ConcurrentStepError(
            f"{step!r} is already running a step in another thread. A step function runs one step at a time "
            "(its policies keep per-step state); compose one per thread, or wait for the running step.")
    try:
        if not spec.busy.acquire():
            raise ConcurrentStepError(
                "a step or eval pass is already running on a state of this fs.init in another thread: all states "
                "of one fs.init share one model template, whose tensors a step swaps while it runs. Run their "
                "steps one after another, or fs.init the model again for each concurrent run.")
        try:
            yield
        finally:
            spec.busy.release()
    finally:
        step._busy.release()


def check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        what = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor)
                else type(loss).__name__)
        raise LossError(f"loss_fn must return a floating-point scalar tensor (0-dim), but returned {what}. Reduce it "
                        "to one number inside loss_fn, e.g. return loss.mean().")


def check_empty(loss, batch, rank: int) -> None:
    """A batch whose tensors all have no element has no sample, and a mean loss over it is 0/0 = NaN: committed, the
    step would report NaN as the mean over ranks (the gradients, all zero on that rank, would still be averaged
    over every rank, as DDP does). Refused instead, naming the usual cause, before backward: the step then fails on
    every rank and changes nothing. A loss_fn that handles an empty batch (returns a finite loss, e.g. a sum over
    the tokens divided by a global count) is let through. Cheap: the loss is read (a device sync) only when the
    batch is empty."""
    leaves = [x for x in optree.tree_leaves(batch, none_is_leaf=True) if isinstance(x, torch.Tensor)]
    if not leaves or any(x.numel() for x in leaves) or loss.is_meta or bool(torch.isfinite(loss)):
        return
    raise EmptyBatchError(
        f"rank {rank} passed a batch with no samples (every tensor in it is empty), and loss_fn returned "
        f"{float(loss)} for it, so the step would report that as the loss. Give every rank at least one sample per "
        "micro-batch: torch's DistributedSampler pads the ranks to equal sizes (keep drop_last=False there) or drops "
        "the uneven tail (drop_last=True in the DataLoader); a custom split must do the same. A loss_fn that should "
        "accept empty batches must return a finite loss for them (e.g. sum over the tokens / a global token count). "
        "Nothing was updated, on any rank.")


def check_template(spec) -> None:
    """Outside a step the template's parameters are meta tensors; one that is not was created by forward (a lazy
    module, or an nn.Parameter made in forward): fs.init never saw it, so no step would ever train it."""
    made = [n for n, p in spec.template.named_parameters() if not p.is_meta]
    if made:
        raise InitError(
            f"forward created parameters that fs.init never saw: {made[:5]}{' ...' if len(made) > 5 else ''}. They "
            "are not in the state, so no step would train them (a lazy module, e.g. nn.LazyLinear, or an "
            "nn.Parameter made inside forward). Create every parameter before fs.init (run one forward on a dummy "
            "batch to materialise lazy modules, or make it in __init__). Nothing was updated.")


def checked_update(policy, out, state: TrainState):
    """The update policy's ``(params, opt_state, metrics, copies)``, checked: a copy for each unit the state holds
    one for, in its dtype and size (a policy that ignored the copies would leave gathers reading stale weights),
    except a unit whose new shard lives in a store (its gathers cast what they read)."""
    if not isinstance(out, tuple) or len(out) != 4:
        raise PolicyError(f"the update policy {type(policy).__name__} returned {type(out).__name__}"
                          f"{f' of {len(out)}' if isinstance(out, tuple) else ''}; an UpdatePolicy returns "
                          "(params, opt_state, metrics, copies), copies being the new TrainState.copies.")
    copies, stored = out[3], {n for n, p in out[0].items() if in_store(p) is not None}  # (read, then cast)
    bad = [n for n, c in state.copies.items() if n not in stored and
           (n not in copies or copies[n].dtype != c.dtype or copies[n].shape != c.shape)]
    if bad or set(copies) - set(state.copies):
        raise PolicyError(f"the update policy {type(policy).__name__} returned copies for {sorted(copies)} where the "
                          f"state holds copies of {sorted(state.copies)} (wrong or missing: {bad}); it must return "
                          "each unit's copy, written with the new shard (fs.adamw's update(copy=...)).")
    return out


class meta_reads:
    """Torch's error for a meta tensor met in computation, as ``UnboundParameterError(what)``. A class, not a
    generator: see ``envelope`` (fshard/step/_envelope.py) for the cycle a generator that catches an error makes."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, (RuntimeError, NotImplementedError)) and "meta" in str(error):
            raise UnboundParameterError(f"{self.what} ({error})") from error
        return False
