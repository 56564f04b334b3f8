"""A stable step's collectives are checked once (fshard/dist/_replay.py): once two steps in a row issued the same
sequence, the next checks it at its start and issues each collective of it unchecked. The results are bitwise those
of checked steps; a rank that fails or takes another path mid-sequence issues the rest with zeros, so every rank
raises (none waits for the timeout) and the state is unchanged; every rank taking the same other path trains on."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _dist import run_ranks, spawn

SWITCH = {"skip": None, "raise_forward": None, "raise_backward": False}  # per rank process: what a rank does wrong


class _Chain(nn.Module):
    """Four blocks, each a unit; ``SWITCH`` makes a block skipped or failing on the ranks that set it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(4)])

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i == SWITCH["skip"]:
                continue
            if i == SWITCH["raise_forward"]:
                raise RuntimeError("injected failure in forward")
            x = torch.tanh(block(x))
        return x


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if SWITCH["raise_backward"]:
            raise RuntimeError("injected failure in backward")
        return g


def _loss(module, x):
    return _Boom.apply(module(x).square().mean())


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 6, generator=g)


def _transforms(config: str):
    import fshard as fs
    return () if config == "plain" else (fs.gather_ahead(2), fs.bucket_reduce(0.0001))


def _mesh(shard_size):
    import fshard as fs
    return fs.Mesh.from_env() if shard_size is None else fs.Mesh.from_env(shard_size=shard_size)


def _train(config: str, steps: int, check, shard_size=None):
    """Checks made in each step, and the parameters after ``steps`` steps."""
    import fshard as fs
    mesh = _mesh(shard_size)
    torch.manual_seed(0)
    state = fs.init(_Chain(), mesh, fs.adamw(lr=1e-2))
    counts = []
    with fs.compose(_loss, *_transforms(config), check_collectives=check) as step:
        for s in range(steps):
            before = mesh.checks
            state, _ = step(state, _batch(s, mesh.rank))
            counts.append(mesh.checks - before)
    return counts, {k: v.numpy().copy() for k, v in fs.full_params(state).items()}


@pytest.mark.parametrize("world_size,shard_size", [(2, None), (3, None), (4, 2)])  # (4, 2): HSDP, 2 x 2
def test_a_stable_sequence_is_checked_once_a_step_and_trains_bitwise_as_checked_steps(world_size, shard_size):
    for config in ("plain", "ahead+buckets"):
        checked = run_ranks(_train, world_size, config, 6, None, shard_size)
        unchecked = run_ranks(_train, world_size, config, 6, False, shard_size)
        for (counts, params), (_, ref) in zip(checked, unchecked):
            # the first steps check every collective; once two in a row issued the same ones (with gather_ahead the
            # second prefetches, so the second and third), a step checks the ranks, the agreement and the commit
            assert all(c > 5 for c in counts[:2]) and counts[-3:] == [3, 3, 3], (config, counts)
            assert params.keys() == ref.keys() and all((params[k] == ref[k]).all() for k in ref), config


def _misbehave(config: str, shard_size=None):
    """Steps 0-2 clean (the sequence is followed from step 3 on), then at step 3: rank 1 fails in forward; again
    with a failure in backward; rank 1 alone skips a block; every rank skips it (a path they all take); then the
    rest of the steps clean. Returns each step's outcome and the parameters at the end."""
    import fshard as fs
    mesh = _mesh(shard_size)
    torch.manual_seed(0)
    state = fs.init(_Chain(), mesh, fs.adamw(lr=1e-2))
    outcomes, s = [], 0
    cases = [{}, {}, {}, {"raise_forward": 2}, {"raise_backward": True}, {"skip": 1}, {"skip_all": 1}, {}, {}]
    with fs.compose(_loss, *_transforms(config)) as step:
        for case in cases:
            before = [t.clone() for t in state.params.values()]
            SWITCH.update(skip=None, raise_forward=None, raise_backward=False)
            if case.get("skip_all") is not None:
                SWITCH["skip"] = case["skip_all"]
            elif mesh.rank == 1:
                SWITCH.update({k: v for k, v in case.items()})
            try:
                state, _ = step(state, _batch(s, mesh.rank))
                outcomes.append("ok")
                s += 1
            except fs.FshardError as e:
                same = all(torch.equal(a, b) for a, b in zip(before, state.params.values()))
                outcomes.append((type(e).__name__, str(e)[:400], same))
    SWITCH.update(skip=None, raise_forward=None, raise_backward=False)
    return outcomes, {k: v.numpy().copy() for k, v in fs.full_params(state).items()}


