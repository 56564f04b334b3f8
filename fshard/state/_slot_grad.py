"""``SlotGrad``: a unit's flat gradient held as the gradients autograd made for its parameters, one per slot, and
assembled into one flat tensor only if something reads it whole.

Why: at world size 1 the gradient shard is the unit's whole flat gradient, and nothing needs it flat except
the code that reads it as one tensor. ``torch.split``'s backward copies every parameter's gradient into a new flat
buffer (a ``cat``: 104 MiB a step for the 27.4M GPT, and the weight-gradient ``mm``s after it slower for the caches it
evicted): about two thirds of the one-rank step's excess over plain torch (benchmarks/RESULTS.md, "Session 32"),
where torch's ``AccumulateGrad`` keeps each gradient as it is. The update reads a run's elements through a slice
(``g[lo:hi]``); a slice within one parameter is a view of that parameter's gradient here, so an update that cuts its
runs at the slots' edges (``parts``) reads the gradients where autograd left them. Every other op on a
``SlotGrad`` (a norm, an in-place scale, a cast, a collective) sees the assembled flat tensor, made once and kept:
the same values, so code that does not know this class gets what it got before.

Where: at world size 1, and wherever the reduce policy declares ``per_slot`` (``fs.bucket_reduce``, which at N > 1
copies each slot's gradient into its buckets with ``grad_parts``: no collective ever reads a ``SlotGrad``).
"""
from __future__ import annotations

import bisect

import torch
from torch.utils._pytree import tree_map

from ._flat import UnitLayout

_aten = torch.ops.aten
# ops that give the same elements in the same shape: autograd's view_as backward, detach (the engine's, hooks')
_SAME = (_aten.view.default, _aten._unsafe_view.default, _aten.alias.default, _aten.detach.default,
         _aten._reshape_alias.default)


