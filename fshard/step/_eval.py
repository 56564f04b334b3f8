"""``step.eval(state, batch)``: forward only, with the step's gathers, in eval mode; and the mode of each call.

An eval pass runs ``loss_fn(module, batch)`` as a training step's forward does: each unit gathered by the step's
gather policy (``gather_ahead`` prefetches along the forward half of its gather order), bound, computed and freed, in
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
from ..dist._agreement import agree, check_ranks
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
            if m.training != flag:  # (nn.Module.__setattr__'s checks, for a bool: only where it changed)
                m.training = flag


def evaluate(step, env, state, batch) -> tuple[float, dict]:
    """The body of ``Step.eval`` (see the module docstring), in the envelope ``env`` (fshard/step/_envelope.py)."""
    comm, spec = env.comm, state.spec
    state = step.init(state)  # the compute dtype and the parameter copies, as a training step would have them
    check_ranks(comm, state, batch, step._chain, step._fingerprints)  # the same rank check as a training step's
    run = StepRun(state, comm, step.policy, Accumulator(1), {}, last=True, training=False,
                  compiled=step._compiled, pool=env.pool)
    env.runs.append(run)
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
    g = env.gather_figures()
    m = {"loss": total / spec.mesh.world_size, "step": int(state.step), "time/eval": time.perf_counter() - env.t0,
         "time/gather": g["time/gather"], "time/gather_exposed": g["time/gather_exposed"],
         "time/compute": max(0.0, t2 - t1 - g["time/gather_exposed"]),
         "mem/peak_gathered_bytes": g["mem/peak_gathered_bytes"], "comm/gather_bytes": g["comm/gather_bytes"],
         **gather_metrics}
    comm.span("compute", "eval forward", t1, t2)
    return m["loss"], env.traced(m)
