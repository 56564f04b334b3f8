"""Reliability across ranks (issue #24): ranks that disagree, fail or hang, at world sizes 2 and 3.

Each row runs on every rank of one process group (``CASES``, in order; the group stays usable between rows, since
every row ends with all ranks raising at the same check) and records, per rank: the error type, its message, whether
the rank's input state is bitwise intact, and the seconds to fail. Rows whose fault breaks the process group (a hung
rank, Ctrl-C) run in groups of their own. The table:

| row | what one rank (or every rank) does | the faulty rank gets | the others get | state |
|---|---|---|---|---|
| seeds | builds the model under its own seed | RankDivergenceError at fs.init naming the units | the same | - |
| meta_seed | fs.init of a meta model with seed=rank | RankDivergenceError naming the units | the same | - |
| lr | fs.adamw(lr=1.0) where the others use 1e-3 | RankDivergenceError "optimizer hyperparameters" | the same | intact |
| chain | composes bucket_reduce where the others do not | RankDivergenceError "different transforms" | the same | intact |
| skip_unit | skips a unit at the second step (blocking) | RankDivergenceError naming both sides | the same | intact |
| skip_unit_ahead | the same with gather_ahead + bucket_reduce | RankDivergenceError naming both sides | the same | intact |
| microbatches | passes 3 micro-batches where the others pass 2 | BatchMismatchError | the same | intact |
| loss_raises | loss_fn raises ValueError | StepError from its ValueError | RankFailedError naming it | intact |
| store_fails | its store fails mid-update (offload_state) | OffloadError | RankFailedError naming it | intact |
| store_fails_unchecked | the same with check_collectives=False | OffloadError | RankFailedError (at the commit vote) | intact |
| donate_before_update | loss_fn raises, donate=True | StepError from its ValueError | RankFailedError | intact, usable |
| donate_in_update | its store fails mid-update, donate=True | OffloadError "restart from a checkpoint" | RankFailedError | donated on every rank (DonatedStateError on reuse) |
| nan_skip | NaN gradients under skip_nonfinite | every rank skips the step | the same | skipped + 1 |
| extra_step | steps once more while the others export | RankDivergenceError naming both sides | the same | intact |
| store_fails, then | the same step again once the store works | the step goes through | the same | bitwise a clean run's |
| hung | stops itself (SIGSTOP) before a step | (stopped) | CollectiveError naming the step and the rank | intact |
| ctrl_c | - | - | Ctrl-C during a wait is a KeyboardInterrupt within 2 s | - |

An empty batch on one rank whose mean loss is NaN is an ``EmptyBatchError`` there and a ``RankFailedError`` naming it on
the others, in a step and in ``step.eval`` (``test_an_empty_batch_whose_loss_is_nan_is_refused_on_every_rank``).

A dead rank (``os._exit``) is tests/test_multirank.py's ``test_a_dead_rank_makes_the_others_fail_instead_of_hanging``.

Sections:

- one error family on every rank (issue #38): one rank's loss_fn raises a ValueError once; every rank catches
  ``fs.FshardError`` (the failing rank a ``StepError`` whose ``__cause__`` is the ValueError), retries, and ends
  bitwise where a run without the failure ends.
- a custom transform's arguments are checked across ranks (issue #39): a user's ``fs.Transform`` (a plain
  ``__init__``, or a dataclass) composed with another argument on rank 1 is a ``RankDivergenceError`` on every rank,
  naming this rank's arguments, before any gather, the state intact; with the same arguments the ranks train.
- ``check_collectives`` (issue #39), counted on the mesh (``mesh.checks``): False checks no collective, from the
  first step on (one check a step: the commit vote), True and the default on a CPU mesh check each collective of
  every step (a same-size divergence under False, found at the end of the step: tests/test_multirank.py).

Checkpoints (issue #37), world size 2, each within seconds, the user's files, the checkpoints and the state intact:

| row | what rank 1 (or every rank) does | rank 1 gets | rank 0 gets |
|---|---|---|---|
| load_missing | loads a path that does not exist | CheckpointError "not a complete fshard checkpoint" | RankFailedError naming it |
| load_paths | loads another (valid) checkpoint than rank 0 | RankDivergenceError naming both paths | the same |
| load_shape | loads into a like of another shape | CheckpointError naming the entry | RankFailedError naming it |
| load_damaged | (every rank) loads a checkpoint with a flipped byte | CheckpointError naming the file | the same |
| save_refused | saves to a directory of the user's | CheckpointError "not an fshard checkpoint" | RankFailedError |
| save_paths | saves to another path than rank 0 | RankDivergenceError naming both | the same |
| save_fails | raises while building its state dict | its ValueError | RankFailedError; .partial removed |
| save_disk | a full disk while DCP writes its file | CheckpointError "No space left on device on rank 1" | the same |
| full_params, full_state_dict | passes an abstract state | AbstractStateError | RankFailedError naming it |
| latest | fs.latest(dir, mesh=mesh) | the checkpoint committed last | the same |
| local | saves and loads a Mesh.local() state under torchrun | a complete checkpoint of its own, bitwise | the same |
| Ctrl-C | SIGINT while summing its files in the commit | KeyboardInterrupt | CollectiveError naming fs.save; .partial removed |
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.nn as nn

import fshard as fs
from _dist import spawn

TIMEOUT_S = 20  # collective timeout of these groups


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the row records which
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _snapshot(state):
    return [t.clone() for t in state.params.values()] + [
        t.clone() for s in state.opt_state.values() for t in (s.exp_avg, s.exp_avg_sq) if isinstance(t, torch.Tensor)]


def _intact(state, snap) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_snapshot(state), snap))


class _Skipper(nn.Module):
    """Three blocks; the rank named in ``skip`` leaves out blocks.1 when ``batch[2]`` says so."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x, skip_rank=-1):
        for i, b in enumerate(self.blocks):
            if i == 1 and int(os.environ["RANK"]) == skip_rank:
                continue
            x = torch.tanh(b(x))
        return x.square().mean()


