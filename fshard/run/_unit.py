"""One step's runtime for the units (``UnitRun``; the step's is ``StepRun``, fshard/run/_run.py): gather, bind (as
functional_call does), free, re-gather in backward, reduce.

How a unit's parameters reach the module: ``fs.init`` replaces the ``forward`` of each unit module in the template
by a ``_UnitForward``, which hands the call to the step being run (a context variable, set only while a step runs).
The step gathers the unit's flat buffer, binds views of it in the module's place (``_dispatch.call_unit_bound``)
and, after the call, frees the buffer's storage (``resize_(0)``, as FSDP does; on CPU its memory is kept for a later
gather of the same size while one is to come: fshard/run/_pool.py). Autograd still needs the parameters in backward: a
saved-tensors hook replaces every saved tensor that lives in a gathered buffer by a small handle, and unpacking that
handle re-gathers the unit. The gradient of the whole flat buffer arrives in one piece at ``_Gather.backward``,
which hands it to the reduce policy and frees the buffer again. Activation checkpointing (a recompute in backward)
is covered by fshard/run/_recompute.py's hooks. At world size 1 the buffer is the shard itself (``_whole``): the same
calls, with nothing copied and nothing freed (design/ARCHITECTURE.md, "One rank: nothing moves").
"""
from __future__ import annotations

import time

import torch

