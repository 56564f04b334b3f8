"""How ranks agree: the check before each collective, a failure told to every rank, transport errors explained.

A step's collectives only pair correctly if every rank issues the same ones in the same order; gloo answers
collectives of different sizes by aborting the process, and one rank that raises leaves the others waiting until the
timeout. So, before each collective of a step (``fs.compose(check_collectives=...)``), every rank joins one
all-gather of two float64 numbers, the same size everywhere, so it cannot mismatch (``check``):

    [h, failed]     h: a 20-bit hash of the collective about to be issued; failed: 1 on a rank that raised

If every rank's h is the same and no rank failed, the collective goes ahead. (An all-gather, not an all-reduce of
``[h, h * h, failed]`` deciding equality from the sums: gloo's all-reduce of a few numbers takes about twice its
all-gather's time at two ranks, and those sums are exact in float64 only up to 90 ranks.) Otherwise every rank
learns it at the same check, and one all-gather of fixed-size descriptors (what each rank was about to do, or the
error it raised) lets each raise an error that names every rank's side: ``RankDivergenceError`` (different
collectives) or ``RankFailedError`` (another rank raised). A rank that raises mid-step completes what it has in
flight and posts ``failed`` at the others' next check (``Comm.fail``); since the others only issue a collective
after a check that every rank joined, nothing is left waiting (exchanges checked ahead, all at once, are issued with
zeros by a rank that fails before them: fshard/dist/_promises.py; a step that issues the collectives of the two
before it checks that sequence once, at its start, and a rank that leaves it issues the rest with zeros too:
fshard/dist/_replay.py). The step ends with such a check (the commit vote), so a step returns a new state on every
rank or raises on every rank.

A collective that fails in the transport (a timeout while a rank is hung, a connection closed by a dead rank)
is a ``CollectiveError`` naming the step, the collective and, through torch.distributed's store, the ranks that had
not arrived. Waits return to the interpreter every second, so Ctrl-C interrupts them (CPU meshes).
"""
from __future__ import annotations

import time
import zlib
from datetime import timedelta

import optree
import torch
import torch.distributed as dist

from ._bare import all_gather_single, bare
from ..errors import (BatchMismatchError, CollectiveError, FshardError, RankDivergenceError, RankFailedError,
                      StepError)

HASH_BITS = 20  # small enough that sum(h**2) over 8 ranks is exact in float64 (see all_equal)
_DESC_BYTES = 320  # one rank's descriptor in the all-gather after a failed check
_REPORT_S = 3.0  # after a transport error, how long to wait for the other ranks' reports in the store
_SLICE = timedelta(seconds=1)  # a wait returns to the interpreter this often (Ctrl-C)
_SLICE_EXPIRED = "Operation timed out!"  # gloo's message when such a slice ends, the work still running


def small_hash(obj) -> int:
    """A HASH_BITS-bit hash of ``repr(obj)``, the same in every process."""
    return zlib.crc32(repr(obj).encode()) & ((1 << HASH_BITS) - 1)


def all_equal(n: int, sums: list[float], sq_sums: list[float]) -> list[bool]:
    """For each small integer hash, from its sum ``sums[j]`` and sum of squares ``sq_sums[j]`` over ``n`` ranks:
    does every rank hold the same one? All n values are equal iff n * sum(h^2) == sum(h)^2 (Cauchy-Schwarz).

    The check is exact: each h < 2**HASH_BITS, so every partial sum of h (< n * 2**20) and of h^2 (< n * 2**40),
    and both n * sum(h^2) and sum(h)^2 (< n^2 * 2**40), are integers below 2**53 for n <= 8 (indeed n <= 90),
    which float64 holds exactly whatever order the all-reduce adds them in."""
    return [n * q == s * s for s, q in zip(sums, sq_sums)]


# --- the check before a collective ---------------------------------------------------------------------------------

