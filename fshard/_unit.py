"""One step's runtime for the units: gather, bind through functional_call, free, re-gather in backward, reduce.

How a unit's parameters reach the module: ``fs.init`` replaces the ``forward`` of each unit module in the template
by a ``_UnitForward``, which hands the call to the step being run (a context variable, set only while a step runs).
The step gathers the unit's flat buffer, binds views of it with ``torch.func.functional_call`` and, after the call,
frees the buffer's storage (``resize_(0)``, as FSDP does). Autograd still needs the parameters in backward: a
saved-tensors hook replaces every saved tensor that lives in a gathered buffer by a small handle, and unpacking that
handle re-gathers the unit. The gradient of the whole flat buffer arrives in one piece at ``_Gather.backward``,
which hands it to the reduce policy and frees the buffer again.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn as nn
from torch.func import functional_call

from ._errors import TemplateCallError
from ._layout import UnitLayout, views

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fshard_active_step", default=None)


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

    def __call__(self, *args, **kwargs):
        run = _ACTIVE.get()
        if run is None:
            raise TemplateCallError(
                f"unit {self.name!r} of an fshard template was called outside a step. The template holds no data "
                "(its tensors are on the meta device); train with step = fs.compose(loss_fn), or get the weights "
                "with fs.full_params(state) and load them into a regular module.")
        return run.call_unit(self, args, kwargs)


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


class _Gather(torch.autograd.Function):
    """shard -> full flat buffer, as autograd sees it. The data is gathered by ``UnitRun.launch`` into the unit's
    buffer; this node is made at the unit's first use, so that its place in backward (autograd runs ready nodes
    newest first) follows the unit's compute rather than the earlier moment its gather was launched. Backward
    receives the gradient of the whole buffer once all uses of the unit (a unit may run twice in one forward) have
    produced theirs."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        return unit.alias()  # a new tensor on the gathered buffer's storage (not a view of an input)

    @staticmethod
    def backward(ctx, grad):
        unit, ctx.unit = ctx.unit, None  # the node must not keep the step's runtime alive
        run = unit.run
        if run.last:
            run.policy.reduce.reduce(run, unit, run.acc.take(unit.layout.name, grad))
        else:  # more micro-batches follow: sum locally, reduce once in the last one (DDP's no_sync)
            run.acc.add(unit.layout.name, grad)
        return None, None


