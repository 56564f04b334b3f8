"""Routed units: experts as units, though each rank's tokens pick different ones.

A mixture-of-experts layer calls only the experts its tokens are routed to, and routing differs per rank. With one
unit per expert, each rank would gather and reduce a different set of units, and the ranks' collectives would not
match (gloo aborts on the first size mismatch). ``fs.init(..., routed=[container, ...])`` names the modules that
call a data-dependent subset of their children (transformers' ``SwitchTransformersExperts``): each child becomes a
unit, a *member* of the container's group, and the group moves as one at points every rank reaches, since every
rank calls the container itself:

- **forward**: a call of the container gathers every member, in a fixed order, and frees them after the call;
  members called inside bind their (already gathered) parameters and raise no gather events of their own;
- **backward**: when a gradient reaches the container's outputs, every member is gathered again (one event
  each, in the same order); when backward has finished the call (``_recompute.through``'s node on the call's inputs,
  whose first output feeds each member's ``_Gather`` node, so it also waits for the gradient of every member used
  here, whatever order autograd picks among ready nodes), every member is reduced in order, a member
  no token reached on this rank with a zero gradient, as DDP's ``find_unused_parameters`` does, and freed.

Members used by no rank get no update (``active`` is False everywhere), as torch skips a parameter without a
gradient. A container called twice in one micro-batch reduces at the end of its first call's backward.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import ArgumentError, InitError, TemplateCallError
from ._recompute import produced, through
from ._dispatch import _ACTIVE, _Proxy


def routed_groups(model: nn.Module, routed, unit_mods: list) -> list[tuple[str, tuple[str, ...]]]:
    """(container path, member paths) per routed container: its children with parameters, the children of a
    child ModuleList or ModuleDict (which nobody calls) in its place. Members that are not units yet are appended
    to ``unit_mods`` ((path, module), as fs.init's default units may already hold them). A container with no such
    child (fused experts: one module of 3-D parameters) is an ArgumentError, not an empty group."""
    if routed is None:
        return []
    paths = {id(m): p for p, m in model.named_modules()}
    have = {id(m) for _, m in unit_mods}
    groups = []
    for r in routed:
        try:
            m = model.get_submodule(r) if isinstance(r, str) else r
        except AttributeError:
            m = None
        uncalled = isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward
        if m is None or id(m) not in paths or m is model or id(m) in have or uncalled:
            raise InitError(f"fs.init(routed=...): {r!r} is not a submodule of the model that is called, or is "
                            "itself a unit. Pass the module that calls a data-dependent subset of its children (the "
                            "experts container, e.g. 'encoder.block.1.layer.1.mlp.experts'); each child with "
                            "parameters becomes a unit.")
        members = []
        for child in _members(m):
            if any(True for _ in child.parameters()):
                if id(child) not in have:
                    have.add(id(child))
                    unit_mods.append((paths[id(child)], child))
                members.append(paths[id(child)])
        if not members:
            raise ArgumentError(_no_members(paths[id(m)], m))
        groups.append((paths[id(m)], tuple(members)))
    return groups


def _no_members(path: str, m: nn.Module) -> str:
    """Why a routed container without a child holding parameters is refused: its group would be empty, so
    ``routed=`` would do nothing. The usual cause is fused experts (transformers 5's MoE layers)."""
    fused = [f"{n} {tuple(p.shape)}" for n, p in m.named_parameters() if p.dim() >= 3]
    head = (f"fs.init(routed=[{path!r}]): {type(m).__name__} has no child module with parameters, so no expert "
            "would become a unit and routed= would do nothing.")
    if not fused:
        return (f"{head} Pass the module that calls a data-dependent subset of its children, each expert a child "
                "module with parameters (e.g. SwitchTransformersExperts), or drop it from routed=.")
    return (f"{head} Its experts are fused: 3-D parameters holding every expert at once ({', '.join(fused[:3])}), as "
            "transformers 5 keeps them (Qwen3-MoE, DeepSeek-V3, GPT-OSS, Llama 4, Mixtral). Such a module is not "
            "routed: it is gathered whole at each call, with the unit it lies in (by default its decoder layer), and "
            "every rank calls it, so the ranks' collectives match without routed=. Drop it from routed= (pass "
            f"nothing), or pass units=[..., {path!r}] to make it a unit of its own, gathered only for its call.")


def _members(m: nn.Module):
    for child in m.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and type(child).forward is nn.Module.forward:
            yield from _members(child)
        else:
            yield child


class _GroupForward:
    """The routed ``forward`` of a container module: hands the call to the step being run."""

    def __init__(self, path: str, module: nn.Module, members: tuple[str, ...]):
        self.path, self.proxy, self.members = path, _Proxy(module), members

    def __call__(self, *args, **kwargs):
        run = _ACTIVE.get()
        if run is None:
            raise TemplateCallError(f"module {self.path!r} of an fshard template was called outside a step; train "
                                    "with step = fs.compose(loss_fn), or load fs.full_params(state) into a module.")
        return call_group(run, self, args, kwargs)


def route_groups(template: nn.Module, groups) -> None:
    for path, members in groups:
        module = template.get_submodule(path)
        module.forward = _GroupForward(path, module, members)


class GroupCall:
    """One call of a container in one micro-batch's forward."""

    def __init__(self, run, route: _GroupForward):
        self.run, self.route = run, route
        self.anchor = torch.zeros((), device=run.spec.mesh.device, requires_grad=True)
        self.done = False


def call_group(run, route: _GroupForward, args, kwargs):
    members = [run.units[n] for n in route.members]
    gather = run._policy.gather
    if run.phase == "backward":  # a recompute (activation checkpointing): the group's backward use begins
        for u in members:
            run._begin_backward(u, group=True)
        return _in_group(run, members, route, args, kwargs)
    call = None
    if torch.is_grad_enabled() and run.training:
        call = GroupCall(run, route)
        run._group_calls.append(call)
        call.anchor_out, args, kwargs = through(lambda: group_done(run, call), args, kwargs, call.anchor)
    for u in members:
        run.order.append(u.name)
        if call is not None and u._flat is None:
            u._anchor = call.anchor_out
        gather.before_forward(run, u)
    out = _in_group(run, members, route, args, kwargs)
    if call is not None:
        for t in produced(out, args, kwargs):
            t.register_hook(_pre_backward(run, members))
    for u in members:
        gather.after_forward(run, u)
    return out


def _in_group(run, members, route, args, kwargs):
    for u in members:
        u._group_depth += 1
    try:
        return route.proxy(*args, **kwargs)
    finally:
        for u in members:
            u._group_depth -= 1


def _pre_backward(run, members):
    def hook(_grad):
        for u in members:
            run._begin_backward(u, group=True)
    return hook


def group_done(run, call: GroupCall) -> None:
    """Backward has finished ``call``: in the last micro-batch reduce every member in order (zero where this rank
    did not use it), then end the members' backward use. Earlier calls of the same container wait for theirs."""
    if call.done:
        return
    call.done = True
    members = [run.units[n] for n in call.route.members]
    pending = [c for c in run._group_calls if c.route is call.route and not c.done]
    if not pending and run.last:
        for u in members:
            grad = run._acc.take(u.name, u._stash) if u._stash is not None else run._acc.grads.pop(u.name, None)
            u._stash = None
            if grad is None:  # no token reached it on this rank: a zero gradient, so every rank reduces it
                grad = torch.zeros(u.layout.numel, dtype=run.param_dtype or u.layout.dtype, device=u.shard.device)
            run._reduce(u, grad)
    for u in members:
        run._reading.discard(u.name)
        run._policy.gather.after_backward(run, u)


def finish_groups(run) -> None:
    """After backward: calls whose node autograd never reached (no input needed a gradient and no member was
    used here) end now, in call order."""
    for call in list(reversed(run._group_calls)):
        group_done(run, call)