def describe(entry: tuple) -> str:
    kind, tag, dtype, numel = entry
    if kind == "promise":  # (Collectives.promise: numel is the checksum of the exchanges' table)
        return f"check of the next {tag} at once (checksum {numel})"
    return f"{kind} of {tag!r} ({numel} x {dtype})" if kind != "vote" else f"{tag} vote at the end of the step"


def check(comm, h: int, failed: bool, what) -> tuple[bool, bool]:
    """One check every rank joins (the module docstring): an all-gather of ``[h, failed]`` in the mesh's control
    group. Returns whether every rank passed the same ``h`` and whether any rank failed. ``what()`` names the
    check in a transport error (``wait_works``)."""
    mesh = comm.mesh
    mine = torch.tensor([float(h), float(failed)], dtype=torch.float64, device=mesh.device)
    every = torch.empty(2 * mesh.world_size, dtype=torch.float64, device=mesh.device)
    mesh.runtime.checks += 1  # (the same count on every rank: explain() keys its reports by it)
    with bare():
        work = all_gather_single(every, mine, mesh.control_group)
    wait_works([work], comm, what)
    mesh.hold(mine, every)  # the last check before the process exits may be this one (Mesh.hold)
    got = every.tolist()
    return len(set(got[0::2])) == 1, any(got[1::2])


def exchange(comm, entry: tuple, failure: BaseException | None = None) -> None:
    """One check before ``entry`` (the module docstring). Returns if every rank is about to issue ``entry`` and none
    failed; else raises on every rank (the failing rank itself returns, to raise its own error)."""
    comm.bytes["check"] += 16  # this rank's [h, failed]; not "control": step.plan's figures are a checked-once step's
    same, failed = check(comm, small_hash(entry) if failure is None else 0, failure is not None,
                         lambda: f"the check before its {describe(entry)}")
    if same and not failed:
        return
    comm.closed = True  # every rank knows: nothing more may be posted on this step's behalf
    where = f" in {comm.context}" if comm.context else ""
    mine = (f"failed{where}: {type(failure).__name__}: {failure}" if failure is not None else
            f"{describe(entry)}{where}")
    sides = _descriptors(comm, mine)
    if failure is not None:
        return
    if failed:
        bad = [f"rank {r} {d}" for r, d in enumerate(sides) if d.startswith("failed")]
        raise RankFailedError(
            f"{'; '.join(bad)}. This rank stopped before its {describe(entry)}; no rank committed the step, "
            "so every rank's input state is unchanged (unless it was donated and its update had begun). The error "
            "above is the failing rank's own: fix it there and retry the step on every rank.")
    listing = "; ".join(f"rank {r}: {d}" for r, d in enumerate(sides))
    raise RankDivergenceError(
        f"ranks were about to issue different collectives ({listing}). Nothing was updated. Every rank must "
        "gather and reduce the same units in the same order, with the same transforms composed; make control flow "
        "independent of the rank's data, or, if a module calls some of its children depending on the data (the "
        "experts of a mixture of experts), declare it with fs.init(..., routed=[module path]), and each child "
        "becomes a unit that every rank gathers and reduces at each call of that module.")