from ..protocol._stages import UnitView
from ..errors import RecomputeError
from ..state._flat import UnitLayout, views
from ..state._slot_grad import slot_views
from ._dispatch import bind_at, unbind
from ..state._stored import in_store


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
        ctx.unit, ctx.anchored = unit, anchor is not None  # anchor: a routed group's (fshard/run/_routed_groups.py)
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
        # A shard held in a store (offload_state(params=True)) is read at each gather and dropped once gathered;
        # autograd's leaf is then a tensor of the shard's shape without storage (it is never read: gradients end in
        # the unit).
        self._stored = in_store(shard)
        if self._stored is not None:
            shard = torch.empty(layout.shard_numel, dtype=layout.dtype, device=run.spec.mesh.device)
            shard.untyped_storage().resize_(0)
        self.shard = shard.detach().requires_grad_(self.trainable and run.training)  # an eval pass: no graph
        self._copy = copy  # the state's low-precision copy of the shard (TrainState.copies), gathered in its place
        self.alive = False
        self._buf: torch.Tensor | None = None   # the gathered buffer (storage freed and refilled in place)
        # at world size 1 the buffer is the shard (or its copy) itself where no cast is needed: never freed, and its
        # "gather" copies nothing (StepRun decides, since two units must not share a storage: _whole)
        self._whole: torch.Tensor | None = None
        self._flat: torch.Tensor | None = None  # the same storage as autograd's output of _Gather (first use on)
        self._pending = None  # the Flight of a gather into ``_buf`` that nobody has waited on yet
        self._read = None  # the Future of the reader's read of a stored shard, until its gather is issued
        self._held = 0  # bytes of the read shard a gather in flight holds
        self._queued = False  # launched, its gather not issued yet (fshard/run/_read_ahead.py)
        self._grad: torch.Tensor | None = None
        self._got = [False] * len(layout.trainable)
        self._attached: list | None = None  # in backward, the module's parameters set to views of the buffer
        self._bound: dict | None = None  # slot name -> view, as the last call bound them with its graph (_bind)
        self._member = layout.name in run._grouped  # a member of a routed group (fshard/run/_routed_groups.py)
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
            self._buf.untyped_storage(), self._buf.storage_offset(), (self.layout.numel,))

    def _source(self) -> torch.Tensor | None:
        """What this unit's gathered buffer can be without a gather, at world size 1: the shard (or the state's
        copy in the compute dtype) itself, where it needs no cast. None where a gather must write a buffer."""
        if self.layout.world_size != 1 or self._stored is not None:
            return None
        dtype = self._run.param_dtype or self.layout.dtype
        src = self._copy if self._copy is not None and self._copy.dtype == dtype else self.shard.detach()
        ok = src.dtype == dtype and src.is_contiguous() and src.numel() == self.layout.numel
        return src if ok else None

    def launch(self) -> None:
        if self.alive:
            return
        run, comm, dtype = self._run, self._run._comm, self._run.param_dtype or self.layout.dtype
        if self._whole is not None:  # the shard is the whole unit: the buffer is the shard, never freed
            self._buf = self._whole
        else:
            with comm.gather_scope():
                # a new buffer, or one whose storage was freed: its storage refilled in place, so every tensor on it
                # (flat, views) sees the data, with memory an earlier gather freed where the pool holds some
                buf = self._buf if self._buf is not None else torch.empty(0, dtype=dtype, device=self.shard.device)
                run._pool.refill(buf.untyped_storage(), self.layout.numel * dtype.itemsize)
                if self._buf is None:
                    self._buf = buf.set_(buf.untyped_storage(), 0, (self.layout.numel,))
        if self._stored is not None:  # read ahead on the update policy's reader, freed once the gather has copied it
            self._held = self._stored.numel * dtype.itemsize  # the shard read, in the compute dtype
            run._read_bytes += self._held
            run._read_peak = max(run._read_peak, run._read_bytes)
            run._loaded_bytes += self._stored.nbytes
            if not comm.dry and not self._stored.direct(self.shard.device):  # None: read at the gather (_issue)
                self._read = run._policy.update.read_ahead(self._stored, dtype, run.record, f"read {self.name}",
                                                           pin=self.shard.device.type == "cuda")
        self.alive = True
        run._on_alive(self, +1)
        run._launches.add(self)  # gathers are issued in launch order (fshard/run/_read_ahead.py)

    def _read_done(self) -> bool:
        return self._read is None or self._read.done()

    def _issue(self) -> None:
        """Issue the gather of a launched unit (its read, if any, done: waited for here)."""
        self._queued = False
        comm, dtype = self._run._comm, self._run.param_dtype or self.layout.dtype
        if self._stored is not None:
            if comm.dry:  # step.plan: counted, not read
                shard = torch.empty(self._stored.numel, dtype=dtype, device="meta")
            elif self._stored.direct(self.shard.device):  # pinned items: the copy engine uploads them
                with comm.gather_scope():
                    shard = self._stored.upload(self.shard.device, dtype)
            elif self._read is None:  # no reader: read here
                shard = self._stored.load(dtype).to(self.shard.device)
            else:
                read, self._read = self._read, None
                try:
                    with comm.gather_scope():  # uploaded on the gather stream (from pinned memory): compute goes on
                        shard = read.result().to(self.shard.device, non_blocking=True)
                finally:
                    read = None  # (a failed read's traceback holds this frame: no way back to it through the future)
        else:
            shard = self.shard.detach() if self._copy is None or self._copy.dtype != dtype else self._copy
        if shard.dtype != dtype and self.layout.world_size > 1:
            # mixed precision: each gather casts the master shard (timed on a timeline); at world size 1 the gather
            # is a local copy, which casts as it copies (one pass, not a cast and then a copy)
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
            read = None  # (its error's traceback holds this frame: see _issue)

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
            # the views forward's last call bound, which live on the buffer just re-gathered: a recompute reads
            # their values, requires_grad as in forward (so it saves the same tensors), and a reentrant checkpoint
            # differentiates its recompute through them into the unit, as through views made now (and not made at
            # every backward use for a recompute that seldom comes)
            by_slot = self._bound
            if by_slot is None:  # forward bound them without a graph (a reentrant checkpoint's no_grad forward)
                with torch.enable_grad():
                    by_slot = self._bind_slots()
            self._attached = bind_at(self._run.spec.owners,
                                     {a: by_slot[s.name] for s in self.layout.slots for a in s.aliases})

    def release(self) -> None:
        if self._attached is not None:
            unbind(self._attached)
            self._attached = None
        if self.alive:
            if self._queued:  # launched, not issued yet: every rank issues it, so this one does too
                self._run._launches.pump(until=self)
            if self._pending is not None:  # a gather still writing into this buffer must finish first
                self._gathered()
            self._run._on_alive(self, -1)
            if self._whole is None:  # (a buffer that is the shard itself is the state's: never freed)
                self._run._comm.before_free()
                if self._run._keeps(self):  # its memory kept for a later gather of its size (run/_pool.py)
                    self._run._pool.free(self._buf.untyped_storage())
                else:
                    self._buf.untyped_storage().resize_(0)
            self.alive = False

    def _bind(self, names) -> dict[str, torch.Tensor]:
        """name -> view of the gathered buffer, for each slot's ``names[i]`` (``_bind_slots``)."""
        by_slot = self._bind_slots()
        return {n: by_slot[s.name] for s, slot_names in zip(self.layout.slots, names) for n in slot_names}

    def _bind_slots(self) -> dict[str, torch.Tensor]:
        """Slot name -> view of the gathered buffer, for one call. Trainable views carry a hook that records that
        they got a gradient (torch skips a parameter whose .grad is None; so do we). Kept as ``_bound`` where made
        with the graph a use in backward would make (grad enabled), for backward's attach."""
        assert self.alive, "bind() before acquire()"
        use = self._flat.view_as(self._flat)
        if use.requires_grad:  # (not under torch.no_grad)
            # One view per use: its gradient is complete once this use's backward is done, which is when the
            # buffer can be freed (a later use's saved tensors re-gather it), so a unit used twice does not stay
            # gathered while the units between its two uses run backward.
            use.register_hook(self._use_done)
        bound, marked = self._views(use)
        if not marked:
            k = 0
            for s in self.layout.slots:
                if s.requires_grad:
                    v = bound[s.name]
                    if v.requires_grad:
                        v.register_hook(self._marker(k))
                    k += 1
        if use.requires_grad == self._flat.requires_grad:
            self._bound = bound
        return bound

    def _views(self, use: torch.Tensor) -> tuple[dict[str, torch.Tensor], bool]:
        """Slot name -> view: trainable slots of ``use``, frozen ones of the buffer (no gradient); and whether
        backward marks the slots that got a gradient itself (``SlotViews``: no hook on each view)."""
        run = self._run
        marked = bool(use.requires_grad and self.layout.slots and  # one rank: no collective reads it; or a policy
                      (run.spec.mesh.world_size == 1 or run._policy.reduce.per_slot))  # that copies it out per slot
        if marked:  # the gradient stays per slot (fshard/state/_slot_grad.py)
            out = slot_views(use, self.layout, self._mark_slots)
        else:
            out = views(use, self.layout)
        if len(self.layout.trainable) < len(self.layout.slots):
            frozen = views(self._flat.detach(), self.layout)
            out.update({s.name: frozen[s.name] for s in self.layout.slots if not s.requires_grad})
        return out, marked

    def _use_done(self, _grad):
        if self._member or self._run is None:  # its group ends the use; the step has ended
            return
        self._run._reading.discard(self.name)
        self._run._policy.gather.after_backward(self._run, self)

    def _mark_slots(self, got) -> None:
        """``SlotViews``' backward: the slots (indices into the layout's slots) that got a gradient."""
        index = self.layout.trainable_index
        for i in got:
            k = index[i]
            if k is not None:  # (a frozen slot's view is the buffer's, never SlotViews': no gradient comes)
                self._got[k] = True

    def _marker(self, k: int):
        def mark(grad):
            if grad is not None:  # (SlotViews' backward gets None for a slot without a gradient, and so do its hooks)
                self._got[k] = True
        return mark