def _rows(n):
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    rank, last = mesh.rank, n - 1
    out = {}
    batches = list(awkward_batches(2, 4, rank, n))

    def fresh(model_cls=Awkward, **kw):
        torch.manual_seed(0)
        return fs.init(model_cls(), mesh, fs.adamw(**kw))

    torch.manual_seed(rank)
    out["seeds"] = _outcome(lambda: fs.init(Awkward(), mesh, fs.adamw())) + (True,)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    out["meta_seed"] = _outcome(lambda: fs.init(meta, mesh, fs.adamw(), seed=rank)) + (True,)

    state = fresh(lr=1.0 if rank == last else 1e-3)
    snap = _snapshot(state)
    out["lr"] = _outcome(lambda: fs.compose(awkward_loss)(state, batches[0])) + (_intact(state, snap),)

    state = fresh()
    snap = _snapshot(state)
    chain = (fs.bucket_reduce(1),) if rank == last else ()
    out["chain"] = _outcome(lambda: fs.compose(awkward_loss, *chain)(state, batches[0])) + (_intact(state, snap),)

    for row, transforms in (("skip_unit", ()), ("skip_unit_ahead", (fs.gather_ahead(2), fs.bucket_reduce(1)))):
        torch.manual_seed(0)
        s0 = fs.init(_Skipper(), mesh, fs.adamw())
        step = fs.compose(lambda m, b: m(*b), *transforms)
        x = torch.randn(2, 8)
        s1, _ = step(s0, (x, -1))  # a good step first: the check holds at every step, not only the first
        snap = _snapshot(s1)
        out[row] = _outcome(lambda: step(s1, (x, last))) + (_intact(s1, snap),)

    state = fresh()
    snap = _snapshot(state)
    k = 3 if rank == last else 2
    out["microbatches"] = _outcome(lambda: fs.compose(awkward_loss, fs.accumulate(2))(state, batches[:k])) + (
        _intact(state, snap),)

    state = fresh()
    step = fs.compose(lambda m, b: awkward_loss(m, b) if rank != last else _raise(ValueError("boom on this rank")))
    snap = _snapshot(state)
    out["loss_raises"] = _outcome(lambda: step(state, batches[0])) + (_intact(state, snap),)

    store = FlakyStore()
    with fs.compose(awkward_loss, fs.offload_state(store)) as step:
        s1, _ = step(fresh(), batches[0])  # moves the moments into the store
        snap = _snapshot(s1) + [s.exp_avg.load() for s in s1.opt_state.values()]
        store.armed = rank == last
        out["store_fails"] = _outcome(lambda: step(s1, batches[1])) + (
            _intact(s1, snap) and _snapshot(s1) + [s.exp_avg.load() for s in s1.opt_state.values()] is not None
            and all(torch.equal(a, b) for a, b in zip(snap[-len(s1.opt_state):],
                                                      [s.exp_avg.load() for s in s1.opt_state.values()])),)
        store.armed = False
        s2, _ = step(s1, batches[1])  # the store works again: the same step goes through on every rank
        out["store_retry"] = [t.clone() for t in s2.params.values()]
    with fs.compose(awkward_loss, fs.offload_state(fs.CPUStore())) as step:
        clean = fresh()
        for b in batches[:2]:
            clean, _ = step(clean, b)
    out["store_retry"] = all(torch.equal(a, b) for a, b in zip(out["store_retry"], clean.params.values()))

    store = FlakyStore()  # the same with check_collectives=False: the failure is posted at the commit vote
    with fs.compose(awkward_loss, fs.offload_state(store), check_collectives=False) as step:
        s1, _ = step(fresh(), batches[0])
        snap = _snapshot(s1)
        store.armed = rank == last
        out["store_fails_unchecked"] = _outcome(lambda: step(s1, batches[1])) + (_intact(s1, snap),)
        store.armed = False

    # donate=True: a failure before the update leaves every input usable; one during it loses the state everywhere
    with fs.compose(lambda m, b: awkward_loss(m, b) if rank != last else _raise(ValueError("boom")),
                    donate=True) as step:
        state = fresh()
        snap = _snapshot(state)
        out["donate_before_update"] = _outcome(lambda: step(state, batches[0])) + (
            _intact(state, snap) and not state.donation.done,)
    store = FlakyStore()
    with fs.compose(awkward_loss, fs.offload_state(store), donate=True) as step:
        s1, _ = step(fresh(), batches[0])
        store.armed = rank == last
        kind, text, seconds = _outcome(lambda: step(s1, batches[1]))
        store.armed = False
        out["donate_in_update"] = (kind, text, seconds, True)
        out["donate_in_update_reuse"] = list(_outcome(lambda: step(s1, batches[1]))[:2])

    state = fresh()
    nan_loss = lambda m, b: awkward_loss(m, b) * (float("nan") if rank == last else 1.0)  # noqa: E731
    new, m = fs.compose(nan_loss, fs.skip_nonfinite())(state, batches[0])
    out["nan_skip"] = ("ok" if int(new.skipped) == 1 and int(new.step) == 0 else "wrong", "", 0.0, True)

    state = fresh()
    step = fs.compose(awkward_loss)
    s1, _ = step(state, batches[0])
    snap = _snapshot(s1)
    extra = (lambda: step(s1, batches[1])) if rank == 0 else (lambda: fs.full_params(s1))
    out["extra_step"] = _outcome(extra) + (_intact(s1, snap),)

    return out


