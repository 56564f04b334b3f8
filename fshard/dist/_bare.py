"""Collectives issued with no Python object in the thread state torch copies into them (``bare``).

torch copies the calling thread's ``at::ThreadLocalState`` into every work a process group makes (gloo's
``AsyncWork``), and with it the Python objects that state holds: the saved-tensor hooks in force. A step's forward
and backward run under fshard's own (``StepRun._active``: ``_pack``/``_unpack``, bound methods of the step's run,
which holds its ``Comm``, the mesh and through it the process group), so every gather and reduction of a step
carried a reference to the step's whole run. gloo's worker thread destroys a finished work a moment after ``wait()``
returns on the caller's side, and dropping those references takes the GIL there. Two failures followed, both seen:

- at exit, an abort: a script that caught an fshard error and exited reached interpreter finalization while gloo's
  worker, descheduled under load, had yet to destroy the failed step's last works; CPython ends a thread that asks
  for the GIL during finalization with ``pthread_exit``, and unwinding through the work's (noexcept) destructor is
  ``std::terminate``: "terminate called without an active exception" (the core: design/ARCHITECTURE.md, "Exit and
  teardown");
- the process group outliving ``dist.destroy_process_group()``: the run, and so the mesh, were held from C++ by
  works not yet destroyed, a referrer no garbage collection sees.

So every collective fshard issues is issued inside ``bare()``, which takes the saved-tensor hooks off this thread's
stack for the call (a c10d collective records nothing for autograd: they have no use there) and puts them back, in
order, after it. The Python modes (``TorchFunctionMode``, ``TorchDispatchMode``) a caller may have entered are left
in force: taking them off would change how the collective dispatches, and fshard enters none.

Also here, the transport calls that other modules share: torch's one-tensor all-gather under its 2.13 name, and the
exchange that replaces gloo's reduce-scatter in a group of two (``swap``, ``swap_halves``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_autograd = torch._C._autograd


@contextlib.contextmanager
def bare():
    """Run the body (one collective's issue) with no saved-tensor hooks on this thread; restores them after."""
    hooks = []
    if _autograd._saved_tensors_hooks_is_enabled():  # (disabled, the stack cannot be pushed back: left as it is)
        while (top := _autograd._top_saved_tensors_default_hooks(True)) is not None:
            hooks.append(top)
            _autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            _autograd._push_saved_tensors_default_hooks(pack, unpack)


def all_gather_single(out: torch.Tensor, t: torch.Tensor, group, async_op: bool = True):
    """torch's all-gather into one tensor: ``all_gather_single`` where torch has it (2.13, which deprecates
    ``all_gather_into_tensor``), else ``all_gather_into_tensor``; looked up on the module at each call, as fshard
    does every collective (tests/test_exit.py spies on them there)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=async_op)


def swap(into: torch.Tensor, send: torch.Tensor, peer: int, group):
    """One all-to-all in a group of two ranks: ``send`` to ``peer``, ``peer``'s message into ``into`` (the exchange
    that reduces a sum of two: ``swap_halves``, ``Comm.reduce_each``; not isend/irecv: design/COLLECTIVES.md)."""
    recv, sent = [0, 0], [0, 0]
    recv[peer], sent[peer] = into.numel(), send.numel()
    return dist.all_to_all_single(into, send, recv, sent, group=group, async_op=True)


def swap_halves(out: torch.Tensor, full: torch.Tensor, me: int, group):
    """A reduce-scatter in a group of two ranks as one exchange: the other rank's half of ``full`` sent to it, its
    part of this rank's half received, this rank's added when the work is done (a sum of two: the same bits in either
    order). Returns ``(work, then, scratch)`` for a ``Flight``. ``out`` (half ``full``'s size, its dtype) receives the
    message itself unless it is not contiguous or lies in ``full``, whose half this rank still reads: then a buffer."""
    halves = full.reshape(-1).chunk(2)
    mine, theirs = halves[me], halves[1 - me]
    own = out.is_contiguous() and out.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    into = out.view(-1) if own else torch.empty_like(mine)
    work = swap(into, theirs, 1 - me, group)
    if own:
        return work, (lambda: into.add_(mine)), ()
    return work, (lambda: out.copy_(into.add_(mine).view(out.shape))), (into,)
