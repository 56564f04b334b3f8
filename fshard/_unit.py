"""One step's runtime for the units: gather, bind through functional_call, free, re-gather in backward, reduce.

How a unit's parameters reach the module: ``fs.init`` replaces the ``forward`` of each unit module in the template
by a ``_UnitForward``, which hands the call to the step being run (a context variable, set only while a step runs).
The step gathers the unit's flat buffer, binds views of it with ``torch.func.functional_call`` and, after the call,
frees the buffer's storage (``resize_(0)``, as FSDP does). Autograd still needs the parameters in backward: a
saved-tensors hook replaces every saved tensor that lives in a gathered buffer by a small handle, and unpacking that
handle re-gathers the unit. The gradient of the whole flat buffer arrives in one piece at ``_Gather.backward``,
which hands it to the reduce policy and frees the buffer again. Activation checkpointing (a recompute in backward)
is covered by fshard/_recompute.py's hooks.
"""
from __future__ import annotations

import contextlib
import threading
import time

import optree
import torch
from torch.func import functional_call

from ._base import StepView, UnitView
from ._collectives import CollectivesView
from ._errors import PolicyError, RecomputeError, TemplateCallError
from ._layout import UnitLayout, views
from ._reads import Launches, Reader
from ._recompute import attach, detach, produced, through
from ._route import _ACTIVE, _UnitForward
from ._routed import finish_groups
from ._stored import StoredParam

def _storage_id(t: torch.Tensor) -> int:
    """Which storage ``t`` lives in: its StorageImpl's address, shared by every view and kept when the storage is
    resized (a data pointer is neither: a freed buffer refilled moves, and meta storages all point at 0)."""
    return t.untyped_storage()._cdata


class _Gather(torch.autograd.Function):
    """shard -> full flat buffer, as autograd sees it. The data is gathered by ``UnitRun.launch`` into the unit's
    buffer; this node is made at the unit's first use, so that its place in backward (autograd runs ready nodes
    newest first) follows the unit's compute rather than the earlier moment its gather was launched. Backward
    receives the gradient of the whole buffer once all uses of the unit (a unit may run twice in one forward) have
    produced theirs."""

    @staticmethod
    def forward(ctx, shard, unit, anchor=None):
        ctx.unit, ctx.anchored = unit, anchor is not None  # anchor: a routed group's (fshard/_routed.py)
        return unit._alias()  # a new tensor on the gathered buffer's storage (not a view of an input)

    @staticmethod
    def backward(ctx, grad):
        unit, ctx.unit = ctx.unit, None  # the node must not keep the step's runtime alive
        if unit is None:  # run twice: two separate backward passes reached the node
            raise RecomputeError(
                "a unit got its gradient in two pieces in one micro-batch: a reentrant activation checkpoint "
                "(torch.utils.checkpoint(..., use_reentrant=True)) differentiates its region in a backward pass of "
                "its own, and a unit is used inside two such regions (or inside one and outside it). Use "
                "use_reentrant=False (transformers' default for gradient_checkpointing_enable()), or make each "
                "checkpointed region use its own units.")
        unit._run._grad_arrived(unit, grad)
        return None, None, (grad.new_zeros(()) if ctx.anchored else None)