def _descriptors(comm, mine: str) -> list[str]:
    """Every rank's descriptor (what it was about to do, or its error), by one all-gather of fixed-size bytes."""
    mesh = comm.mesh
    raw = mine.encode()[:_DESC_BYTES]
    t = torch.zeros(_DESC_BYTES, dtype=torch.uint8, device=mesh.device)
    t[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else t[:0]
    out = [torch.empty_like(t) for _ in range(mesh.world_size)]
    with bare():
        work = dist.all_gather(out, t, group=mesh.control_group, async_op=True)
    wait_works([work], comm, lambda: "the exchange of what each rank did")
    mesh.hold(t, *out)  # a script that catches the error may exit right after (Mesh.hold)
    return [bytes(o.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for o in out]


def foreign(error: BaseException) -> bool:
    """Is ``error`` one a failing rank raises as a ``StepError`` (``step_error``)? Not fshard's own errors (they
    name their fix), nor KeyboardInterrupt and SystemExit (not Exceptions: a retry must not catch them)."""
    return isinstance(error, Exception) and not isinstance(error, FshardError)


def step_error(comm, error: Exception, told: bool) -> StepError:
    """What the failing rank raises from a ``foreign`` error, so that one ``except fs.FshardError`` catches a
    step's failure on every rank (the others raise ``RankFailedError``). ``told``: whether the other ranks know
    (``Comm.fail``)."""
    mesh, where = comm.mesh, f" in {comm.context}" if comm.context else ""
    others = ("" if mesh.world_size == 1 else
              " The other ranks raise RankFailedError naming it." if told else
              " The other ranks were not told (fs.compose(check_collectives=False) leaves collectives unchecked): "
              "they fail at their collective timeout with CollectiveError.")
    return StepError(
        f"rank {mesh.rank} failed{where}: {type(error).__name__}: {error} (the cause, above). No rank committed the "
        f"step, so every rank's input state is unchanged (unless it was donated and its update had begun).{others} "
        "To retry, catch fs.FshardError on every rank and call the step again with the same state; to stop, fix "
        "the cause.")


# --- waits ---------------------------------------------------------------------------------------------------------

def wait_works(works: list, comm, what) -> None:
    """Wait for ``works``; a transport error becomes a ``CollectiveError`` naming ``what()`` (a callable, so that the
    text is only made when it is needed: waits are on the step's hot path). On a CPU mesh the wait
    returns to the interpreter every second (gloo's ``wait(timeout)`` leaves the work running when it expires), so
    Ctrl-C (KeyboardInterrupt) is not held off until the process group's timeout."""
    try:
        for w in works:
            if comm.mesh.device.type != "cpu":
                w.wait()
                continue
            while True:
                try:
                    w.wait(timeout=_SLICE)
                    break
                except RuntimeError as e:
                    if _SLICE_EXPIRED not in str(e):
                        raise
    except (RuntimeError, dist.DistError) as e:
        comm.closed = True
        raise CollectiveError(explain(comm, what(), e)) from e


def explain(comm, what: str, error: BaseException) -> str:
    """The message of a transport error: the step, the collective, and which ranks had not arrived (each rank that
    fails writes a key to torch.distributed's store; the ranks without one within a few seconds are named)."""
    mesh = comm.mesh
    where = f" in {comm.context}" if comm.context else ""
    missing = _absent_ranks(mesh)
    who = ("" if missing is None else
           f" Ranks that had not arrived: {missing}." if missing else " Every rank arrived and failed the same way.")
    return (f"rank {mesh.rank}{where} failed waiting for {what}: {error}.{who} A rank that is hung, dead, stopped "
            "(SIGSTOP), or that left fshard's sequence of collectives (it raised outside a step, stepped a different "
            "number of times, or called another collective) leaves the others waiting; collectives time out after "
            f"{mesh.timeout.total_seconds():g} s (fs.Mesh.from_env(timeout_s=...) or FSHARD_TIMEOUT_S). The "
            "process group cannot be used after this: restart the job (torchrun --max-restarts) and resume from a "
            "checkpoint (fs.load(fs.latest(dir), like=...)).")


def _absent_ranks(mesh) -> list[int] | None:
    """Ranks that did not report being stuck at this rank's last check within ``_REPORT_S`` (None: unknown). The
    store lives in rank 0's process: when rank 0 has answered and exited while this rank still polls (the ranks
    time out a moment apart), the answer is the last poll's."""
    absent = None
    try:
        store = dist.distributed_c10d._get_default_store()  # the rendezvous store; no public accessor exists
        prefix = f"fshard/stuck/{getattr(mesh.group, 'group_name', 'g')}/{mesh.checks}"
        store.set(f"{prefix}/{mesh.rank}", "1")
        ranks = dist.get_process_group_ranks(mesh.group)
        deadline = time.monotonic() + _REPORT_S
        while True:
            absent = [ranks[r] for r in range(mesh.world_size) if not store.check([f"{prefix}/{r}"])]
            if not absent or time.monotonic() > deadline:
                return absent
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - no store (or it is gone with a dead rank): the last poll, else unknown
        return absent


# --- agreement on the step ---------------------------------------------------------------------------------------

def agree(comm, values: list[float], hashes: list[int]) -> tuple[list[float], list[bool]]:
    """One all-reduce that sums ``values`` over ranks and tells, for each small integer in ``hashes``, whether
    every rank holds the same one (``all_equal``, exact in float64)."""
    n = comm.mesh.world_size
    buf = torch.tensor(values + [float(h) for h in hashes] + [float(h) ** 2 for h in hashes], dtype=torch.float64,
                       device=comm.mesh.device)
    comm.all_reduce(buf, "agree")
    k, m = len(values), len(hashes)
    sums, sq = buf[k:k + m].tolist(), buf[k + m:].tolist()
    return buf[:k].tolist(), all_equal(n, sums, sq)


def batch_hash(batch) -> int:
    leaves, spec = optree.tree_flatten(batch, none_is_leaf=True)
    return small_hash([str(spec)] + [f"{l.dtype}/{l.dim()}" if isinstance(l, torch.Tensor) else type(l).__name__
                                     for l in leaves])


_CHECKS = ("batch", "step", "model", "optimizer", "transforms", "sequence")  # what check_ranks compares, in order
CHECKED = len(_CHECKS)  # (step.plan counts the hashes)


def check_ranks(comm, state, batch, chain: int = 0, transforms: tuple = (), sequence: int = 0) -> bool:
    """Before any gather: do all ranks run the same step of the same model, with the same optimizer hyperparameters
    (at this step: a schedule's learning rate too) and the same composed transforms (``chain``, the hash of their
    fingerprints ``transforms``), on batches of the same structure? A mismatch here would otherwise surface as a
    hang, as silently mixed shards, or as ranks that train different models. Every rank raises the same error
    (``comm.unanimous``). Returns whether every rank holds the same ``sequence`` (the checksum of the collectives
    it would follow unchecked, fshard/dist/_replay.py; 0 for none): where they differ, none follows one."""
    if comm.mesh.world_size == 1:
        return False
    step = int(state.step)
    opt = state.spec.optimizer
    hashes = (batch_hash(batch), step % (1 << HASH_BITS), state.spec.fingerprint, small_hash(opt.fingerprint(step)),
              chain, sequence & ((1 << HASH_BITS) - 1))
    _, same = agree(comm, [], list(hashes))
    ok = dict(zip(_CHECKS, same))
    if not ok["batch"]:
        leaves = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
                  for x in optree.tree_leaves(batch, none_is_leaf=True)]
        raise comm.unanimous(BatchMismatchError(
            "ranks passed batches of different structure to the same step (this rank's: "
            f"{optree.tree_structure(batch, none_is_leaf=True)}, leaves {leaves}). "
            "Every rank must pass the same kind of batch (same containers, keys and tensor dtypes and ranks); "
            "only sizes may differ. Check the data loader of each rank."))
    if not ok["model"]:
        raise comm.unanimous(RankDivergenceError(
            "ranks hold states of different models or layouts; call fs.init with the same model, units and world "
            "size on every rank."))
    if not ok["step"]:
        raise comm.unanimous(RankDivergenceError(
            f"ranks are at different steps of training (this rank's state is at step {step}); every rank must call "
            "step(state, batch) with the state returned by its previous step."))
    if not ok["optimizer"]:
        raise comm.unanimous(RankDivergenceError(
            f"ranks use different optimizer hyperparameters at step {step} (this rank's: {opt.fingerprint(step)}); "
            "build the optimizer (fs.adamw(...), its schedule and weight-decay mask) the same way on every rank."))
    if not ok["transforms"]:
        raise comm.unanimous(RankDivergenceError(
            f"ranks composed different transforms (fs.compose(loss_fn, ...); this rank's: {', '.join(transforms)}); "
            "compose the same ones, with the same arguments and in the same order, on every rank."))
    return ok["sequence"]