def _raise(e):
    raise e


class FlakyStore(fs.CPUStore):
    """A CPU store whose streams fail while ``armed`` (a full disk, a damaged file)."""

    armed = False

    def stream(self, keys, depth=2, writeback=False, max_writes=None):
        if self.armed:
            raise fs.errors.StoreError("injected: the device is full")
        return super().stream(keys, depth=depth, writeback=writeback, max_writes=max_writes)

    def stream_in_place(self, keys):  # (the stream a donated update takes through a CPUStore)
        if self.armed:
            raise fs.errors.StoreError("injected: the device is full")
        return super().stream_in_place(keys)


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_disagree_or_fail_raise_on_every_rank_and_lose_nothing(n):
    outcome = spawn(_rows, n, n, timeout_s=240, collective_timeout_s=TIMEOUT_S)
    assert all(s == "ok" for s, _ in outcome.values()), outcome
    rows = [v for _, v in (outcome[r] for r in range(n))]
    last = n - 1
    for r, row in enumerate(rows):
        for case, (kind, text, seconds, intact) in ((k, v) for k, v in row.items() if isinstance(v, tuple)):
            assert intact, (r, case)
            assert seconds < TIMEOUT_S, (r, case, seconds)  # an fshard error at a check, not a transport timeout
        assert row["seeds"][0] == "RankDivergenceError" and "different initial values" in row["seeds"][1]
        assert "'emb'" in row["seeds"][1] or "blocks.0" in row["seeds"][1] and "manual_seed" in row["seeds"][1]
        assert row["meta_seed"][0] == "RankDivergenceError" and "seed=" in row["meta_seed"][1]
        assert row["lr"][0] == "RankDivergenceError" and "optimizer hyperparameters" in row["lr"][1]
        assert row["chain"][0] == "RankDivergenceError" and "different transforms" in row["chain"][1]
        # where they part: blocking, rank 0 gathers blocks.1 where the last rank goes on to blocks.2; ahead, all
        # gather blocks.0-2 in forward (prefetched), then rank 0 gathers blocks.0 for backward (blocks.2 and 1 stay
        # gathered) where the last rank, off the gather order since it skipped, gathers blocks.2 again
        for case, theirs in (("skip_unit", "blocks.1"), ("skip_unit_ahead", "blocks.0")):
            kind, text = row[case][:2]
            assert kind == "RankDivergenceError", (r, case, text)  # both sides named:
            assert f"rank {last}: all_gather of 'blocks.2' (96 x float32) in step 1" in text, (r, case, text)
            assert f"rank 0: all_gather of '{theirs}' (96 x float32) in step 1" in text, (r, case, text)
        assert row["microbatches"][0] == "BatchMismatchError"
        kind, text = row["loss_raises"][:2]
        if r == last:  # an fshard error from the ValueError, naming it (issue #38)
            assert kind == "StepError" and f"rank {last} failed in step 0: ValueError: boom on this rank" in text
            assert "The other ranks raise RankFailedError" in text and "catch fs.FshardError" in text, text
        else:
            assert kind == "RankFailedError" and f"rank {last} failed in step 0: ValueError: boom on this" in text, text
            assert "no rank committed the step" in text
        kind, text = row["store_fails"][:2]
        if r == last:
            assert kind == "OffloadError" and "injected" in text and "input state is unchanged" in text
        else:
            assert kind == "RankFailedError" and f"rank {last} failed in step 1: OffloadError" in text, text
        kind, text = row["store_fails_unchecked"][:2]
        assert kind == ("OffloadError" if r == last else "RankFailedError"), (r, kind, text)
        assert r == last or "commit vote" in text, text
        assert row["nan_skip"][0] == "ok"
        assert row["donate_before_update"][0] == ("StepError" if r == last else "RankFailedError")
        kind, text = row["donate_in_update"][:2]
        if r == last:
            assert kind == "OffloadError" and "was donated" in text and "restart from a checkpoint" in text, text
        else:
            assert kind == "RankFailedError" and "unless it was donated and its update had begun" in text, text
        assert row["donate_in_update_reuse"][0] == "DonatedStateError", row["donate_in_update_reuse"]
        kind, text = row["extra_step"][:2]
        assert kind == "RankDivergenceError" and "rank 0: all_reduce of 'agree' (12 x float64) in step 1" in text
        assert "rank 1: all_gather of '<root>' (" in text and "x float32) in fs.full_params" in text, text
        assert row["store_retry"], (r, "the retried offloaded step differs from a clean one")


