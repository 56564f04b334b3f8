"""How calls of the template's modules reach the step being run.

``fs.init`` replaces the ``forward`` of each unit module in the template by a ``_UnitForward`` (and that of each
routed container by a ``_GroupForward``, run/_routed_groups.py), which hands the call to the step being run: a context
variable, set only while a step runs (``StepRun._active``).
"""
from __future__ import annotations

import contextvars

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from ..errors import ArgumentTypeError, TemplateCallError
from ..state._flat import UnitLayout

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fshard_active_step", default=None)


def call_bound(module: nn.Module, tensors: dict, args=(), kwargs=None, forward=None):
    """``module(*args, **kwargs)`` with ``tensors`` (name -> tensor) in place of its parameters and buffers, as
    ``torch.func.functional_call`` (every name of a tied tensor bound), but the originals put back in the reverse
    order (torch's own ``stack_weights`` restore). functional_call puts them back in the order it swapped: a module
    registered at two paths (``blocks[1].lin = blocks[0].lin``) is one attribute under two names, whose second
    restore wrote the bound tensor back over the original, left in the template after the call (issue #37).
    ``forward``: a ``_Proxy``'s class forward compiled (``fs.compose(compile=)``), called on the bound unit module
    in place of the proxy's own call."""
    with _reparametrize_module(module, tensors, tie_weights=True, stack_weights=True):
        if forward is None:
            return module(*args, **(kwargs or {}))
        return forward(module.m, *args, **(kwargs or {}))


class _Proxy(nn.Module):
    """Calls the unit module's own class forward, so functional_call can bind the unit without recursing into the
    routed ``forward`` (and without running the module's hooks a second time)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.m = module
        self._forward = type(module).forward

    def forward(self, *args, **kwargs):
        return self._forward(self.m, *args, **kwargs)


class _UnitForward:
    def __init__(self, name: str, module: nn.Module, names: tuple[tuple[str, ...], ...]):
        self.name, self.proxy, self.names = name, _Proxy(module), names  # names[i]: slot i's names in the unit

    @torch.compiler.disable  # a compiled loss function leaves units to the step (their gathers, hooks, collectives)
    def __call__(self, *args, **kwargs):
        run = _ACTIVE.get()
        if run is None:
            raise TemplateCallError(
                f"unit {self.name!r} of an fshard template was called outside a step. The template holds no data "
                "(its tensors are on the meta device); train with step = fs.compose(loss_fn), or get the weights "
                "with fs.full_params(state) and load them into a regular module.")
        return run._call_unit(self, args, kwargs)


def route_units(template: nn.Module, layouts: list[UnitLayout]) -> None:
    """Route the forward of each unit module of the template through the active step. Each slot's names inside the
    unit module are found by identity, so tied parameters and modules shared at several paths bind correctly."""
    for u in layouts:
        if not u.module:
            continue
        module = template.get_submodule(u.module)
        local = list(module.named_parameters(remove_duplicate=False))
        names = tuple(tuple(n for n, p in local if p is template.get_parameter(s.name)) for s in u.slots)
        module.forward = _UnitForward(u.name, module, names)


class UnitCompiler:
    """``fs.compose(compile=)``: each unit class's forward compiled once with ``torch.compile(**options)`` and called
    on the bound unit module (``call_bound(forward=)``). Keyed by the class's forward function, so the units of one
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