def _reference(config: str, shard_size=None):
    """The same clean steps, unchecked: the step that every rank took with block 1 skipped, skipped here too."""
    import fshard as fs
    mesh = _mesh(shard_size)
    torch.manual_seed(0)
    state = fs.init(_Chain(), mesh, fs.adamw(lr=1e-2))
    with fs.compose(_loss, *_transforms(config), check_collectives=False) as step:
        for s in range(6):
            SWITCH["skip"] = 1 if s == 3 else None
            state, _ = step(state, _batch(s, mesh.rank))
    SWITCH["skip"] = None
    return {k: v.numpy().copy() for k, v in fs.full_params(state).items()}


@pytest.mark.parametrize("config,world_size,shard_size", [("plain", 2, None), ("ahead+buckets", 2, None),
                                                            ("ahead+buckets", 4, 2)])  # (4, 2): HSDP, 2 x 2
def test_a_rank_that_fails_or_leaves_the_sequence_raises_on_every_rank_and_a_path_all_take_trains(config, world_size,
                                                                                                  shard_size):
    outcome = spawn(_misbehave, world_size, config, shard_size, timeout_s=150, collective_timeout_s=30)
    assert all(status == "ok" for status, _ in outcome.values()), outcome
    ref = run_ranks(_reference, world_size, config, shard_size)
    for rank, (_, (outcomes, params)) in outcome.items():
        ok, forward, backward, alone, together, *rest = outcomes[2:]
        assert ok == "ok" and together == "ok" and rest == ["ok", "ok"], (rank, outcomes)
        for failed in (forward, backward):  # the failing rank's own error; the others name it
            kind, text, unchanged = failed
            assert unchanged, (rank, failed)
            if rank == 1:
                assert kind == "StepError" and "injected failure" in text, failed
            else:
                assert kind == "RankFailedError" and "rank 1" in text and "injected failure" in text, failed
        kind, text, unchanged = alone  # one rank took another path: every rank says where each was
        assert kind == "RankDivergenceError" and unchanged, (rank, alone)
        assert "rank 0: all_reduce of 'agree'" in text and "rank 1: all_gather of 'blocks.2'" in text, text
        assert all((params[k] == ref[rank][k]).all() for k in params), rank  # zeros never reached the state


def test_a_sequence_is_followed_after_enough_identical_steps_of_one_layout_and_leaving_it_backs_off():
    """``Sequences`` against a model of it: follow the last sequence iff the last ``need`` committed steps had the
    same layout and entries (need 2, doubled up to 64 by each step that left the sequence it followed)."""
    from hypothesis import given, settings, strategies as st

    from fshard.dist._replay import Sequences

    zero = lambda comm: None  # noqa: E731
    step = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([("g", 1), ("g", 2), ("r", 1)]), st.booleans(),
                     st.booleans())

    @settings(max_examples=200, deadline=None)
    @given(st.lists(step, max_size=40))
    def check(steps):
        seqs, history, need = Sequences(), [], 2
        for key, entry, left, replayable in steps:
            items = [(entry, zero if replayable else None)]
            seqs.observed(key, items, left)
            need = min(2 * need, 64) if left else need
            history = history + [(key, entry)] if replayable else []
            run = len(history) - next((i for i in range(len(history) - 1, -1, -1) if history[i] != history[-1]), -1) - 1
            for k in ("a", "b"):
                got = seqs.to_follow(k)
                want = bool(history) and history[-1][0] == k and run >= need
                assert (got is not None) == want, (steps, k)
                assert got is None or got == items
    check()
