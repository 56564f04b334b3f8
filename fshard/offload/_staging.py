"""Moving an offloaded update's tensors between a GPU and the host (offload_state on CUDA): ``HostStaging`` for an
update on the host (``update_on="host"``), ``DeviceChunks`` for one on the device (``update_on="device"``, at the
end).

A unit streamed through the host update (fshard/offload/_pipeline.py's ``stream_update``) needs its gradient
shard on the host, and, where its master weights stay on the GPU, its parameter shard (and low-precision copy) down
and back up. Each such tensor moves whole, once, between the GPU and pinned host memory, asynchronously on a copy
stream of its own: unit i+1's copies down run while the host updates unit i, and unit i's copies up run while the
host updates unit i+1. The host update then reads and writes pinned host tensors only; a copy down is waited for
with its event (the GIL is let go meanwhile), and the compute stream waits for the copies up before anything after
the update reads the parameters (``finish``).

The alternatives: a synchronous copy per chunk into pageable memory (what fshard did first: the 6.3B GPT's update
took 76 s on an H100, every transfer exposed and each at pageable speed); a CUDA kernel for the update with the
moments read over PCIe where they are (zero-copy: the moments cross the bus both ways every step, 8x the gradient's
bytes, at PCIe's latency for every load). ``DeviceChunks`` moves the same bytes, in bulk copies, for a host whose
memory is slower than that (design/OFFLOAD.md, "On a GPU").
Pinned buffers come from torch's caching host allocator, which keeps a buffer until the copies recorded on it are
done, so one freed here is never reused under a copy in flight.
"""
from __future__ import annotations

import torch


class HostStaging:
    """The CUDA tensors of ``work`` (``Streamed`` items, in the order the update visits them) staged in pinned host
    memory, ``ahead`` units ahead. ``ready``: a CUDA event after which the gradients are final (recorded on the
    stream that produced them); None: the current stream's work so far. Tensors already on the host pass through."""

    def __init__(self, work, ready=None, ahead: int = 1):
        self.work, self.ahead = work, ahead
        dev = next((t.device for w in work for t in (w.grad, w.param) if isinstance(t, torch.Tensor)
                    and t.device.type == "cuda"), None)
        self.stream = None if dev is None else torch.cuda.Stream(dev)
        if self.stream is not None and ready is None:
            ready = torch.cuda.current_stream(dev).record_event()
        self._ready, self._staged = ready, {}

    def host(self, i: int):
        """Unit i's work item with host tensors (waits for its copies down; starts those of the units after it)."""
        for j in range(i, min(i + 1 + self.ahead, len(self.work))):
            if j not in self._staged:
                self._staged[j] = self._down(self.work[j])
        event, staged = self._staged[i]
        if event is not None:  # once per unit: synchronize() lets go of the GIL even for a finished event, and
            event.synchronize()  # each take back waits beside a busy Python thread (design/OFFLOAD.md, "On a GPU")
            self._staged[i] = (None, staged)
        return staged

    def start(self) -> None:
        """Start the first unit's copies down now (``host(0)`` then finds them done or in flight)."""
        if 0 not in self._staged and self.work:
            self._staged[0] = self._down(self.work[0])

    def up(self, i: int) -> None:
        """Unit i's host update is done: send its parameter shard and copy back to the GPU (asynchronously)."""
        w, (_, staged) = self.work[i], self._staged.pop(i)
        if self.stream is None:
            return
        with torch.cuda.stream(self.stream):
            for dev, host in ((w.param, staged.param), (w.copy, staged.copy)):
                if isinstance(dev, torch.Tensor) and dev is not host:
                    dev.record_stream(self.stream)
                    dev.copy_(host, non_blocking=True)

    def finish(self, wait: bool = True):
        """A CUDA event after every copy up (None without a GPU); with ``wait``, the current stream waits for it
        (a worker thread passes False: its current stream is not the step's, whose thread waits instead)."""
        if self.stream is None:
            return None
        done = self.stream.record_event()
        if wait:
            torch.cuda.current_stream(self.stream.device).wait_event(done)
        return done

    def _down(self, w):
        if self.stream is None:
            return None, w
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._ready)
            g, p, c = (_down(t, self.stream) for t in (w.grad, w.param, w.copy))
            event = self.stream.record_event()
        return event, w._replace(grad=g, param=p, copy=c)


def _down(t, stream):
    """``t`` copied into new pinned host memory on ``stream`` (a host tensor, a stored parameter or None: itself)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return t
    t.record_stream(stream)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class DeviceChunks:
    """The other direction, for ``offload_state(update_on="device")``: each stored chunk (the optimizer's rows, and
    a stored parameter's head) goes up to the device for the update, where the gradient and (unless stored) the
    parameter already are, and comes back down into the host item after it. Up and down run on two copy streams
    (``streams``, made once by the caller: a stream's cached blocks serve that stream alone), so with pinned items
    chunk i+1 goes up while chunk i-1 comes down (PCIe is full-duplex), and the update waits only for its own
    chunk. ``down`` takes a chunk's tensors at once and waits, beyond ``depth`` chunks whose copies down are in
    flight, for the oldest: so at most ``depth`` + 2 chunks hold device memory (those, the one being updated, and
    the next one's allocation). On a CPU mesh the device is the host: the update works on a copy of the item, which
    is then copied back (the same path, so the CPU suite runs it)."""

    def __init__(self, device: torch.device, depth: int, streams: tuple | None = None):
        self.device, self.depth = torch.device(device), depth
        self.up_stream, self.down_stream = streams if self.device.type == "cuda" else (None, None)
        self._pending: list = []  # events after each chunk's copies down still in flight, oldest first

    def up(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host``, which the current stream's work after this call may read and write."""
        if self.up_stream is None:
            return host.clone()
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.up_stream):  # allocated on the copy stream: the next chunk's copy up need not
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)  # wait for this one's update
            dev.copy_(host, non_blocking=True)
        current.wait_stream(self.up_stream)
        dev.record_stream(current)  # (its memory is reused only after the update and the copy down are done)
        return dev

    def down(self, pairs) -> None:
        """Copy each ``(device tensor, host tensor)`` of one chunk back into its host tensor once the current
        stream's work so far (the update) is done."""
        if self.down_stream is None:
            for dev, host in pairs:
                host.copy_(dev)
            return
        self.down_stream.wait_stream(torch.cuda.current_stream(self.device))  # (taken before the switch below)
        with torch.cuda.stream(self.down_stream):
            for dev, host in pairs:
                dev.record_stream(self.down_stream)
                host.copy_(dev, non_blocking=True)
        self._pending.append(self.down_stream.record_event())
        while len(self._pending) > self.depth:  # (bounds the chunks held on the device; lets go of the GIL)
            self._pending.pop(0).synchronize()

    def has_room(self) -> bool:
        """Whether the next ``down`` would return without waiting (fewer than ``depth`` copies down in flight)."""
        self._pending = [e for e in self._pending if not e.query()]
        return len(self._pending) < self.depth

    def settle(self) -> None:
        """Wait until every copy up has read its host tensor and every copy down has landed in host memory (before a
        write-back reads one, the stream ends, or its buffers go back after an error)."""
        if self.up_stream is not None:
            self.up_stream.synchronize()
        while self._pending:
            self._pending.pop(0).synchronize()