class _Saved:
    """A saved tensor that lives in a unit's gathered buffer: kept as a handle, re-gathered on unpack."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit, tensor):
        self.unit, self.tensor = unit, tensor



class UnitRun(UnitView):
    """One unit during one micro-batch: the ``UnitView`` that policies see, and the gather/bind/free mechanics."""

    def __init__(self, run: "StepRun", layout: UnitLayout, shard, copy: torch.Tensor | None = None):
        self._run, self.layout, self.name = run, layout, layout.name
        self.trainable = bool(layout.trainable)
        # A shard in a store (offload_state(params=True)) is read at each gather and dropped once gathered; autograd's
        # leaf is then a tensor of the shard's shape without storage (it is never read: gradients end in the unit).
        self._stored = shard if isinstance(shard, StoredParam) else None
        if self._stored is not None:
            shard = torch.empty(layout.shard_numel, dtype=layout.dtype, device=run.spec.mesh.device)
            shard.untyped_storage().resize_(0)
        self.shard = shard.detach().requires_grad_(self.trainable and run.training)  # an eval pass: no graph
        self._copy = copy  # the state's low-precision copy of the shard (TrainState.copies), gathered in its place
        self.alive = False
        self._buf: torch.Tensor | None = None   # the gathered buffer (storage freed and refilled in place)
        self._flat: torch.Tensor | None = None  # the same storage as autograd's output of _Gather (first use on)
        self._pending = None  # the Flight of a gather into ``_buf`` that nobody has waited on yet
        self._read = None  # the Future of the reader's read of a stored shard, until its gather is issued
        self._held = 0  # bytes of the read shard a gather in flight holds
        self._queued = False  # launched, its gather not issued yet (fshard/_reads.py)
        self._grad: torch.Tensor | None = None
        self._got = [False] * len(layout.trainable)
        self._attached: list | None = None  # in backward, the module's parameters set to views of the buffer
        self._member = layout.name in run._grouped  # a member of a routed group (fshard/_routed.py)
        self._anchor = self._stash = None  # the group call's anchor for _Gather; the gradient until the group's end
        self._group_depth = 0  # calls of its group under way

    @property
    def grad(self) -> torch.Tensor | None:
        return self._grad

    @property
    def in_flight(self) -> bool:
        return self._pending is not None or self._queued

    def got_all(self) -> bool:
        got = self._run._acc.got_so_far(self.name, self._got)
        return bool(got) and all(got)

    def _alias(self) -> torch.Tensor:
        """A new tensor object on the gathered buffer's storage (its own version counter)."""
        return torch.empty(0, dtype=self._buf.dtype, device=self._buf.device).set_(
            self._buf.untyped_storage(), 0, (self.layout.numel,))

    def launch(self) -> None:
        if self.alive:
            return
        run, comm, dtype = self._run, self._run._comm, self._run._param_dtype or self.layout.dtype
        with comm.gather_scope():
            if self._buf is None:
                self._buf = torch.empty(self.layout.numel, dtype=dtype, device=self.shard.device)
            else:  # storage was freed: refill it in place, so every tensor on it (flat, views) sees the data
                self._buf.untyped_storage().resize_(self.layout.numel * self._buf.element_size())
        if self._stored is not None:  # read ahead on the reader thread, freed once the gather has copied it
            self._held = self._stored.numel * dtype.itemsize  # the shard read, in the compute dtype
            run._read_bytes += self._held
            run._read_peak = max(run._read_peak, run._read_bytes)
            run._loaded_bytes += self._stored.nbytes
            if run._reader is not None and not comm.dry:
                self._read = run._reader.read(self._stored, dtype, run.record, f"read {self.name}")
        self.alive = True
        run._on_alive(self, +1)
        self._queued = True
        run._launches.queue.append(self)  # gathers are issued in launch order (fshard/_reads.py)
        run._launches.pump()

    def _read_done(self) -> bool:
        return self._read is None or self._read.done()

    def _issue(self) -> None:
        """Issue the gather of a launched unit (its read, if any, done: waited for here)."""
        self._queued = False
        comm, dtype = self._run._comm, self._run._param_dtype or self.layout.dtype
        if self._stored is not None:
            if comm.dry:  # step.plan: counted, not read
                shard = torch.empty(self._stored.numel, dtype=dtype, device="meta")
            elif self._read is None:  # no reader: read here
                shard = self._stored.load(dtype).to(self.shard.device)
            else:
                read, self._read = self._read, None
                shard = read.result().to(self.shard.device)
        else:
            shard = self.shard.detach() if self._copy is None or self._copy.dtype != dtype else self._copy
        if shard.dtype != dtype:  # mixed precision: each gather casts the master shard (timed on a timeline)
            t0 = time.perf_counter()
            shard = shard.to(dtype)
            if comm.spans is not None:
                comm.span("cast", f"cast {self.name}", t0, time.perf_counter())
        with comm.gather_scope():
            self._pending = comm.gather(self._alias(), shard, self.name)

    def _abandon_read(self) -> None:
        self._queued = False
        read, self._read = self._read, None
        if read is not None:
            try:
                read.result()
            except BaseException:  # noqa: BLE001 - the step already failed for its own reason
                pass

    def _gathered(self) -> None:
        """Wait for the gather in flight; the shard read for it is gone with it."""
        self._pending.wait()
        self._pending = None
        self._run._read_bytes -= self._held
        self._held = 0

    def acquire(self) -> None:
        self.launch()
        if self._queued:
            self._run._launches.pump(until=self)
        if self._pending is not None:
            self._gathered()
        if self._flat is None:
            if self.shard.requires_grad:
                with torch.enable_grad():  # even if this first use runs under no_grad, later uses need the node
                    self._flat = _Gather.apply(self.shard, self, self._anchor)
            else:
                self._flat = self._buf
        if self._attached is None and self._run.phase == "backward":  # a recompute may read the module's tensors
            with torch.enable_grad():  # requires_grad as in forward, so a recompute saves the same tensors
                # a use of its own: a reentrant checkpoint differentiates its recompute, through these views
                bound = self._bind([s.aliases for s in self.layout.slots])
            self._attached = attach(self._run.spec.template, bound)

    def release(self) -> None:
        if self._attached is not None:
            detach(self._attached)
            self._attached = None
        if self.alive:
            if self._queued:  # launched, not issued yet: every rank issues it, so this one does too
                self._run._launches.pump(until=self)
            if self._pending is not None:  # a gather still writing into this buffer must finish first
                self._gathered()
            self._run._on_alive(self, -1)
            self._run._comm.before_free()
            self._buf.untyped_storage().resize_(0)
            self.alive = False

    def _bind(self, names) -> dict[str, torch.Tensor]:
        """name -> view of the gathered buffer, for each slot's ``names[i]``. Trainable views carry a hook that
        records that they got a gradient (torch skips a parameter whose .grad is None; so do we)."""
        assert self.alive, "bind() before acquire()"
        use = self._flat.view_as(self._flat)
        if use.requires_grad:  # (not under torch.no_grad)
            # One view per use: its gradient is complete once this use's backward is done, which is when the
            # buffer can be freed (a later use's saved tensors re-gather it), so a unit used twice does not stay
            # gathered while the units between its two uses run backward.
            use.register_hook(self._use_done)
        bound, out, k = self._views(use), {}, 0
        for s, slot_names in zip(self.layout.slots, names):
            v = bound[s.name]
            if s.requires_grad:
                if v.requires_grad:
                    v.register_hook(self._marker(k))
                k += 1
            out.update({n: v for n in slot_names})
        return out

    def _views(self, use: torch.Tensor) -> dict[str, torch.Tensor]:
        """Slot name -> view: trainable slots of ``use``, frozen ones of the buffer (no gradient)."""
        out = views(use, self.layout)
        if len(self.layout.trainable) < len(self.layout.slots):
            frozen = views(self._flat.detach(), self.layout)
            out.update({s.name: frozen[s.name] for s in self.layout.slots if not s.requires_grad})
        return out

    def _use_done(self, _grad):
        if self._member or self._run is None:  # its group ends the use; the step has ended
            return
        self._run._reading.discard(self.name)
        self._run._policy.gather.after_backward(self._run, self)

    def _marker(self, k: int):
        def mark(_grad):
            self._got[k] = True
        return mark