class SlotGrad(torch.Tensor):
    """A flat gradient of ``layout.numel`` elements whose slots are ``grads`` (slot index -> that parameter's
    gradient, any shape; a slot missing, and the padding between slots, are zeros)."""

    @staticmethod
    def __new__(cls, layout: UnitLayout, grads: dict, dtype: torch.dtype, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, (layout.numel,), dtype=dtype, device=device)
        t._layout, t._grads, t._flat = layout, grads, None
        t._starts = [s.offset for s in layout.slots]  # (ascending: parts finds a range's first slot by bisection)
        return t

    def __repr__(self) -> str:
        return f"SlotGrad({self._layout.name!r}, {len(self._grads)} of {len(self._layout.slots)} slots)"

    def flat(self) -> torch.Tensor:
        """The whole flat gradient (assembled at the first call, then kept: later reads and in-place ops use it)."""
        if self._flat is None:
            out = torch.zeros(self._layout.numel, dtype=self.dtype, device=self.device)
            for i, g in self._grads.items():
                s = self._layout.slots[i]
                out[s.offset:s.offset + s.numel].copy_(g.reshape(-1))
            self._flat = out
            self._grads = {}  # (after _flat is set: parts reads them in the other order)
        return self._flat

    def parts(self, lo: int, hi: int, padding: bool = True) -> list[tuple[int, int, torch.Tensor]]:
        """Elements ``[lo, hi)`` as ``(a, b, tensor)`` pieces in order, each a view of one slot's gradient where it
        lies within one, else zeros (a slot without a gradient, padding) or, once assembled, a slice of the flat
        gradient. They tile ``[lo, hi)``; without ``padding`` the pieces of the padding between and after the
        slots are left out (an update leaves padding as it is: zero, as every elementwise update of a zero
        parameter with a zero gradient and zero state does; tests/test_slot_grad.py)."""
        if lo >= hi:
            return []
        grads = self._grads  # (read before _flat: flat() sets _flat first, then lets the slots go, so a reader in
        flat = self._flat    # another thread, an offloaded update's worker, sees one or the other whole)
        if flat is not None:
            return [(lo, hi, flat[lo:hi])]
        out, pos, slots = [], lo, self._layout.slots
        for i in range(max(0, bisect.bisect_right(self._starts, lo) - 1), len(slots)):  # (a unit's runs: O(slots))
            s, g = slots[i], grads.get(i)
            if s.offset >= hi:
                break
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a >= b:
                continue
            if pos < a and padding:
                out.append((pos, a, None))
            if g is not None:  # (the slot's whole gradient: no slice made)
                g = g.reshape(-1) if a == s.offset and b - a == s.numel else g.reshape(-1)[a - s.offset:b - s.offset]
            out.append((a, b, g))
            pos = b
        if pos < hi and padding:
            out.append((pos, hi, None))
        if any(t is None for _, _, t in out):  # zeros where no slot's gradient is (padding; a slot unused)
            zeros = torch.zeros(max(b - a for a, b, t in out if t is None), dtype=self.dtype, device=self.device)
            out = [(a, b, zeros[:b - a] if t is None else t) for a, b, t in out]
        return out

    def release(self) -> None:
        """Let go of the gradients it holds (an update that consumed them frees them early: offload's
        ``grads_unread``); reading it afterwards is an error, as reading a freed flat shard is."""
        self._grads.clear()  # (shared with its same-shape views)
        self._flat = torch.empty(0, dtype=self.dtype, device=self.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in _SAME and isinstance(x, SlotGrad) and tuple(x.shape) == _shape(func, args):
            grads = x._grads  # (before _flat, as in parts)
            if x._flat is None:
                return SlotGrad(x._layout, grads, x.dtype, x.device)  # (shares the gradients: nothing writes them)
        if func is _aten.slice.Tensor and isinstance(x, SlotGrad) and x._flat is None and not kwargs:
            dim, lo, hi, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
            lo, hi = _bounds(lo, hi, x.shape[0])
            if dim == 0 and step == 1:
                got = x.parts(lo, hi)
                if len(got) == 1:
                    return got[0][2]
        if func is _aten._to_copy.default and isinstance(x, SlotGrad) and len(args) == 1 and set(kwargs) <= {"dtype"}:
            grads = x._grads  # (before _flat, as in parts)
            if x._flat is None:  # a cast (mixed precision's reduce dtype): slot by slot, not assembled
                dtype = kwargs.get("dtype", x.dtype)
                return SlotGrad(x._layout, {i: g.to(dtype) for i, g in grads.items()}, dtype, x.device)
        unwrap = lambda t: t.flat() if isinstance(t, SlotGrad) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def grad_parts(g: torch.Tensor, lo: int, hi: int, padding: bool = False) -> list[tuple[int, int, torch.Tensor]]:
    """Elements ``[lo, hi)`` of a gradient as ``(a, b, tensor)`` pieces, for a reader that goes element by element
    (an update, a norm, a copy into a bucket): a ``SlotGrad``'s slot gradients where autograd left them, and the
    padding between them as zeros only with ``padding`` (an elementwise update leaves it zero), else one piece, ``g``
    itself where the range is all of it (no view made: between kernels that leave the caches cold each tensor op
    costs tens of microseconds)."""
    if isinstance(g, SlotGrad):
        return g.parts(lo, hi, padding=padding)
    return [(lo, hi, g if lo == 0 and hi == g.shape[0] else g[lo:hi])]


def _shape(func, args) -> tuple:
    """The shape a same-elements op asks for (view's and _reshape_alias's size; alias and detach keep it)."""
    if func in (_aten.alias.default, _aten.detach.default):
        return tuple(args[0].shape)
    return tuple(args[1]) if len(args) > 1 else ()


def _bounds(lo, hi, n: int) -> tuple[int, int]:
    lo = 0 if lo is None else (lo + n if lo < 0 else lo)
    hi = n if hi is None else (hi + n if hi < 0 else hi)
    return max(0, min(lo, n)), max(0, min(hi, n))


def slot_views(flat: torch.Tensor, layout: UnitLayout, got=None) -> dict[str, torch.Tensor]:
    """Slot name -> view of ``flat``, as ``views``, through ``SlotViews``: the gradient comes back per slot.
    ``got(indices)``: called in backward with the indices of the slots that got a gradient (what a hook on each
    view would tell, without a hook a view)."""
    out = SlotViews.apply(flat, layout, got)
    return dict(zip((s.name for s in layout.slots), out if isinstance(out, tuple) else (out,)))


class SlotViews(torch.autograd.Function):
    """flat -> one view per slot (as ``views``), whose backward gives the slots' gradients as a ``SlotGrad``
    instead of ``torch.split``'s ``cat`` of them."""

    @staticmethod
    def forward(ctx, flat, layout: UnitLayout, got=None):
        ctx.layout, ctx.dtype, ctx.device, ctx.got = layout, flat.dtype, flat.device, got
        ctx.set_materialize_grads(False)  # (a slot without a gradient stays None: zeros only if assembled)
        pieces = flat.split(layout.split_sizes())
        return tuple(pieces[2 * i + 1].view(s.shape) for i, s in enumerate(layout.slots))

    @staticmethod
    def backward(ctx, *grads):
        got = {i: g for i, g in enumerate(grads) if g is not None}
        tell, ctx.got = ctx.got, None  # (the node must not keep its caller alive)
        if tell is not None:
            tell(got)
        return SlotGrad(ctx.layout, got, ctx.dtype, ctx.device), None, None
