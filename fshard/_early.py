"""offload_state's updates begun during backward (``overlap_backward``), run in its worker thread, and
``Streamed``, one unit's work item of the streamed update."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import wait
from typing import Any, NamedTuple

import torch

from .store._protocol import locked


class Streamed(NamedTuple):
    """One unit's update through the store: its parameter shard (written), gradient shard, the optimizer's runs,
    its stored optimizer state, the key the new moments are written under, and its low-precision copy (or None)."""

    param: torch.Tensor
    grad: torch.Tensor
    segs: list
    state: Any
    key: str
    copy: torch.Tensor | None


class _Early:
    """One unit's update, begun in the worker during backward: a new version of its chunks (new keys, a cloned
    parameter and copy), so the input state stays intact until the update takes the result, and nothing is lost if
    the step fails first (``abandon``)."""

    def __init__(self, owner, opt, name, param, copy, grad, s, segs, count, key, record):
        self.store, self.opt, self.name, self.param, self.grad, self.s = owner.store, opt, name, param, grad, s
        self.copy = copy  # the parameter's low-precision copy (TrainState.copies), or None
        self.count, self.key, self.record = count, key, record  # record: the step's StepView.record
        self.created: list = []  # keys written so far (appended by the worker)
        self.metrics = {"io/read_bytes": 0, "io/write_bytes": 0, "time/io_wait": 0.0}
        self.started, self.seconds = float("inf"), 0.0
        self.future = owner.worker.submit(self._run, owner, segs)

    def _run(self, owner, segs):
        t0 = self.started = time.perf_counter()
        p, c = self.param.clone(), None if self.copy is None else self.copy.clone()
        try:
            owner._stream(self.opt, [Streamed(p, self.grad, segs, self.s, self.key, c)], 1.0, self.created,
                          self.metrics, donate=False, record=self.record)
        finally:
            self.seconds = time.perf_counter() - t0
            self.record("update", f"{self.name} (early)", t0, t0 + self.seconds)
        return p, c

    def abandon(self) -> None:
        """Wait for the worker, then delete what it wrote: the step did not take this update. (The caller has let
        the worker finish every other update first, so the store has one user at a time.)"""
        try:
            self.future.result()
        except Exception:  # noqa: BLE001 - the step already failed for its own reason; this work is discarded
            pass
        with locked(self.store):
            for k in self.created:
                _quiet_delete(self.store, k)
        self.created = []


def _settle(works) -> None:
    """Wait until the worker has finished (or failed) every one of ``works``."""
    wait([w.future for w in works])


def _quiet_delete(store, key) -> None:
    try:
        store.delete(key)
    except Exception:  # noqa: BLE001 - already gone, or the store is closed: nothing left to free
        pass


def _lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice``. On Linux, nice is per thread, so backward's threads keep
    their priority and win the cores; the worker, mostly waiting on the disk, fills the gaps. Elsewhere it would
    lower the whole process, so it is left alone there; a refusal only costs speed."""
    if nice and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
        except OSError:
            pass
