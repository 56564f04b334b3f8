"""Activation checkpointing: what a recompute in backward needs from the step.

``torch.utils.checkpoint`` (and transformers' ``gradient_checkpointing_enable()``, which checkpoints each layer's
class ``forward`` from inside the layer's call) runs part of forward a second time during backward. By then the
unit's binding for its call has ended and its gathered buffer is freed, so the recompute would read meta
tensors or freed storage. Three mechanisms cover every place a checkpoint can sit:

- **Pre-backward hooks.** Each tensor a unit call returns (that requires grad and is not one of its inputs passed
  through) gets a hook that fires when its gradient is complete, i.e. just before backward enters the unit: the
  unit's backward use begins there (``GatherPolicy.before_backward``), so the unit is gathered before a recompute
  inside it runs, as FSDP2's pre-backward hooks on module outputs do.
- **Attached parameters.** While a unit is gathered in backward, its module's parameters (every alias) are views
  of the gathered buffer (those forward's last call bound, fshard/run/_unit.py), so a recompute that reads
  ``self.weight`` directly (a checkpoint inside the unit) sees the data; they are meta again when the unit is
  freed. Forward keeps the per-call binding, so code that reaches into a unit outside its call still fails with
  ``UnboundParameterError``.
- **Bound buffers.** The step's buffers stay bound to the template for the whole backward call, as they are for
  the forward call, so a recompute reads (and, like plain torch, updates) the step's buffers.

A recompute that calls a unit module (a checkpoint around the unit, or the reentrant variant, whose recompute
graph is the one differentiated) goes through the step like any call: it begins the unit's backward use and keeps
the unit gathered until that use's gradient is complete (fshard/run/_unit.py).

``through`` marks where backward has finished a call (FSDP2's post-backward node on a module's inputs): for a
frozen unit, which has no gradient of its own to say so, and for a routed group (fshard/run/_routed_groups.py).
"""
from __future__ import annotations

import torch


def produced(out, args, kwargs) -> list[torch.Tensor]:
    """The tensors of a call's output that require grad and are not its inputs returned as they came (T5's layers
    pass ``position_bias`` on: its gradient completes only after every later layer, long after this one's)."""
    inputs = {id(t) for t in _tensors((args, kwargs))}
    return [t for t in _tensors(out) if t.requires_grad and id(t) not in inputs]


def _tensors(x):
    """The tensors in nested tuples, lists and dicts (transformers' ``ModelOutput`` is a dict)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


class _CallBackward(torch.autograd.Function):
    """Identity on a call's inputs (returned as they are, as FSDP2's post-backward function does); its backward
    runs once backward has finished the call, and calls ``done()``."""

    @staticmethod
    def forward(ctx, done, anchor, *xs):
        ctx.done = done
        return (anchor.detach().clone(), *xs)

    @staticmethod
    def backward(ctx, _anchor, *grads):
        done, ctx.done = ctx.done, None  # the node must not keep the step's runtime alive
        if done is not None:
            done()
        return (None, None, *grads)


def through(done, args, kwargs, anchor: torch.Tensor | None = None):
    """``(anchor_out, args, kwargs)``: each tensor of ``args`` and ``kwargs`` that requires grad passed through one
    ``_CallBackward`` node, which calls ``done()`` when backward has finished with all of them. ``anchor_out`` (of
    ``anchor``, a scalar that requires grad) makes other nodes that take it as an input run before ``done``. Where
    no input requires grad and nothing uses ``anchor_out``, backward never reaches the node."""
    leaves: list[torch.Tensor] = []
    _put((args, kwargs), {}, leaves)
    if anchor is None:
        anchor = torch.zeros((), requires_grad=True)
    anchor_out, *outs = _CallBackward.apply(done, anchor, *leaves)
    swap = {id(a): b for a, b in zip(leaves, outs)}
    return anchor_out, _put(args, swap), _put(kwargs, swap)


def _put(x, swap: dict, found: list | None = None):
    """``x`` with tensors replaced by ``swap[id]`` inside plain tuples, lists and dicts; ``found`` collects the
    ones there that require grad (the same containers, so every collected tensor is replaced)."""
    if isinstance(x, torch.Tensor):
        if found is not None and x.requires_grad:
            found.append(x)
        return swap.get(id(x), x)
    if type(x) in (tuple, list):
        return type(x)(_put(v, swap, found) for v in x)
    if type(x) is dict:
        return {k: _put(v, swap, found) for k, v in x.items()}
    return x