class Accumulator:
    """One step's gradients summed over its micro-batches before their one reduction, and which parameters got
    a gradient in any of them. With one micro-batch it stays empty."""

    def __init__(self, k: int):
        self.k = k
        self.grads: dict[str, torch.Tensor] = {}
        self.got: dict[str, list[bool]] = {}

    def add(self, name: str, grad: torch.Tensor) -> None:
        acc = self.grads.get(name)
        self.grads[name] = grad if acc is None else acc.add_(grad)  # autograd hands over the first one

    def got_so_far(self, name: str, got: list[bool]) -> list[bool]:
        """Which parameters got a gradient in the earlier micro-batches or in this one (``got``)."""
        prev = self.got.get(name)
        return list(got) if prev is None else [a or b for a, b in zip(prev, got)]

    def take(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        acc = self.grads.pop(name, None)
        return grad if acc is None else acc.add_(grad)


class _Saved:
    """A saved tensor that lives in a unit's gathered buffer: kept as a handle, re-gathered on unpack."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit, tensor):
        self.unit, self.tensor = unit, tensor


class UnitRun:
    """One unit during one step."""

    def __init__(self, run: "StepRun", layout: UnitLayout, shard: torch.Tensor):
        self.run, self.layout = run, layout
        self.trainable = bool(layout.trainable)
        self.shard = shard.detach().requires_grad_(self.trainable)
        self.buf: torch.Tensor | None = None   # the gathered buffer (storage freed and refilled in place)
        self.flat: torch.Tensor | None = None  # the same storage as autograd's output of _Gather (first use on)
        self.alive = False
        self.pending = None  # the Flight of a gather into ``buf`` that nobody has waited on yet
        self.grad: torch.Tensor | None = None
        self.got = [False] * len(layout.trainable)

    def alias(self) -> torch.Tensor:
        """A new tensor object on the gathered buffer's storage (its own version counter)."""
        return torch.empty(0, dtype=self.layout.dtype, device=self.buf.device).set_(
            self.buf.untyped_storage(), 0, (self.layout.numel,))

    def launch(self) -> None:
        """Make the gathered buffer live and start filling it; returns at once. ``acquire`` waits for the data."""
        if self.alive:
            return
        comm = self.run.comm
        with comm.gather_scope():
            if self.buf is None:
                self.buf = torch.empty(self.layout.numel, dtype=self.layout.dtype, device=self.shard.device)
            else:  # storage was freed: refill it in place, so every tensor on it (flat, views) sees the data
                self.buf.untyped_storage().resize_(self.layout.nbytes)
            self.pending = comm.gather(self.alias(), self.shard.detach(), self.layout.name)
        self.alive = True
        self.run.on_alive(self, +1)

    def acquire(self) -> None:
        """Make the gathered buffer live and its data ready (gathering it now if nobody launched it)."""
        self.launch()
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.flat is None:
            if self.trainable:
                with torch.enable_grad():  # even if this first use runs under no_grad, later uses need the node
                    self.flat = _Gather.apply(self.shard, self)
            else:
                self.flat = self.buf

    def release(self) -> None:
        if self.alive:
            if self.pending is not None:  # a gather still writing into this buffer must finish first
                self.pending.wait()
                self.pending = None
            self.run.on_alive(self, -1)
            self.run.comm.before_free()
            self.buf.untyped_storage().resize_(0)
            self.alive = False

    def bind(self, names) -> dict[str, torch.Tensor]:
        """name -> view of the gathered buffer, for each slot's ``names[i]``. Trainable views carry a hook that
        records that they got a gradient (torch skips a parameter whose .grad is None; so do we)."""
        assert self.alive, "bind() before acquire()"
        use = self.flat.view_as(self.flat)
        if use.requires_grad:  # (not under torch.no_grad)
            # One view per use: its gradient is complete once this use's backward is done, which is when the
            # buffer can be freed (a later use's saved tensors re-gather it), so a unit used twice does not stay
            # gathered while the units between its two uses run backward.
            use.register_hook(self._use_done)
        trainable = views(use, self.layout)
        frozen = views(self.flat.detach(), self.layout) if len(self.layout.trainable) < len(self.layout.slots) else {}
        out, k = {}, 0
        for s, slot_names in zip(self.layout.slots, names):
            if s.requires_grad:
                v = trainable[s.name]
                if v.requires_grad:
                    v.register_hook(self._marker(k))
                k += 1
            else:
                v = frozen[s.name]
            out.update({n: v for n in slot_names})
        return out

    def _use_done(self, _grad):
        self.run.policy.gather.after_backward(self.run, self)

    def _marker(self, k: int):
        def mark(_grad):
            self.got[k] = True
        return mark


class StepRun:
    """All units of one step: routing target, saved-tensor hooks, and the gathered-bytes counter."""

    def __init__(self, spec, params: dict[str, torch.Tensor], comm, policy, acc: Accumulator | None = None,
                 last: bool = True, opt_state: dict | None = None):
        self.spec, self.comm, self.policy = spec, comm, policy
        self.acc, self.last = acc if acc is not None else Accumulator(1), last
        self.opt_state = opt_state if opt_state is not None else {}  # the input state's, for updates that start early
        self.early: dict = {}  # unit name -> update work begun during backward (the update policy's ``overlap``)
        self.units = {u.name: UnitRun(self, u, params[u.name]) for u in spec.units}
        self._live: dict[int, UnitRun] = {}
        self.live_bytes = self.peak_bytes = 0
        self.phase = "forward"  # the step sets "backward" once forward has returned
        self.phase_peak = {"forward": 0, "backward": 0}
        self.order: list[str] = []  # units in the order forward used them

    def on_alive(self, unit: UnitRun, sign: int) -> None:
        ptr = unit.buf.untyped_storage().data_ptr()
        if sign > 0:
            self._live[ptr] = unit
        else:
            self._live.pop(ptr, None)
        self.live_bytes += sign * unit.layout.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.phase_peak[self.phase] = max(self.phase_peak[self.phase], self.live_bytes)

    def call_unit(self, route: _UnitForward, args, kwargs):
        unit, gather = self.units[route.name], self.policy.gather
        self.order.append(route.name)
        gather.before_forward(self, unit)
        out = functional_call(route.proxy, {"m." + k: v for k, v in unit.bind(route.names).items()}, args, kwargs)
        gather.after_forward(self, unit)
        return out

    @contextlib.contextmanager
    def active(self):
        token = _ACTIVE.set(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _ACTIVE.reset(token)

    def _pack(self, t: torch.Tensor):
        try:
            unit = self._live.get(t.untyped_storage().data_ptr()) if self._live else None
        except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, nested)
            unit = None
        return t if unit is None else _Saved(unit, t)

    def _unpack(self, x):
        if isinstance(x, _Saved):
            self.policy.gather.before_backward(self, x.unit)
            return x.tensor
        return x

    def grad_final(self, unit: UnitRun) -> None:
        """The reduce policy calls this once ``unit.grad`` holds the unit's final gradient shard. In the last
        micro-batch, an update policy with an ``overlap`` hook may start that unit's update now, while backward
        goes on."""
        hook = getattr(self.policy.update, "overlap", None)
        if self.last and hook is not None:
            hook(self, unit)

    def got_all(self, unit: UnitRun) -> bool:
        """Did every trainable parameter of the unit get a gradient on this rank, in any micro-batch so far? Then
        it is active on every rank too (the agreement after backward is an OR over ranks)."""
        got = self.acc.got_so_far(unit.layout.name, unit.got)
        return bool(got) and all(got)

    def end_backward(self) -> None:
        """After this micro-batch's backward. In the last one, units that got a gradient only in earlier
        micro-batches are reduced now (in unit order), then the reduce policy completes every reduction."""
        if self.last:
            for u in self.spec.units:
                if u.name in self.acc.grads:
                    self.policy.reduce.reduce(self, self.units[u.name], self.acc.grads.pop(u.name))
            self.policy.reduce.finish(self)
        if self.acc.k > 1:
            for name, u in self.units.items():
                self.acc.got[name] = self.acc.got_so_far(name, u.got)

    def release_all(self) -> None:
        for unit in self.units.values():
            unit.release()

    def close(self) -> None:
        """Drop every tensor this step's runtime holds and break its reference cycles (StepRun <-> UnitRun, and
        flat buffer -> autograd node -> UnitRun), so a finished step frees its memory at once, not at the next
        cycle collection."""
        early, self.early = self.early, {}
        for work in early.values():  # begun during backward but not taken by the update (the step failed)
            work.abandon()
        for unit in self.units.values():
            unit.release()
            unit.flat = unit.buf = unit.grad = unit.shard = unit.run = None
        self.units.clear()
        self._live.clear()