def _hang(n):
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    step = fs.compose(awkward_loss, fs.gather_ahead(2), fs.bucket_reduce(1))
    batches = list(awkward_batches(2, 2, mesh.rank, n))
    state, _ = step(state, batches[0])
    if mesh.rank == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # a hung rank: never answers again
    snap = _snapshot(state)
    return _outcome(lambda: step(state, batches[1])) + (_intact(state, snap),)


@pytest.mark.parametrize("n", [2, 3])
def test_a_hung_rank_is_named_by_the_others_within_the_timeout(n):
    timeout = 6
    outcome = spawn(_hang, n, n, timeout_s=120, collective_timeout_s=timeout, wait_for=range(n - 1))
    assert outcome[n - 1][0] == "hung", outcome
    for r in range(n - 1):
        status, (kind, text, seconds, intact) = outcome[r]
        assert status == "ok" and kind == "CollectiveError", outcome[r]
        assert "in step 1" in text and "the check before its" in text, text
        assert f"Ranks that had not arrived: [{n - 1}]" in text, text
        assert "timeout_s" in text and "torchrun --max-restarts" in text, text
        assert intact and seconds < timeout + 10, seconds


def _ctrl_c():
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    batch = next(awkward_batches(2, 1, mesh.rank, 2))
    if mesh.rank == 1:
        time.sleep(4)  # late: rank 0 waits at the step's first check
        return _outcome(lambda: fs.compose(awkward_loss)(state, batch))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        fs.compose(awkward_loss)(state, batch)
        return ("ok", "", time.monotonic() - t0)
    except KeyboardInterrupt:
        return ("KeyboardInterrupt", "", time.monotonic() - t0)


def test_ctrl_c_interrupts_a_wait_for_another_rank():
    outcome = spawn(_ctrl_c, 2, timeout_s=120, collective_timeout_s=8)
    status, (kind, _, seconds) = outcome[0]
    assert status == "ok" and kind == "KeyboardInterrupt" and seconds < 3, outcome[0]
    assert outcome[1][0] != "hung", outcome[1]


# --- an empty batch on one rank (issue #37) ------------------------------------------------------------------------

