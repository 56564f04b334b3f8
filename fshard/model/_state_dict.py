"""fs.full_state_dict: the trained state as ``model.state_dict()`` of the original model, for a hand-off to torch,
Hugging Face ``generate`` or ``save_pretrained``.

Hand-off to a fresh model (its constructor makes the ties and the non-persistent buffers)::

    sd = fs.full_state_dict(state)           # a collective: every rank calls it
    model.load_state_dict(sd)                # strict; copies into the existing (tied) parameters

A model built on the meta device has no storage: ``model.to_empty(device="cpu")`` gives every name of a tied
parameter its own tensor (it unties an HF ``lm_head``), so tie again after loading, and copy the non-persistent
buffers, which no state_dict carries, from ``state.buffers``::

    model.to_empty(device="cpu"); model.load_state_dict(sd); model.tie_weights()
    for n, b in state.buffers.items(): model.get_buffer(n).copy_(b)  # Llama's rotary inv_freq
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..dist._collectives import Comm
from ..errors import ArgumentError
from ..state._flat import views
from ..state._train_state import TrainState
from ..state._stored import resident


def full_state_dict(state: TrainState, *, rank0_only: bool = False) -> dict[str, Any]:
    """Collective: ``model.state_dict()`` of the model that ``state`` was made from, at full size, with the trained
    values. The keys and their order are exactly the model's: every name of a tied parameter (the same tensor
    under each, as in ``model.state_dict()``, so ``lm_head.weight`` is ``transformer.wte.weight``), persistent
    buffers from ``state.buffers``, non-persistent buffers left out, as ``state_dict`` leaves them out (they stay
    in ``state.buffers``). So ``model.load_state_dict(fs.full_state_dict(state))`` loads with ``strict=True``,
    tied HF models included. Every parameter is a tensor of its own (safetensors can save the dict), on the mesh's
    device, in its master dtype; buffers are copies, so the dict shares no tensor with ``state``.

    ``rank0_only=True``: only rank 0 gets the dict (the others get ``{}``), gathered to it unit by unit, so no rank
    holds more than the dict and one unit's flat buffer, and the others hold no full parameter: the export for
    inference, ``torch.save`` or safetensors on rank 0."""
    if not isinstance(state, TrainState):
        raise ArgumentError(f"fs.full_state_dict(state): state must be the fs.TrainState that fs.init or a step "
                            f"returned, not {type(state).__name__}.")
    spec = state.spec
    spec.mesh.check_alive()
    template = spec.template
    param_of = {id(p): n for n, p in template.named_parameters()}  # first (canonical) names, as in the layouts
    buffer_of = {id(b): n for n, b in template.named_buffers()}
    comm = Comm(spec.mesh, verify=True, context="fs.full_state_dict")
    try:  # a rank that fails here tells the others at their first check, where every rank raises
        entries = _entries(state, template, param_of, buffer_of)
    except Exception as e:
        comm.fail(e)
        raise
    params = _gather(state, rank0_only, comm)
    if rank0_only and spec.mesh.rank != 0:
        return {}
    buffers = {n: b.detach().clone() for n, b in state.buffers.items()}
    out = {}
    for key, t in entries.items():
        if not isinstance(t, torch.Tensor):
            out[key] = copy.deepcopy(t)  # a module's get_extra_state(), as the template holds it
        elif id(t) in param_of:
            out[key] = params[param_of[id(t)]]
        else:
            out[key] = buffers[buffer_of[id(t)]]
    return out


def _entries(state: TrainState, template, param_of: dict, buffer_of: dict) -> dict:
    """The template's state_dict entries, once the state is usable and each tensor entry is a parameter or a buffer
    (checked on every rank before any collective)."""
    state.check_usable()
    entries = template.state_dict(keep_vars=True)
    for key, t in entries.items():
        if isinstance(t, torch.Tensor) and id(t) not in param_of and id(t) not in buffer_of:
            raise ArgumentError(f"fs.full_state_dict: the model's state_dict entry {key!r} is neither a parameter "
                                "nor a buffer of the model (a state_dict hook or _save_to_state_dict made it), so "
                                "fshard has no value for it. Build the dict from fs.full_params(state) and "
                                "state.buffers instead.")
    return entries


def _gather(state: TrainState, rank0_only: bool, comm) -> dict[str, torch.Tensor]:
    """Canonical name -> full parameter with storage of its own; one flat buffer, the largest unit's, for every
    gather (with ``rank0_only``, on rank 0 only: the others return {}). Each gather is checked first (``comm`` verifies); a rank
    that fails between them tells the others at their next check."""
    spec, out = state.spec, {}
    receives = not rank0_only or spec.mesh.rank == 0
    # one buffer for every unit's gather (a view of it per unit): gloo's thread lets go of a finished gather's
    # tensors a moment after the wait, so a buffer per unit could leave two alive at once
    dtypes = {u.dtype for u in spec.units}
    bufs = {d: torch.empty(max(u.numel for u in spec.units if u.dtype == d), dtype=d, device=spec.mesh.device)
            for d in dtypes} if receives else {}
    try:
        for u in spec.units:
            flat = bufs[u.dtype][:u.numel] if receives else None
            if rank0_only:
                comm.gather_to_first(flat, resident(state.params[u.name]).to(spec.mesh.device), u.name)
            else:
                comm.all_gather(flat, resident(state.params[u.name]).to(spec.mesh.device), u.name)
            if receives:
                out.update((n, v.clone()) for n, v in views(flat, u).items())
            del flat
    except Exception as e:
        comm.fail(e)
        raise
    return out
