"""``step.eval(state, batch)``: forward only, with the step's gathers, in eval mode; and the mode of each call.

An eval pass runs ``loss_fn(module, batch)`` as a training step's forward does: each unit gathered by the step's
gather policy (``gather_ahead`` prefetches along the forward half of its schedule), bound, computed and freed, in
``param_dtype`` under ``fs.mixed_precision`` (from the parameter copies when the state has them). It takes no
gradient (``torch.no_grad``: no autograd graph, no saved tensors, no re-gathers), reduces nothing, changes no
state, and returns the loss averaged over ranks.

Train or eval mode is chosen per call, not frozen at ``fs.init``: a training step runs with ``module.train()``
applied to the template (so dropout is on, BatchNorm uses and updates batch statistics), an eval pass with
``module.eval()`` (dropout off, BatchNorm's running statistics used as they are). Both go through the modules'
own ``train(mode)`` methods, so a module that overrides ``train`` to keep a part frozen (a frozen BatchNorm) keeps
it; the template's flags are restored when the call returns.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from ..transforms._accumulate import Accumulator
from ..dist._agreement import agree, check_ranks, foreign, step_error
from ..dist._collectives import Comm
from ._guards import check_usable, exclusive, spec_of
from ..errors import RankDivergenceError
from ..run._run import StepRun


@contextlib.contextmanager
def train_mode(module: nn.Module, training: bool):
    """``module.train(training)`` for the duration of the block; every submodule's flag restored afterwards."""
    saved = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def evaluate(step, state, batch) -> tuple[float, dict]:
    """The body of ``Step.eval`` (see the module docstring)."""
    t0 = time.perf_counter()
    spec = spec_of(state)
    comm = Comm(spec.mesh, trace=step.trace, stream=step._gather_stream(spec.mesh.device), timeline=step.timeline,
                verify=step._verify(spec.mesh), context=f"eval at step {int(state.step)}")
    run, ok = None, False
    with exclusive(step, spec):
        try:
            check_usable(step, state)
            state = step.init(state)  # the compute dtype and the parameter copies, as a training step would have them
            check_ranks(comm, state, batch, step._chain, step._fingerprints)  # the same rank check as a training step's
            run = StepRun(state, comm, step.policy, Accumulator(1), {}, last=True, training=False)
            # clones: a module may still write a buffer in eval mode, and the state must not change
            buffers = {k: b.clone() for k, b in state.buffers.items()}
            t1 = time.perf_counter()
            with train_mode(spec.template, False), torch.no_grad(), run._active():
                step.policy.gather.start(run)
                loss = step._forward(run, buffers, batch)
                gather_metrics = step.policy.gather.finish(run)
            run._release_all()
            t2 = time.perf_counter()
            (total,), (same,) = agree(comm, [float(loss)], [comm.seq_hash])
            if not same:
                raise comm.unanimous(RankDivergenceError(
                    "ranks issued different gathers in this eval pass (different units, order or sizes), so gathered "
                    "parameters may be mixed up. Every rank must run the same units in the same order; make control "
                    f"flow independent of the rank's data. This rank ran units in the order {run.order}."))
            gather, exposed = comm.busy_seconds("gather"), comm.seconds.get("gather_exposed", 0.0)
            m = {"loss": total / spec.mesh.world_size, "step": int(state.step), "time/eval": time.perf_counter() - t0,
                 "time/gather": gather, "time/gather_exposed": exposed, "time/compute": max(0.0, t2 - t1 - exposed),
                 "mem/peak_gathered_bytes": run._peak_bytes, "comm/gather_bytes": comm.bytes.get("all_gather", 0),
                 **gather_metrics}
            if comm.trace is not None:
                m["trace/collectives"] = tuple(comm.trace)
            if comm.spans is not None:
                comm.span("compute", "eval forward", t1, t2)
                m["trace/timeline"] = comm.timeline(t0)
            ok = True
            return m["loss"], m
        except BaseException as e:
            told = comm.fail(e)  # the other ranks raise RankFailedError at their next check
            if not foreign(e):
                raise
            raise step_error(comm, e, told) from e
        finally:
            if not ok:
                comm.drain()  # an error mid-pass: no gather may still be writing into our buffers
            if run is not None:
                run._close()