def _empty_batch(n):
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    x, y = next(awkward_batches(2, 1, mesh.rank, n))
    empty = (x[:0], y[:0])
    mine = empty if mesh.rank == n - 1 else (x, y)
    snap = _snapshot(state)
    step = fs.compose(awkward_loss, fs.gather_ahead(2), fs.bucket_reduce(1))
    out = {"mean": _outcome(lambda: step(state, mine)) + (_intact(state, snap),),
           "eval": _outcome(lambda: step.eval(state, mine)) + (_intact(state, snap),)}

    def summed(module, batch):  # a loss_fn that handles an empty batch: a sum over tokens / the global count
        x, y = batch
        return torch.nn.functional.cross_entropy(module(x).flatten(0, 1), y.flatten(), reduction="sum") / (
            2 * 6 * (n - 1))
    new, m = fs.compose(summed)(state, mine)
    out["summed"] = (m["loss"], int(new.step))
    out["after"] = float(step(state, (x, y))[1]["loss"])  # the same state still trains
    return out


def test_an_empty_batch_whose_loss_is_nan_is_refused_on_every_rank():
    n = 2
    outcome = spawn(_empty_batch, n, n, timeout_s=180, collective_timeout_s=TIMEOUT_S)
    assert all(s == "ok" for s, _ in outcome.values()), outcome
    for r, (_, row) in outcome.items():
        for case in ("mean", "eval"):
            kind, text, seconds, intact = row[case]
            assert intact and seconds < TIMEOUT_S, (r, case, row[case])
            if r == n - 1:
                assert kind == "EmptyBatchError", (r, case, kind, text)
                assert "rank 1 passed a batch with no samples" in text and "DistributedSampler" in text, text
                assert "Nothing was updated" in text
            else:
                assert kind == "RankFailedError" and "EmptyBatchError" in text, (r, case, kind, text)
        loss, step = row["summed"]
        assert step == 1 and loss == loss and loss > 0  # finite: such a loss_fn trains through an empty batch
        assert row["after"] == row["after"]
    assert issubclass(fs.errors.EmptyBatchError, fs.errors.BatchMismatchError)


# --- One error family on every rank (issue #38) ---

def _retry(n):
    """A clean run, then the same run where rank n - 1's loss_fn raises a ValueError at its first call, retried by
    ``except fs.FshardError`` on every rank; blocking and with gather_ahead + bucket_reduce (work in flight)."""
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    batches = list(awkward_batches(2, 3, mesh.rank, n))
    out = {}
    for name, transforms in (("blocking", ()), ("ahead", (fs.gather_ahead(2), fs.bucket_reduce(1)))):
        finals = []
        for fail in (False, True):
            calls, caught = [0], []

            def loss_fn(m, b):
                calls[0] += 1
                if fail and mesh.rank == n - 1 and calls[0] == 1:
                    raise ValueError("boom at the first call")
                return awkward_loss(m, b)

            torch.manual_seed(0)
            state = fs.init(Awkward(), mesh, fs.adamw())
            with fs.compose(loss_fn, *transforms) as step:
                for b in batches:
                    for _ in range(3):  # the README's recipe: retry a failed step a few times
                        try:
                            state, _ = step(state, b)
                            break
                        except fs.FshardError as e:
                            caught.append((type(e).__name__, str(e), type(e.__cause__).__name__,
                                           str(e.__cause__), isinstance(e, fs.errors.RankFailedError)))
            finals.append(_snapshot(state) + [state.step.clone()])
        out[name] = (caught, all(torch.equal(a, b) for a, b in zip(*finals)) and len(finals[0]) == len(finals[1]))
    return out


@pytest.mark.parametrize("n", [2])
def test_every_rank_catches_fshard_error_and_a_retry_ends_bitwise_as_a_clean_run(n):
    outcome = spawn(_retry, n, n, timeout_s=240, collective_timeout_s=TIMEOUT_S)
    assert all(s == "ok" for s, _ in outcome.values()), outcome
    for r in range(n):
        for name, (caught, same) in outcome[r][1].items():
            assert same, (r, name, "the retried run differs from the clean one")
            assert len(caught) == 1, (r, name, caught)  # one failure, caught once, then the retry went through
            kind, text, cause, cause_text, rank_failed = caught[0]
            assert rank_failed, (r, name, kind)  # except fs.errors.RankFailedError would catch it on every rank too
            if r == n - 1:  # the failing rank: an fshard error raised from its own, which it names
                assert kind == "StepError" and cause == "ValueError" and cause_text == "boom at the first call"
                assert f"rank {r} failed in step 0: ValueError: boom at the first call" in text, text
                assert "input state is unchanged" in text and "catch fs.FshardError" in text, text
            else:
                assert kind == "RankFailedError" and cause == "NoneType", (r, name, kind, cause)
                assert f"rank {n - 1} failed in step 0: ValueError: boom at the first call" in text, text


