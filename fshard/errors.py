"""``fs.errors``: every error type fshard raises on purpose, each an ``FshardError``; each message names what was
misused and how to fix it. The common ones are also top-level names (``fs.ArgumentError``, ``fs.StepError``, ...);
the stores' errors are also ``fs.store``'s names."""
from __future__ import annotations

import copy
import dataclasses


class FshardError(Exception):
    """Base class of fshard's own errors."""


class FrozenStateError(FshardError, dataclasses.FrozenInstanceError):
    """An assignment to a field of an immutable fshard value."""


class MeshMismatchError(FshardError):
    """A state used with a mesh (process group) it was not made on."""


class BatchMismatchError(FshardError):
    """Ranks passed batches that one step cannot take together: of different structure, or (``EmptyBatchError``)
    one with no samples."""


class EmptyBatchError(BatchMismatchError, ValueError):
    """A rank's batch has no samples (every tensor in it is empty) and loss_fn returned a non-finite loss for it."""


class RankDivergenceError(FshardError):
    """Ranks issued different collectives, or disagree on the step, the model, its initial values, the optimizer's
    hyperparameters or the composed transforms."""


class RankFailedError(FshardError, RuntimeError):
    """A rank raised during a step (or eval pass), and no rank committed it: every input state is unchanged (unless
    donated and its update had begun), so the step can be retried on every rank. The other ranks raise this when
    they stop at their next check, naming the failing rank's error; the failing rank raises ``StepError`` (a
    subclass) from its own error, or the fshard error it raised as it is. One ``except fs.FshardError`` (or
    ``except fs.errors.RankFailedError``, for errors other than fshard's own) catches it on every rank."""


class StepError(RankFailedError):
    """This rank's step (or eval pass) raised an error that is not fshard's own (loss_fn's ValueError, a torch
    RuntimeError): it is ``__cause__``, its type and message are in this one's. KeyboardInterrupt and SystemExit
    are raised as they are."""


class CollectiveError(FshardError, RuntimeError):
    """A collective failed in the transport (a timeout, a closed connection): a rank is hung, dead, or running other
    collectives. The message names the step, the collective, and the ranks that had not arrived where known."""


class ConcurrentStepError(FshardError, RuntimeError):
    """Two steps ran at once on one step function, or on states of one fs.init (which share the model template)."""


class LossError(FshardError, ValueError):
    """loss_fn returned something that is not a differentiable scalar."""


class TorchVersionError(FshardError, ImportError):
    """``import fshard`` under a torch older than the oldest it is tested on (fshard/__init__.py)."""


class InitError(FshardError, ValueError):
    """fs.init was given a model it cannot shard."""


class TemplateCallError(FshardError, RuntimeError):
    """The module template was called outside a step."""


class DonatedStateError(FshardError, RuntimeError):
    """A state that was donated to a step was used again."""


class UnboundParameterError(FshardError, RuntimeError):
    """A parameter was used while its unit was not bound (outside a call of the unit module)."""


class GatherOrderError(FshardError):
    """The model acquired its units in a different order than gather_ahead's gather order (on_change="error")."""


class ArgumentError(FshardError, ValueError):
    """An fshard function was given a value it cannot use; the message names the argument and what it takes."""


class ArgumentTypeError(FshardError, TypeError):
    """An fshard function was given an argument of the wrong type; the message names what it takes."""


class TransformConflictError(FshardError, ValueError):
    """Two transforms passed to fs.compose change the same stage in ways that cannot both hold."""


class StepClosedError(FshardError, RuntimeError):
    """A step function was called after step.close()."""


class PolicyError(FshardError, RuntimeError):
    """A stage policy broke its protocol (fshard/protocol/_stages.py), e.g. a reduce policy that never handed a unit's
    gradient shard over."""


class RecomputeError(FshardError, RuntimeError):
    """Activation checkpointing was used in a way the step cannot keep exact (run/_recompute.py), e.g. a reentrant
    checkpoint around part of a unit's uses."""


class CheckpointError(FshardError, RuntimeError):
    """A checkpoint could not be written or read (fs.save, fs.load): incomplete, damaged, or of another model."""


class SaveInProgressError(CheckpointError):
    """A step composed with donate=True was given a state that an unfinished fs.save(..., blocking=False) reads."""


class MemoryBudgetError(FshardError, MemoryError):
    """``step.plan(..., max_memory=)``: the step's predicted peak is over the budget; nothing ran."""


class AbstractStateError(FshardError, ValueError):
    """A state from fs.init(..., abstract=True), which has no values, was given where values are needed."""


class OffloadError(FshardError):
    """The store could not hold the optimizer state; the input state is unchanged (unless it was donated)."""


# --- the stores' (fs.store) -------------------------------------------------------------------------------------------

class StoreError(FshardError, RuntimeError):
    """Base class of every error the store raises on purpose (an ``fs.FshardError``)."""


class StoreDirectoryError(StoreError):
    """The store directory is missing, cannot be created, or is not writable."""


class MissingKeyError(StoreError, KeyError):
    """The key was never put, or was deleted. Also a KeyError, so `except KeyError` works."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "missing key"


class CorruptedItemError(StoreError):
    """What was read back is not what was put: checksum mismatch, truncated or deleted file."""


class StoreWriteError(StoreError):
    """A write did not reach the file in full (disk full, I/O error). The previous version is kept."""


class StoreClosedError(StoreError):
    """The store was used after close()."""


class PoolExhaustedError(StoreError):
    """The buffer pool is at its count or byte bound and nothing can be given back."""


# --- the native ops' build (fs.ops) -----------------------------------------------------------------------------------

class BuildError(FshardError, RuntimeError):
    """The native ops could not be built (no compiler, no ninja, compile error)."""


class BuildLockError(BuildError):
    """The build lock cannot be opened safely (a symbolic link, not a regular file, no permission)."""


def copy_of_kept(error: BaseException) -> BaseException:
    """What to raise for an error kept to be raised later (an async save's, a store operation's), each time: a new
    exception like ``error`` (its type, arguments, cause, context and traceback). Raising the kept error itself adds
    the frames it passes through to its traceback, among them a caller's that holds whatever keeps the error: a
    reference cycle that keeps the caller's state, and its mesh, until a garbage collection. An error that copies
    differently (an ``__init__`` that does not take its own ``args``) is raised as it is."""
    try:
        new = copy.copy(error)
    except Exception:  # noqa: BLE001 - not copyable: raised as it is
        return error
    if type(new) is not type(error) or new.args != error.args:
        return error
    new.__cause__, new.__context__ = error.__cause__, error.__context__
    new.__suppress_context__ = error.__suppress_context__
    return new.with_traceback(error.__traceback__)
