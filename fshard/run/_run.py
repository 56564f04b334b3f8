"""One micro-batch of a step at run time: ``StepRun``, the ``StepView`` policies see, the routing target of unit calls
(fshard/run/_dispatch.py), the saved-tensor hooks that re-gather units in backward, the hand-over of gradient shards
(``grad_ready``) and the memory counters a step reports. Its units are ``UnitRun``s (fshard/run/_unit.py)."""
from __future__ import annotations

import contextlib
import threading

import optree
import torch

from ..protocol._stages import StepView
from ..dist._view import CollectivesView
from ..errors import PolicyError, TemplateCallError
from ._read_ahead import Launches
from ._recompute import produced, through
from ._dispatch import _ACTIVE, _UnitForward, call_unit_bound
from ._routed_groups import finish_groups
from ._pool import BufferPool
from ._unit import UnitRun, _Saved, _storage_id


class StepRun(StepView):
    """One micro-batch of a step: the ``StepView`` that policies see, the routing target of unit calls, the
    saved-tensor hooks, and the gathered-bytes counter."""

    def __init__(self, state, comm, policy, acc: "Accumulator", scratch: dict, last: bool, training: bool = True,
                 donate: bool = False, compiled=None, pool: BufferPool | None = None):
        self.spec, self.state, self.last, self.training, self.donate = state.spec, state, last, training, donate
        self._launches = Launches()  # launched units whose gathers wait for their reads (fshard/run/_read_ahead.py)
        # the step's Comm; what policies may use of it (issuing the launched gathers first: one order on every rank)
        self._comm, self.comm = comm, CollectivesView(comm, before=self._launches.flush)
        self.grads_unchanged, self.grads_unread = policy.grads_unchanged, policy.grads_unread
        # what the gather policy declares: the compute dtype (None: the units' own), and copies kept in it
        self.param_dtype, self.param_copies = policy.gather.param_dtype, policy.gather.param_copies
        self.phase = "forward"  # the step sets "backward" once forward has returned
        self.order: list[str] = []  # units in the order forward used them
        self._backward_order: list[str] = []  # units in the order backward began reading them (one entry per use)
        self._reading: set[str] = set()  # units whose current backward use has begun and not finished
        self._policy, self._acc, self._scratch = policy, acc, scratch
        self._grouped = {n for _, members in state.spec.groups for n in members}
        self.units = {u.name: UnitRun(self, u, state.params[u.name], state.copies.get(u.name))
                      for u in self.spec.units}
        _gather_in_place(self.units.values())
        self._reduced: list[UnitRun] = []  # units given to the reduce policy, to check each was handed back
        self._live: dict[int, UnitRun] = {}
        self._live_bytes = self._peak_bytes = 0
        self._unit_grad_bytes = 0  # the largest gradient of a whole unit that backward produced
        self._loaded_bytes = 0  # parameter leaves held outside memory (in_store), loaded for gathers
        self._grad_held = self._grad_peak = 0  # gradient-shard bytes held now, and at most at once
        self._grad_lock = threading.Lock()
        # freed gathered buffers' memory, kept for this call's later gathers where that applies (fshard/run/_pool.py;
        # elsewhere, and in step.plan's simulated runs, which pass none, it only ever refills by resize_)
        self._pool = pool if pool is not None else BufferPool()
        self._pooling = pool is not None and pool.applies(state.spec.mesh.device)
        self._compiled = compiled  # compiled(proxy) -> the unit's class forward compiled (fs.compose(compile=)), or None
        self._read_bytes = self._read_peak = 0  # those leaves loaded (or being loaded) and not yet gathered
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

    def _keeps(self, unit: UnitRun) -> bool:
        """Whether ``unit``'s freed buffer goes to the pool: a gather of its size is still to come in this call (in
        a training forward, backward re-gathers each unit; in backward, the units not gathered now whose backward
        has not begun, less the buffers of their size already kept)."""
        if not self._pooling:
            return False
        if self.phase == "forward":
            return self.training
        nbytes, begun = unit._buf.untyped_storage().nbytes(), set(self._backward_order)
        to_come = sum(1 for u in self.units.values() if not u.alive and u._flat is not None and u.name not in begun
                      and u._buf is not None and u._buf.numel() * u._buf.element_size() == nbytes)
        return self._pool.count(nbytes) < to_come

    def _call_unit(self, route: _UnitForward, args, kwargs):
        unit, gather = self.units[route.name], self._policy.gather
        if unit._member:  # gathered, freed and reduced by its group's call
            if unit._group_depth == 0:
                raise TemplateCallError(f"unit {unit.name!r} is a member of a routed group (fs.init(routed=...)) "
                                        "and was called outside a call of its container; call it through the "
                                        "container, which every rank calls.")
            unit.acquire()
            return call_unit_bound(self.spec.owners, route.proxy, unit._bind(route.names), args, kwargs,
                                   self._forward_of(route))
        recompute = self.phase == "backward"  # activation checkpointing runs the call again in backward
        if recompute:  # the unit's backward use begins; it stays gathered until that use's gradient is complete
            self._begin_backward(unit)
        else:
            self.order.append(route.name)
            gather.before_forward(self, unit)
        if self.param_dtype is not None:  # as FSDP2's cast_forward_inputs: floating-point inputs in the compute dtype
            args, kwargs = optree.tree_map(self._cast, (args, kwargs), none_is_leaf=True)
        if not recompute and not unit.shard.requires_grad and torch.is_grad_enabled():
            # a frozen unit has no gradient to end its backward use: a node on its inputs does (run/_recompute.py)
            _, args, kwargs = through(lambda: unit._use_done(None), args, kwargs)
        out = call_unit_bound(self.spec.owners, route.proxy, unit._bind(route.names), args, kwargs,
                              self._forward_of(route))
        if not recompute:
            if torch.is_grad_enabled():  # backward enters the unit where its outputs' gradients are complete
                for t in produced(out, args, kwargs):
                    t.register_hook(self._pre_backward(unit))
            gather.after_forward(self, unit)
        return out

    def _forward_of(self, route: _UnitForward):
        """The compiled forward of the unit's class (``fs.compose(compile=)``), or None: the proxy's own call."""
        return None if self._compiled is None else self._compiled(route.proxy)

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
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
            return x.to(self.param_dtype)
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
            unit._flat = unit._buf = unit._grad = unit.shard = unit._copy = unit._run = unit._whole = None
            unit._bound = None  # (forward's views: their nodes lead back to the unit)
            unit._anchor = unit._stash = None
        self._group_calls.clear()
        self._activations.clear()
        self.units.clear()
        self._live.clear()
        self._reduced.clear()


def _gather_in_place(units) -> None:
    """At world size 1 each unit's gathered buffer is its shard itself (or the state's copy of it in the compute
    dtype), not a copy: ``UnitRun._whole``. Not where two units' sources share a storage: the saved-tensor hook
    tells a unit's tensors by their storage, so each gathered buffer must have one of its own."""
    by_storage: dict[int, list] = {}
    for unit in units:
        src = unit._source()
        if src is not None:
            by_storage.setdefault(_storage_id(src), []).append((unit, src))
    for found in by_storage.values():
        if len(found) == 1:
            found[0][0]._whole = found[0][1]