def test_keyboard_interrupt_and_system_exit_are_raised_as_they_are():
    """Not Exceptions: a retry written as ``except fs.FshardError`` must not swallow Ctrl-C or sys.exit."""
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    torch.manual_seed(0)
    state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw())
    batch = next(awkward_batches(2, 1, 0, 1))
    for error in (KeyboardInterrupt(), SystemExit(3)):
        with pytest.raises(type(error)) as e:
            fs.compose(lambda m, b: _raise(error))(state, batch)
        assert e.value is error and not isinstance(e.value, fs.FshardError)
    with pytest.raises(fs.StepError) as e:  # at world size 1 too: one recipe whatever the world size
        fs.compose(lambda m, b: _raise(ZeroDivisionError("local")))(state, batch)
    assert isinstance(e.value.__cause__, ZeroDivisionError) and "ZeroDivisionError: local" in str(e.value)
    assert "The other ranks" not in str(e.value)
    state2, _ = fs.compose(awkward_loss)(state, batch)  # the state is still usable
    assert int(state2.step) == 1


# --- checkpoints: a failure on one rank is an error on every rank, at once (issue #37) ------------------------------

def _ckpt_rows(d):
    import errno

    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fsys

    import fshard as fs
    import fshard.checkpoint._save as ckm
    from models import Awkward
    mesh = fs.Mesh.from_env()
    rank, out = mesh.rank, {}
    run, mine = os.path.join(d, "run"), os.path.join(d, "mine")
    if rank == 0:
        os.makedirs(mine)
        with open(os.path.join(mine, "notes.txt"), "w") as f:
            f.write("mine")
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())  # (a collective: rank 0's files exist after it)
    fs.save(os.path.join(run, "step0"), state)
    fs.save(os.path.join(run, "other0"), state.replace(step=torch.tensor(9)))
    snap = _snapshot(state)

    def row(name, fn):
        out[name] = _outcome(fn)
        out[name + ":kept"] = (sorted(os.listdir(run)) == ["other0", "step0"] and os.listdir(mine) == ["notes.txt"]
                               and _intact(state, snap))

    row("load_missing", lambda: fs.load(os.path.join(run, "step0" if rank == 0 else "nope"), like=state))
    row("load_paths", lambda: fs.load(os.path.join(run, "step0" if rank == 0 else "other0"), like=state))
    smaller = Awkward()
    smaller.up = nn.Linear(8, 5, bias=False)
    smaller = fs.init(smaller, mesh, fs.adamw())
    row("load_shape", lambda: fs.load(os.path.join(run, "step0"), like=state if rank == 0 else smaller))
    row("save_refused", lambda: fs.save(mine if rank == 1 else os.path.join(run, "step1"), state))
    row("save_paths", lambda: fs.save(os.path.join(run, f"step1-{rank}"), state))
    real_entries = ckm._entries
    if rank == 1:
        ckm._entries = lambda *a, **k: _raise(ValueError("injected on this rank"))
    row("save_fails", lambda: fs.save(os.path.join(run, "step0"), state.replace(step=torch.tensor(5))))
    ckm._entries = real_entries
    real_write = fsys._write_item
    if rank == 1:
        fsys._write_item = lambda *a, **k: _raise(OSError(errno.ENOSPC, "No space left on device"))
    row("save_disk", lambda: fs.save(os.path.join(run, "step0"), state.replace(step=torch.tensor(5))))
    fsys._write_item = real_write
    torch.manual_seed(0)
    abstract = fs.init(Awkward(), mesh, fs.adamw(), abstract=True)
    row("full_params", lambda: fs.full_params(state if rank == 0 else abstract))
    row("full_state_dict", lambda: fs.full_state_dict(state if rank == 0 else abstract))
    out["latest"] = fs.latest(run, mesh=mesh)
    out["step0"] = int(fs.load(os.path.join(run, "step0"), like=state).step)  # after the failed saves
    dist.barrier()
    if rank == 0:  # a damaged file: every rank names it alike
        data = os.path.join(run, "step0", "__1_0.distcp")
        raw = bytearray(open(data, "rb").read())
        raw[len(raw) // 2] ^= 0xFF
        open(data, "wb").write(bytes(raw))
    dist.barrier()
    out["load_damaged"] = _outcome(lambda: fs.load(os.path.join(run, "step0"), like=state))
    out["other0"] = int(fs.load(os.path.join(run, "other0"), like=state).step)  # the group still works

    local = fs.init(Awkward(), fs.Mesh.local(), fs.adamw()).replace(step=torch.tensor(rank + 1))
    mine_dir = os.path.join(d, f"local{rank}")  # a Mesh.local() state under torchrun: a checkpoint of its own
    fs.save(mine_dir, local)
    back = fs.load(mine_dir, like=local)
    out["local"] = (sorted(os.listdir(mine_dir)) == [".metadata", "__0_0.distcp", "fshard.json"]
                    and int(back.step) == rank + 1
                    and all(torch.equal(a, b) for a, b in zip(back.params.values(), local.params.values())))
    return out


def test_checkpoint_calls_fail_on_every_rank_at_once_and_keep_the_data():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        outcome = spawn(_ckpt_rows, 2, d, timeout_s=240, collective_timeout_s=TIMEOUT_S)
    assert all(s == "ok" for s, _ in outcome.values()), outcome
    rows = [outcome[r][1] for r in range(2)]
    for r, row in enumerate(rows):
        for case, v in row.items():
            if case.endswith(":kept"):
                assert v, (r, case, "the user's files, the checkpoints or the state changed")
            elif isinstance(v, tuple):
                assert v[2] < TIMEOUT_S, (r, case, v)  # an fshard error at a check, never a transport timeout
        text = _failed_on_rank_1(row["load_missing"], r, "CheckpointError", "nope is not a complete fshard checkpoint",
                                 "rank 1 failed at its start: CheckpointError")
        assert r == 1 or "Nothing was loaded, and like is unchanged" in text, text
        kind, text = row["load_paths"][:2]
        assert kind == "RankDivergenceError" and "step0" in text and "other0" in text, text
        assert "Every rank must load the same checkpoint" in text, text
        kind, text = row["load_shape"][:2]
        assert kind == ("CheckpointError" if r == 1 else "RankFailedError"), (kind, text)
        assert "model.up.weight" in text and "(37, 8)" in text, text
        _failed_on_rank_1(row["save_refused"], r, "CheckpointError", "mine exists and is not an fshard checkpoint",
                          "rank 1 failed at its arguments: CheckpointError")
        kind, text = row["save_paths"][:2]
        assert kind == "RankDivergenceError" and "step1-0" in text and "step1-1" in text, text
        assert "Every rank must pass the same path" in text, text
        text = _failed_on_rank_1(row["save_fails"], r, "ValueError", "injected on this rank",
                                 "ValueError: injected on this rank")
        assert r == 1 or "step0 is unchanged" in text, text
        kind, text = row["save_disk"][:2]
        assert kind == "CheckpointError" and "No space left on device on rank 1" in text, text
        assert "step0 is unchanged" in text, text
        for case in ("full_params", "full_state_dict"):
            kind, text = row[case][:2]
            if r == 1:
                assert kind == "AbstractStateError", (case, kind, text)
            else:
                assert kind == "RankFailedError" and f"rank 1 failed in fs.{case}: AbstractStateError" in text, text
        assert row["latest"].endswith("other0")  # the one committed last
        kind, text = row["load_damaged"][:2]
        assert kind == "CheckpointError" and "__1_0.distcp: corrupted (CRC-32 mismatch)" in text, text
        assert row["step0"] == 0 and row["other0"] == 9 and row["local"], row


def _ctrl_c_in_save(d):
    import fshard as fs
    import fshard.checkpoint._save as ckm
    from models import Awkward
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    fs.save(os.path.join(d, "a"), state)
    if mesh.rank == 1:  # Ctrl-C while this rank sums its share of the files, in the commit
        signal.signal(signal.SIGINT, signal.default_int_handler)
        real = ckm.crc_share

        def interrupted(*a, **k):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            return real(*a, **k)
        ckm.crc_share = interrupted
    return _outcome(lambda: fs.save(os.path.join(d, "a"), state.replace(step=torch.tensor(1)))) + (
        sorted(os.listdir(d)),)


def test_ctrl_c_on_one_rank_in_a_save_is_an_fshard_error_on_the_other():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        outcome = spawn(_ctrl_c_in_save, 2, d, timeout_s=120, collective_timeout_s=TIMEOUT_S)
        assert outcome[1][0] == "error" and "KeyboardInterrupt" in outcome[1][1], outcome[1]
        status, (kind, text, seconds, left) = outcome[0]
        assert status == "ok" and kind == "CollectiveError", outcome[0]
        assert "in fs.save" in text and "checksums" in text and seconds < TIMEOUT_S, (text, seconds)
        assert left == ["a"], left  # the .partial removed
        from models import Awkward
        like = fs.init(Awkward(), fs.Mesh.local(), fs.adamw())
        assert int(fs.load(os.path.join(d, "a"), like=like).step) == 0  # the previous checkpoint


# --- a custom transform's arguments are checked across ranks (issue #39) ---

def _custom_transform_arguments(kind):
    """Each rank composes a user's transform that scales the update; ``kind``: "same" (the same factor on every
    rank), "differ" (rank 1's is another), "differ_dataclass" (the same with a dataclass transform). Returns the
    error (type, message) or None, whether the input state is intact, and the losses of 2 steps."""
    import dataclasses

    from models import Awkward, awkward_batches, awkward_loss

    class scaled(fs.Transform):  # the long form: a grads link of its own (grads_link)
        def __init__(self, factor):
            self.factor = factor

        def grads_link(self):
            factor = self.factor

            class Scaled(fs.protocol.GradsPolicy):
                def __call__(self, comm, grads):
                    return grads.replace(scale=grads.scale * factor)
            return Scaled()

        def __repr__(self):  # a repr that leaves the argument out no longer hides it from the rank check
            return "scaled()"

    @dataclasses.dataclass(frozen=True)
    class scaled_dc(scaled):
        factor: float

    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    before = _snapshot(state)
    factor = 0.5 if kind == "same" or mesh.rank == 0 else 0.25
    transform = (scaled_dc if kind == "differ_dataclass" else scaled)(factor)
    losses, error = [], None
    with fs.compose(awkward_loss, transform) as step:
        try:
            for b in awkward_batches(2, 2, mesh.rank, mesh.world_size):
                state, m = step(state, b)
                losses.append(m["loss"])
        except fs.FshardError as e:
            error = (type(e).__name__, str(e))
    intact = all(torch.equal(a, b) for a, b in zip(before, _snapshot(state)))
    return error, intact, losses, int(state.step)


@pytest.mark.parametrize("kind", ["same", "differ", "differ_dataclass"])
def test_a_custom_transform_with_other_arguments_on_one_rank_is_a_rank_divergence(kind):
    outcome = spawn(_custom_transform_arguments, 2, kind, timeout_s=120, collective_timeout_s=TIMEOUT_S)
    assert all(s == "ok" for s, _ in outcome.values()), outcome
    results = [outcome[r][1] for r in range(2)]
    if kind == "same":
        for error, _, losses, steps in results:
            assert error is None and steps == 2 and len(losses) == 2, (error, steps)
        assert results[0][2] == results[1][2]  # the loss is averaged over ranks: the same on both
        return
    for r, (error, intact, losses, steps) in enumerate(results):
        assert error is not None and error[0] == "RankDivergenceError", (r, error)
        assert "ranks composed different transforms" in error[1], error
        assert f"factor={0.5 if r == 0 else 0.25}" in error[1], error  # this rank's argument, named
        assert intact and steps == 0 and losses == [], (r, intact, steps)


def _failed_on_rank_1(outcome, r: int, kind: str, mine: str, theirs: str) -> str:
    """A case that fails on rank 1: there ``kind`` with ``mine`` in its message, on rank 0 a ``RankFailedError``
    with ``theirs``; returns the message."""
    got, text = outcome[:2]
    if r == 1:
        assert got == kind and mine in text, text
    else:
        assert got == "RankFailedError" and theirs in text, text
    return text


# --- check_collectives=False checks no collective (issue #39) ---

def _checks_per_step(setting):
    """Checks made on the mesh in each of 2 steps composed with ``check_collectives=setting``."""
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    counts = []
    with fs.compose(awkward_loss, check_collectives=setting) as step:
        for batch in awkward_batches(2, 2, rank=mesh.rank, world_size=2):
            before = mesh.checks
            state, _ = step(state, batch)
            counts.append(mesh.checks - before)
    return counts


def test_check_collectives_false_checks_no_collective_and_the_default_checks_each():
    """(A same-size divergence under False, found at the end of the step: tests/test_multirank.py.)"""
    counts = {}
    for setting in (False, None, True):
        outcome = spawn(_checks_per_step, 2, setting, timeout_s=120, collective_timeout_s=TIMEOUT_S)
        assert all(s == "ok" for s, _ in outcome.values()), outcome
        counts[setting] = outcome[0][1]
        assert outcome[1][1] == counts[setting], (setting, outcome)  # every rank counts alike
    assert counts[False] == [1, 1], counts  # the commit vote only, from the first step on
    assert counts[None] == counts[True] and all(c > 5 for c in counts[True]), counts  # (CPU: every collective)
