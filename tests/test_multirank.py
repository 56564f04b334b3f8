"""Invariants and misuse that need several ranks: collective order, rank divergence, bad batches, dead ranks."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from _dist import run_ranks, spawn


def _traces(model_name):
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    if model_name == "gpt":
        cfg = GPTConfig.tiny()
        model, loss, batches = GPT(cfg), loss_fn, synthetic_batches(cfg, 2, 3, rank=mesh.rank, world_size=mesh.world_size)
    else:
        model, loss, batches = Awkward(), awkward_loss, awkward_batches(2, 3, mesh.rank, mesh.world_size)
    state = fs.init(model, mesh, fs.adamw())
    step = fs.compose(loss, trace=True)
    traces, peaks = [], []
    for b in batches:
        state, m = step(state, b)
        traces.append(m["trace/collectives"])
        peaks.append(m["mem/peak_gathered_bytes"])
    sizes = sorted((u.nbytes for u in state.spec.units), reverse=True)
    return traces, max(peaks), sizes[0] + sizes[1]


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_issues_the_same_collectives_in_the_same_order(world_size):
    import fshard.testing as ft
    for name in ("gpt", "awkward"):
        results = run_ranks(_traces, world_size, name)
        for s in range(3):
            ft.check_same_collectives([r[0][s] for r in results])
        kinds = [c[0] for c in results[0][0][0]]
        assert kinds[0] == "all_reduce" and kinds[-1] == "all_reduce"  # the rank checks around the step
        assert "all_gather" in kinds and "reduce_scatter" in kinds
        for _, peak, two_units in results:  # blocking: at most two units gathered at once
            assert 0 < peak <= two_units


def test_collective_checker_reports_the_first_difference():
    import fshard.testing as ft
    a = [("all_gather", "blocks.0", "float32", 16), ("reduce_scatter", "blocks.0", "float32", 16)]
    b = [("all_gather", "blocks.1", "float32", 16), ("reduce_scatter", "blocks.0", "float32", 16)]
    with pytest.raises(AssertionError, match="collective 0"):
        ft.check_same_collectives([a, b])


class _Swapped(nn.Module):
    """Two same-size blocks run in a rank-dependent order: gathers pair up with the wrong unit on the other rank."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, swap=True):
        rank = int(os.environ["RANK"])
        order = [0, 1] if rank == 0 or not swap else [1, 0]
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return x.square().mean()


def _misuse():
    import fshard as fs
    mesh = fs.Mesh.from_env()
    out = {}
    torch.manual_seed(0)
    state = fs.init(_Swapped(), mesh, fs.adamw())
    before = [t.clone() for t in state.params.values()]
    try:  # a step function's first step checks each collective before issuing it
        fs.compose(lambda m, x: m(x))(state, torch.randn(2, 4))
    except fs.RankDivergenceError as e:
        out["divergence"] = str(e)
    step = fs.compose(lambda m, b: m(*b))
    step(state, (torch.randn(2, 4), False))  # the same order on every rank
    try:  # on a CPU mesh every step checks each collective by default
        step(state, (torch.randn(2, 4), True))
    except fs.RankDivergenceError as e:
        out["later"] = str(e)
    step = fs.compose(lambda m, b: m(*b), check_collectives=False)
    step(state, (torch.randn(2, 4), False))  # no collective is checked
    try:  # later steps: the agreement after backward sees it (same sizes, so no collective failed)
        step(state, (torch.randn(2, 4), True))
    except fs.RankDivergenceError as e:
        out["agreement"] = str(e)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, state.params.values()))

    x = torch.randn(2, 4)
    batch = (x, x) if mesh.rank == 0 else {"x": x, "y": x}
    try:
        fs.compose(lambda m, b: m(x))(state, batch)
    except fs.errors.BatchMismatchError as e:
        out["batch"] = str(e)

    import torch.distributed as dist
    same = lambda m, x: m.blocks[0](x).square().mean()  # noqa: E731 - the same units on every rank
    fs.compose(same, mesh=fs.Mesh.from_env())(state, x)  # another Mesh over the same group: fine
    other = fs.Mesh.from_group(dist.new_group([0, 1]))
    try:
        fs.compose(same, mesh=other)(state, x)
    except fs.errors.MeshMismatchError as e:
        out["mesh"] = str(e)

    dist.destroy_process_group()
    try:
        fs.compose(same)(state, x)
    except fs.errors.MeshMismatchError as e:
        out["stale"] = str(e)
    return out


def test_misuse_across_ranks_raises_clear_errors_and_never_hangs():
    for out in run_ranks(_misuse, 2, timeout_s=120):
        assert "ranks were about to issue different collectives" in out["divergence"] and "routed=" in out["divergence"]
        assert "rank 0: all_gather of 'blocks.0'" in out["later"] and "rank 1: all_gather of 'blocks.1'" in out["later"]
        assert "ranks issued different collectives" in out["agreement"] and out["unchanged"]
        assert "batches of different structure" in out["batch"] and "data loader" in out["batch"]
        assert "but the state was made on" in out["mesh"]
        assert "process group was destroyed" in out["stale"]