class StepRun(StepView):
    """One micro-batch of a step: the ``StepView`` that policies see, the routing target of unit calls, the
    saved-tensor hooks, and the gathered-bytes counter."""

    def __init__(self, state, comm, policy, acc: "Accumulator", scratch: dict, last: bool, training: bool = True,
                 donate: bool = False, reader: Reader | None = None):
        self.spec, self.state, self.last, self.training, self.donate = state.spec, state, last, training, donate
        self._launches = Launches()  # launched units whose gathers wait for their reads (fshard/_reads.py)
        # the step's Comm; what policies may use of it (issuing the launched gathers first: one order on every rank)
        self._comm, self.comm = comm, CollectivesView(comm, before=self._launches.flush)
        self.grads_unchanged, self.grads_unread = policy.grads_unchanged, policy.grads_unread
        self._param_dtype = policy.gather.param_dtype  # None: units compute in their own dtype
        self.phase = "forward"  # the step sets "backward" once forward has returned
        self.order: list[str] = []  # units in the order forward used them
        self._backward_order: list[str] = []  # units in the order backward began reading them (one entry per use)
        self._reading: set[str] = set()  # units whose current backward use has begun and not finished
        self._policy, self._acc, self._scratch = policy, acc, scratch
        self._grouped = {n for _, members in state.spec.groups for n in members}
        self.units = {u.name: UnitRun(self, u, state.params[u.name], state.copies.get(u.name))
                      for u in self.spec.units}
        self._reduced: list[UnitRun] = []  # units given to the reduce policy, to check each was handed back
        self._live: dict[int, UnitRun] = {}
        self._live_bytes = self._peak_bytes = 0
        self._unit_grad_bytes = 0  # the largest gradient of a whole unit that backward produced
        self._loaded_bytes = 0  # parameter shards read from a store for gathers (offload_state(params=True))
        self._grad_held = self._grad_peak = 0  # gradient-shard bytes held now, and at most at once
        self._grad_lock = threading.Lock()
        self._reader = reader  # reads the shards held in a store
        self._read_bytes = self._read_peak = 0  # parameter shards read from a store (or being read) for gathers
        self._activations: dict[int, int] = {}  # storages forward saved for backward (not units'): their bytes
        self._phase_peak = {"forward": 0, "backward": 0}
        self._group_calls: list = []  # calls of routed containers in this micro-batch's forward

    def scratch(self, owner: object) -> dict:
        return self._scratch.setdefault(id(owner), {})

    def record(self, lane: str, label: str, t0: float, t1: float) -> None:
        self._comm.span(lane, label, t0, t1)

    def grad_ready(self, unit: UnitRun, shard: torch.Tensor) -> None:
        if unit._grad is not None:
            raise PolicyError(f"the reduce policy {type(self._policy.reduce).__name__} handed over unit "
                              f"{unit.name!r}'s gradient shard twice in one step; hand it over once.")
        if shard.numel() != unit.layout.shard_numel or shard.dtype != unit.layout.dtype:
            raise PolicyError(f"the reduce policy {type(self._policy.reduce).__name__} handed over {shard.numel()} "
                              f"elements of {shard.dtype} as the gradient shard of unit {unit.name!r}, whose shard "
                              f"has {unit.layout.shard_numel} of {unit.layout.dtype}.")
        unit._grad = shard
        with self._grad_lock:  # (grad_freed comes from an update's worker thread)
            self._grad_held += shard.nbytes
            self._grad_peak = max(self._grad_peak, self._grad_held)
        if self.last:
            self._policy.update.overlap(self, unit)

    def grad_freed(self, unit: UnitRun) -> None:
        with self._grad_lock:
            self._grad_held -= unit.layout.shard_numel * unit.layout.dtype.itemsize

    def _grad_arrived(self, unit: UnitRun, grad: torch.Tensor) -> None:
        """A unit's whole gradient, once every use of it has contributed: reduced now in the last micro-batch;
        otherwise summed locally, to be reduced once in the last one (DDP's no_sync)."""
        self._unit_grad_bytes = max(self._unit_grad_bytes, grad.nbytes)
        if unit._member and self.last:  # reduced when its group's call ends, in the group's order
            unit._stash = grad
        elif self.last:
            self._reduce(unit, self._acc.take(unit.name, grad))
        else:
            self._acc.add(unit.name, grad, self._policy.reduce.reduce_dtype)

    def _reduce(self, unit: UnitRun, grad: torch.Tensor) -> None:
        self._reduced.append(unit)
        self._policy.reduce.reduce(self, unit, grad)

    def _on_alive(self, unit: UnitRun, sign: int) -> None:
        ptr = _storage_id(unit._buf)
        if sign > 0:
            self._live[ptr] = unit
        else:
            self._live.pop(ptr, None)
        self._live_bytes += sign * unit.layout.numel * unit._buf.element_size()
        self._peak_bytes = max(self._peak_bytes, self._live_bytes)
        self._phase_peak[self.phase] = max(self._phase_peak[self.phase], self._live_bytes)

    def _call_unit(self, route: _UnitForward, args, kwargs):
        unit, gather = self.units[route.name], self._policy.gather
        if unit._member:  # gathered, freed and reduced by its group's call
            if unit._group_depth == 0:
                raise TemplateCallError(f"unit {unit.name!r} is a member of a routed group (fs.init(routed=...)) "
                                        "and was called outside a call of its container; call it through the "
                                        "container, which every rank calls.")
            unit.acquire()
            return functional_call(route.proxy, {"m." + k: v for k, v in unit._bind(route.names).items()},
                                   args, kwargs)
        recompute = self.phase == "backward"  # activation checkpointing runs the call again in backward
        if recompute:  # the unit's backward use begins; it stays gathered until that use's gradient is complete
            self._begin_backward(unit)
        else:
            self.order.append(route.name)
            gather.before_forward(self, unit)
        if self._param_dtype is not None:  # as FSDP2's cast_forward_inputs: floating-point inputs in the compute dtype
            args, kwargs = optree.tree_map(self._cast, (args, kwargs), none_is_leaf=True)
        if not recompute and not unit.shard.requires_grad and torch.is_grad_enabled():
            # a frozen unit has no gradient to end its backward use: a node on its inputs does (fshard/_recompute.py)
            _, args, kwargs = through(lambda: unit._use_done(None), args, kwargs)
        out = functional_call(route.proxy, {"m." + k: v for k, v in unit._bind(route.names).items()}, args, kwargs)
        if not recompute:
            if torch.is_grad_enabled():  # backward enters the unit where its outputs' gradients are complete
                for t in produced(out, args, kwargs):
                    t.register_hook(self._pre_backward(unit))
            gather.after_forward(self, unit)
        return out

    def _pre_backward(self, unit: UnitRun):
        def hook(_grad):
            self._begin_backward(unit)
        return hook

    def _begin_backward(self, unit: UnitRun, group: bool = False) -> None:
        """Backward is about to use the unit: a gradient reached one of its outputs, autograd reads one of its
        saved tensors, or a checkpoint recomputes its call. A routed group's member: only its group's events."""
        if unit._member and not group:
            return unit.acquire()
        if unit.name not in self._reading:
            self._reading.add(unit.name)
            self._backward_order.append(unit.name)
        self._policy.gather.before_backward(self, unit)

    def _cast(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self._param_dtype:
            return x.to(self._param_dtype)
        return x

    @contextlib.contextmanager
    def _active(self):
        token = _ACTIVE.set(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _ACTIVE.reset(token)

    def _pack(self, t: torch.Tensor):
        try:
            ptr = _storage_id(t)
            unit = self._live.get(ptr) if self._live else None
            if unit is None and self.phase == "forward":  # an activation backward keeps (step.plan: meta ones)
                self._activations[ptr] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, nested)
            unit = None
        return t if unit is None else _Saved(unit, t)

    def _unpack(self, x):
        if isinstance(x, _Saved):
            self._begin_backward(x.unit)
            return x.tensor
        return x

    def _end_backward(self) -> None:
        """After this micro-batch's backward. In the last one, units that got a gradient only in earlier
        micro-batches are reduced now (in unit order), then the reduce policy completes every reduction, and every
        unit it was given must have its shard."""
        finish_groups(self)
        if self.last:
            for u in self.spec.units:
                if u.name in self._acc.grads:
                    self._reduce(self.units[u.name], self._acc.grads.pop(u.name))
            self._policy.reduce.finish(self)
            missing = [u.name for u in self._reduced if u._grad is None]
            if missing:
                raise PolicyError(
                    f"the reduce policy {type(self._policy.reduce).__name__} did not hand over the gradient shards "
                    f"of units {missing}: a ReducePolicy must call step.grad_ready(unit, shard) for every unit it "
                    "is given, by the time its finish() returns.")
        if self._acc.k > 1:
            for name, u in self.units.items():
                self._acc.got[name] = self._acc.got_so_far(name, u._got)

    def _grad_shards(self) -> dict[str, torch.Tensor]:
        return {n: u._grad for n, u in self.units.items() if u._grad is not None}

    def _release_all(self) -> None:
        for unit in self.units.values():
            unit.release()

    def _close(self) -> None:
        """Drop every tensor this micro-batch's runtime holds and break its reference cycles (StepRun <->
        UnitRun, and flat buffer -> autograd node -> UnitRun), so a finished step frees its memory at once, not at
        the next cycle collection."""
        self._launches.drop()  # (left only by a failure: no gather may be issued after it)
        for unit in self.units.values():
            unit.release()
            unit._flat = unit._buf = unit._grad = unit.shard = unit._copy = unit._run = None
            unit._anchor = unit._stash = None
        self._group_calls.clear()
        self._activations.clear()
        self.units.clear()
        self._live.clear()
        self._reduced.clear()
