"""The order in which offload_state's updates begun during backward stage their tensors on the host (issue #43):
a unit's copies down start when the worker starts the unit before it (or at submit, where the worker is already
on that one or idle), so at most two units are staged at once and each is staged before the worker reaches it.
The CUDA copies themselves are tests/test_cuda.py's; here HostStaging is a recorder, so this runs on any machine."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from fshard.offload import _pipeline


class _Recorder:
    """HostStaging's place: notes when each unit's copies start and when the worker finishes with it."""

    log: list = []
    lock = threading.Lock()

    def __init__(self, work, ready):
        self.work, self.name = work, work[0].key

    def start(self):
        with self.lock:
            self.log.append(("start", self.name))


class _Owner:
    """The policy's part an _Early uses: its worker, the chain lock and ``_stream`` (which waits for a gate per unit)."""

    def __init__(self, gates):
        self.worker, self.chain, self.gates = ThreadPoolExecutor(1), threading.Lock(), gates

    def _stream(self, opt, work, scale, created, m, donate, record, staging=None, wait_up=True):
        with _Recorder.lock:
            _Recorder.log.append(("run", work[0].key, staging is not None and ("start", work[0].key) in _Recorder.log))
        self.gates[work[0].key].wait(10)
        with _Recorder.lock:
            _Recorder.log.append(("done", work[0].key))
        return []


def _early(owner, name, after):
    t = torch.zeros(4)
    return _pipeline._Early(owner, None, None, name, t, None, t, None, [], None, name, lambda *a: None,
                            ready=object(), after=after)


def test_each_unit_is_staged_when_the_worker_starts_the_one_before_it(monkeypatch):
    monkeypatch.setattr(_pipeline, "HostStaging", _Recorder)
    _Recorder.log = []
    names = ["u3", "u2", "u1", "u0"]  # backward's order
    gates = {n: threading.Event() for n in names}
    owner = _Owner(gates)
    works, after = [], None
    for n in names:
        after = _early(owner, n, after)
        works.append(after)
    # the worker is on u3 (held by its gate): u3 and u2 are staged, u1 and u0 wait for their predecessors to start
    deadline = threading.Event()
    while ("run", "u3", True) not in _Recorder.log and not deadline.wait(0.01):
        pass
    staged = [e[1] for e in _Recorder.log if e[0] == "start"]
    assert staged == ["u3", "u2"], _Recorder.log
    for n in names:
        gates[n].set()
    for w in works:
        w.future.result(timeout=10)
    log = _Recorder.log
    for i, n in enumerate(names):
        assert ("run", n, True) in log, log  # staged before the worker reached it
        if i >= 2:  # started by the worker starting the unit before it, so after the one before that was done
            assert log.index(("start", n)) > log.index(("done", names[i - 2])), log
    # at most two units staged and not yet done at any moment
    live, most = set(), 0
    for e in log:
        if e[0] == "start":
            live.add(e[1])
        elif e[0] == "done":
            live.discard(e[1])
        most = max(most, len(live))
    assert most <= 2, log
    owner.worker.shutdown()
