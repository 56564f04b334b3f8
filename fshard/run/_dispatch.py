"""How calls of the template's modules reach the step being run.

``fs.init`` replaces the ``forward`` of each unit module in the template by a ``_UnitForward`` (and that of each
routed container by a ``_GroupForward``, run/_routed_groups.py), which hands the call to the step being run: a context
variable, set only while a step runs (``StepRun._active``).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn as nn

from ..errors import ArgumentTypeError, TemplateCallError
from ..state._flat import UnitLayout

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fshard_active_step", default=None)


def bind_at(owners: dict, tensors: dict) -> list:
    """Put each tensor of ``tensors`` (template path -> tensor) in the place of the parameter or buffer of that
    name, as functional_call's swap does, with the owners resolved once (``ShardSpec.owners``); returns what
    ``unbind`` puts back. For names that are every name of each tensor (a unit's: route_units finds them by
    identity; the buffers' through ``ShardSpec.buffer_aliases``), so there is no tie left to untie, which
    functional_call's ``tie_weights`` does by walking the module tree at every call."""
    undo = []
    try:
        for name, t in tensors.items():
            where, attr = owners[name]
            undo.append((where, attr, where[attr]))
            where[attr] = t
    except BaseException:
        unbind(undo)
        raise
    return undo


def unbind(undo: list) -> None:
    """Put back what ``bind_at`` replaced, newest first, as torch's ``stack_weights`` restore: a module registered at
    two paths (``blocks[1].lin = blocks[0].lin``) is one attribute under two names, swapped twice, and restored in
    the swap order the second restore would write the bound tensor back over the original (issue #37)."""
    for where, attr, old in reversed(undo):
        where[attr] = old


@contextlib.contextmanager
def bound_at(owners: dict, tensors: dict):
    """``bind_at`` for the duration of the block."""
    undo = bind_at(owners, tensors)
    try:
        yield
    finally:
        unbind(undo)


def call_unit_bound(owners: dict, proxy: "_Proxy", tensors: dict, args, kwargs, forward=None):
    """``proxy(*args, **kwargs)`` (or ``forward(proxy.m, ...)``, compiled) with ``tensors`` (template path -> tensor)
    bound by ``bind_at`` for the call."""
    with bound_at(owners, tensors):
        if forward is None:
            return proxy(*args, **(kwargs or {}))
        return forward(proxy.m, *args, **(kwargs or {}))


class _Proxy(nn.Module):
    """Calls the unit module's own class forward, so a bound call of the unit does not recurse into the
    routed ``forward`` (and without running the module's hooks a second time)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.m = module
        self._forward = type(module).forward

    def forward(self, *args, **kwargs):
        return self._forward(self.m, *args, **kwargs)


class _UnitForward:
    def __init__(self, name: str, module: nn.Module, names: tuple[tuple[str, ...], ...]):
        self.name, self.proxy = name, _Proxy(module)
        self.names = names  # names[i]: every template path of slot i's parameter inside the unit module

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return _left_to_the_step(self, args, kwargs)
        return self.call(args, kwargs)

    def call(self, args, kwargs):
        run = _ACTIVE.get()
        if run is None:
            raise TemplateCallError(
                f"unit {self.name!r} of an fshard template was called outside a step. The template holds no data "
                "(its tensors are on the meta device); train with step = fs.compose(loss_fn), or get the weights "
                "with fs.full_params(state) and load them into a regular module.")
        return run._call_unit(self, args, kwargs)


# A compiled loss function leaves units to the step (their gathers, hooks, collectives): dynamo runs this eagerly
# (and compiles __call__ only up to it: one cache entry per unit signature, 1 for a GPT's blocks). As torch's own
# modules do, the decorator imports dynamo at its first call, not at import (dynamo, with the DTensor and sympy under
# it, was most of the 2.3 s `import fshard` took beyond torch), and a step that is not compiled never calls it.
@torch._disable_dynamo
def _left_to_the_step(unit: _UnitForward, args, kwargs):
    return unit.call(args, kwargs)


def route_units(template: nn.Module, layouts: list[UnitLayout]) -> None:
    """Route the forward of each unit module of the template through the active step. Each slot's names inside the
    unit module are found by identity, so tied parameters and modules shared at several paths bind correctly."""
    for u in layouts:
        if not u.module:
            continue
        module = template.get_submodule(u.module)
        local = list(module.named_parameters(remove_duplicate=False))
        names = tuple(tuple(f"{u.module}.{n}" for n, p in local if p is template.get_parameter(s.name))
                      for s in u.slots)
        module.forward = _UnitForward(u.name, module, names)


class UnitCompiler:
    """``fs.compose(compile=)``: each unit class's forward compiled once with ``torch.compile(**options)`` and called
    on the bound unit module (``call_unit_bound(forward=)``). Keyed by the class's forward function, so the units of one
    class (a GPT's blocks) share one compiled function, whose graphs take the gathered parameters as inputs
    (torch.compile's inlining of built-in modules: parameters are inputs, not constants) and are reused across
    units and steps."""

    def __init__(self, options: bool | dict):
        if options is True:
            options = {}
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise ArgumentTypeError(f"fs.compose(compile={options!r}): pass True (torch.compile's defaults) or a dict "
                                    "of torch.compile's keyword arguments, e.g. compile={'mode': 'max-autotune'}.")
        self.options, self._forwards = dict(options), {}

    def __call__(self, proxy: "_Proxy"):
        fn = proxy._forward
        if fn not in self._forwards:
            self._forwards[fn] = torch.compile(fn, **self.options)
        return self._forwards[fn]