def _dies():
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    if mesh.rank == 1:
        os._exit(3)  # a crashed rank
    fs.compose(awkward_loss)(state, next(awkward_batches(2, 1, mesh.rank, 2)))
    return "step finished without rank 1?"


def test_a_dead_rank_makes_the_others_fail_instead_of_hanging():
    outcome = spawn(_dies, 2, timeout_s=120, collective_timeout_s=20)
    assert outcome[1] == ("died", 3)
    status, text = outcome[0]
    assert status == "error", outcome[0]  # an exception (connection closed or timeout), not a hang


def _mismatched_collective():
    import resource
    import torch.distributed as dist
    import fshard as fs
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (the abort on purpose leaves no core file where cores are on)
    mesh = fs.Mesh.from_env()
    n = 1 if mesh.rank == 0 else 2  # a collective whose sizes differ between the ranks: gloo aborts the receiver
    dist.all_gather([torch.zeros(n) for _ in range(2)], torch.zeros(n))
    return "no abort?"


def test_a_rank_that_aborts_reports_its_native_last_words_and_its_stacks():
    """The harness's own diagnostics (tests/_dist.py): a rank killed by a signal reports what its native code wrote to
    stderr (here gloo's reason) and every thread's Python stack (faulthandler), not only its exit code, so that a
    crash seen once in CI can be read."""
    outcome = spawn(_mismatched_collective, 2, timeout_s=60, collective_timeout_s=20)
    died = [v for s, v in outcome.values() if s == "died"]
    assert died and all(v == -6 for v in died), outcome
    text = str(died[0])
    assert "collective mismatch" in text and "Fatal Python error: Aborted" in text, text
    assert "_mismatched_collective" in text, text  # the Python stack at the abort


# --- checks in a group of their own (issue #42) ---

def _check_beside_a_collective_in_flight():
    """Rank 1 starts a broadcast on the mesh's group that rank 0 only joins after a check: the check must not wait
    behind it (gloo runs one group's collectives in order; with the check in the same group this deadlocks until the
    collective timeout). Returns the groups' ranks and the broadcast's data."""
    import torch.distributed as dist

    import fshard as fs
    from fshard.dist._agreement import exchange
    from fshard.dist._collectives import Comm
    mesh = fs.Mesh.from_env()
    comm = Comm(mesh, verify=True)
    t = torch.full((1 << 20,), float(mesh.rank))
    work = dist.broadcast(t, src=0, group=mesh.group, async_op=True) if mesh.rank == 1 else None
    exchange(comm, ("all_gather", "probe", "float32", 1))  # the check before a collective
    if mesh.rank == 0:
        work = dist.broadcast(t, src=0, group=mesh.group, async_op=True)
    work.wait()
    return (mesh.control_group is not mesh.group, dist.get_process_group_ranks(mesh.control_group),
            float(t.sum()))


def test_a_check_does_not_wait_behind_a_collective_in_flight():
    """On gloo the checks (and the step's small control all-reduces) run in a process group of their own over the
    same ranks, so that one issued behind a gather still in flight does not wait for it (design/ARCHITECTURE.md,
    "Checks in a group of their own")."""
    results = run_ranks(_check_beside_a_collective_in_flight, 2, timeout_s=90, collective_timeout_s=20)
    for own, ranks, total in results:
        assert own and ranks == [0, 1] and total == 0.0, (own, ranks, total)


def _mesh_after_a_subgroup():
    """Every rank makes a subgroup of ranks 0 and 1 (as a job may, before fshard), then the mesh."""
    import torch.distributed as dist

    import fshard as fs
    dist.init_process_group("gloo")
    dist.new_group([0, 1])
    mesh = fs.Mesh.from_env()
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.control_group)
    return float(t)


def _save_beside_a_step(path):
    """Rank 0 saves while rank 1 steps: the two meet at their checks (one group) and both raise at once."""
    import time

    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw())
    batch = next(iter(awkward_batches(2, 1, rank=mesh.rank, world_size=mesh.world_size)))
    t0 = time.monotonic()
    try:
        with fs.compose(awkward_loss) as step:
            fs.save(path, state) if mesh.rank == 0 else step(state, batch)
    except fs.FshardError as e:
        return type(e).__name__, time.monotonic() - t0
    return None, time.monotonic() - t0


def test_the_checks_group_is_made_alike_after_subgroups_and_shared_by_saves():
    """The control group is named by torch's job-wide count, so a mesh made after a subgroup that only some ranks
    belong to does not wait forever for its group (a hash of members and each process's groups differed); and
    fs.save's checks run in it too, so a rank that saves while another steps raises at once on both, not at the
    timeout."""
    import tempfile
    assert run_ranks(_mesh_after_a_subgroup, 3, timeout_s=90, collective_timeout_s=20) == [3.0, 3.0, 3.0]
    with tempfile.TemporaryDirectory() as d:
        for kind, seconds in run_ranks(_save_beside_a_step, 2, os.path.join(d, "c"), timeout_s=90,
                                       collective_timeout_s=30):
            assert kind == "RankDivergenceError" and seconds < 20, (kind, seconds)
