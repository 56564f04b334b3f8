"""Property tests for the pure planners: the bucket plan, AdamW's runs, a layout's trainable ranges, and the
equality decision of agree(). No communication: each plan is checked against what its consumers rely on."""
from __future__ import annotations

import itertools
import types

import torch
from hypothesis import given
from hypothesis import strategies as st

import fshard.testing as ft
from fshard.transforms._bucket_reduce import plan_buckets
from fshard.dist._agreement import HASH_BITS, agree, all_equal
from fshard.state._flat import plan_unit
from fshard.optim._elementwise import segments as _segments


@st.composite
def layouts(draw, world_size: int, name: str = "u", min_params: int = 0):
    """One unit: up to 10 parameters (0-dim, empty, prime sizes; some frozen), any dtype, small or default
    alignment (a 1-byte alignment lets shards cut through parameters at any element)."""
    shapes = st.one_of(ft.shapes(), st.sampled_from([(0,), (1,), (2,), (3,)]))  # tiny ones: many per shard
    params = draw(st.lists(st.tuples(shapes, st.sampled_from([True, True, False])),
                           min_size=min_params, max_size=10))
    entries = [((f"p{i}",), shape, grad) for i, (shape, grad) in enumerate(params)]
    return plan_unit(name, name, entries, draw(ft.dtypes()), world_size, draw(st.sampled_from([1, 4, 64])))


def _tiles(ranges, lo: int, hi: int) -> bool:
    """Do the half-open ranges, sorted, cover [lo, hi) exactly once (empty ones ignored)?"""
    pos = lo
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if a != pos:
            return False
        pos = b
    return pos == hi


def _nbytes(u) -> int:
    return u.numel * u.dtype.itemsize


# ---------------------------------------------------------------- 1. plan_buckets

@st.composite
def bucket_sizes(draw, units):
    """From 1 byte (a bucket per unit) to everything in one; half the time exactly at (or 1 below) the size of
    the first few units of one dtype, where an off-by-one in the packing shows."""
    train = [u for u in units if u.trainable]
    lead = [_nbytes(u) for u in itertools.takewhile(lambda u: u.dtype == train[0].dtype, train)] if train else []
    edges = [sum(lead[:k]) + d for k in range(2, len(lead) + 1) for d in (-1, 0)]
    if edges and draw(st.booleans()):
        return draw(st.sampled_from(edges))
    return draw(st.one_of(st.sampled_from([1, 2**62]), st.integers(1, 2**16)))


@given(ft.world_sizes(), st.data())
def test_bucket_plan(n, data):
    units = [data.draw(layouts(n, f"u{i}")) for i in range(data.draw(st.integers(1, 4)))]
    bucket_bytes = data.draw(bucket_sizes(units))
    per_unit = data.draw(st.booleans())
    buckets = plan_buckets(units, n, bucket_bytes, per_unit)
    pieces = [p for b in buckets for p in b.pieces]
    for u in units:  # every rank gets every element of its shard of a trainable unit once, nothing else
        mine = [p for p in pieces if p.unit == u.name]
        if not u.trainable:
            assert not mine and all(u.name not in b.units for b in buckets)
            continue
        for r in range(n):
            assert _tiles([(p.lo, p.hi) for p in mine if p.rank == r], *u.shard_range(r)), (u, r)
            # a unit is never split: so no rank's shard is cut by a bucket's end (it is one run of one section)
            assert len([p for p in mine if p.rank == r]) == (1 if u.shard_numel else 0)
        assert len([b for b in buckets if u.name in b.units]) == 1

    for i, b in enumerate(buckets):
        assert b.index == i and b.units == {p.unit for p in b.pieces}
        assert all(u.dtype == b.dtype for u in units if u.name in b.units), "a bucket mixes dtypes"
        # sections: rank-major, contiguous, tiling [0, numel); each rank's pieces fill its section in order
        assert len(b.sections) == n and [p.rank for p in b.pieces] == sorted(p.rank for p in b.pieces)
        sizes = [k for _, k in b.sections]
        assert [o for o, _ in b.sections] == list(itertools.accumulate(sizes[:-1], initial=0))
        assert sum(sizes) == b.numel
        for r, (off, k) in enumerate(b.sections):
            at = off
            for p in (p for p in b.pieces if p.rank == r):
                assert p.at == at, (b.index, r, p)
                at += p.hi - p.lo
            assert at == off + k

    # units are taken whole, in the given order
    trainable = [u for u in units if u.trainable]
    held = [[u for u in trainable if u.name in b.units] for b in buckets]
    assert [u.name for group in held for u in group] == [u.name for u in trainable]

    # size, greedy packing: a bucket holds more than bucket_bytes only when it is a single unit larger than that,
    # and it is closed only when the next unit has another dtype or would take it past bucket_bytes (per_unit:
    # every unit is a bucket of its own)
    for b, group, nxt in zip(buckets, held, held[1:] + [None]):
        assert b.numel * b.dtype.itemsize == sum(map(_nbytes, group))
        if per_unit:
            assert len(group) == 1
            continue
        assert sum(map(_nbytes, group)) <= bucket_bytes or len(group) == 1, (group, bucket_bytes)
        if nxt is not None and nxt[0].dtype == b.dtype:
            assert sum(map(_nbytes, group)) + _nbytes(nxt[0]) > bucket_bytes, "closed a bucket the next unit fits in"


def test_an_empty_last_parameter_opens_no_bucket():
    # a 0-element trainable parameter may start exactly at the buffer's end: it is no segment of its own
    u = plan_unit("u", "u", [(("a",), (), True), (("b",), (0,), True)], torch.float32, 1, 4)
    assert u.slots[1].offset == u.numel == 1
    assert [len(b.pieces) for b in plan_buckets([u], 1, 1)] == [1]


# ---------------------------------------------------------------- 2. AdamW's runs


@given(st.one_of(st.just(1), ft.world_sizes()), st.data())  # often one rank: all slots in one shard, to merge
def test_segments_cover_the_active_slots_with_their_step_and_decay(n, data):
    layout = data.draw(layouts(n, min_params=3))  # enough slots for runs to merge, or to skip one
    k = len(layout.trainable)  # active flags, step counts and decays are per parameter, the same on every rank
    active = data.draw(st.lists(st.sampled_from([True, True, False]), min_size=k, max_size=k))
    counts = data.draw(st.lists(st.integers(1, 2), min_size=k, max_size=k))  # equal steps are common
    decays = data.draw(st.lists(st.sampled_from([0.1, 0.1, 0.0]), min_size=k, max_size=k))  # a mask's two values

    def key_at(intervals, x):
        hits = [key for lo, hi, *key in intervals if lo <= x < hi]
        assert len(hits) <= 1, (intervals, x)
        return hits[0] if hits else None

    for r in range(n):
        ranges = layout.trainable_ranges(r)
        runs = _segments(ranges, active, counts, decays)
        # sorted, disjoint, non-empty; touching neighbours differ in step or decay (else they would be one run)
        assert all(lo < hi for lo, hi, _, _ in runs)
        for (_, h0, s0, w0), (l1, _, s1, w1) in zip(runs, runs[1:]):
            assert h0 <= l1 and not (h0 == l1 and (s0, w0) == (s1, w1)), runs
        # the same function as "each active slot's range at its count and decay", on every elementary interval
        want = [(lo, hi, c, w) for (lo, hi), on, c, w in zip(ranges, active, counts, decays) if on and hi > lo]
        points = sorted({x for lo, hi, *_ in runs + want for x in (lo, hi)})
        assert all(key_at(runs, x) == key_at(want, x) for x in points), (ranges, active, counts, decays, runs)


# ---------------------------------------------------------------- 3. trainable_ranges


@given(ft.world_sizes(), st.data())
def test_trainable_ranges_partition_the_trainable_prefix_of_each_shard(n, data):
    layout = data.draw(layouts(n))
    s, total = layout.shard_numel, 0
    for r in range(n):
        ranges = layout.trainable_ranges(r)
        assert len(ranges) == len(layout.trainable)
        assert all(0 <= lo <= hi <= s for lo, hi in ranges)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "not in slot order / overlapping"
        prefix = min(max(layout.trainable_numel - r * s, 0), s)  # the trainable part of this shard
        assert prefix == layout.opt_numel(r)
        assert _tiles(ranges, 0, prefix), (r, ranges, prefix)
        for slot, (lo, hi) in zip(layout.trainable, ranges):  # each range holds its own parameter's elements
            a, b = max(slot.offset - r * s, 0), min(slot.offset + slot.numel - r * s, s)
            assert a >= b or lo <= a and b <= hi, (slot, r, lo, hi)
        total += sum(hi - lo for lo, hi in ranges)
    assert total == layout.trainable_numel


# ---------------------------------------------------------------- 4. agree's equality decision

hashes = st.one_of(st.integers(0, 2**HASH_BITS - 1), st.sampled_from([0, 1, 2**HASH_BITS - 2, 2**HASH_BITS - 1]))


@st.composite
def rank_hashes(draw):
    """Per-rank lists of m hashes (n ranks, 1-8): a shared base, then up to two near misses: one value off by
    +-1, two hashes swapped on one rank, a pair of ranks moved by -d and +d (the same sum), or anything."""
    n, m = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    base = draw(st.lists(hashes, min_size=m, max_size=m))
    rows = [list(base) for _ in range(n)]
    for _ in range(draw(st.integers(0, 2))):
        kind, r, q, j = draw(st.sampled_from(["off", "swap", "pair", "any"])), *draw(
            st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, m - 1)))
        if kind == "off":
            rows[r][j] = min(max(rows[r][j] + draw(st.sampled_from([-1, 1])), 0), 2**HASH_BITS - 1)
        elif kind == "swap":  # rank q holds rank r's (a, b) as (b, a): same per-rank sums, unequal unless a == b
            j2 = draw(st.integers(0, m - 1))
            rows[q][j], rows[q][j2] = rows[r][j2], rows[r][j]
        elif kind == "pair":  # same sum over ranks, different values
            d = draw(st.integers(1, 3))
            if r != q and rows[r][j] >= d and rows[q][j] + d < 2**HASH_BITS:
                rows[r][j] -= d
                rows[q][j] += d
        else:
            rows[r][j] = draw(hashes)
    return rows


def _all_reduce(bufs: list[torch.Tensor]) -> torch.Tensor:
    """A SUM all-reduce, adding the ranks' float64 buffers one by one in the given order."""
    acc = bufs[0].clone()
    for b in bufs[1:]:
        acc += b
    return acc


@given(rank_hashes(), st.booleans())
def test_agree_decides_equality_exactly(rows, reverse):
    n, m = len(rows), len(rows[0])
    truth = [len({row[j] for row in rows}) == 1 for j in range(m)]
    order = rows[::-1] if reverse else rows
    sums = [sum(float(row[j]) for row in order) for j in range(m)]  # float64, left to right
    sq = [sum(float(row[j]) ** 2 for row in order) for j in range(m)]
    assert all_equal(n, sums, sq) == truth, (rows, sums, sq)
    # and agree() itself, every rank with a fake comm: record each rank's buffer, then replay with their sum
    values = [[float(r), 1.0] for r in range(n)]
    sent = []
    mesh = types.SimpleNamespace(world_size=n, device=torch.device("cpu"))
    record = types.SimpleNamespace(mesh=mesh, all_reduce=lambda t, tag: sent.append(t.clone()))
    for r in range(n):
        agree(record, values[r], rows[r])
    total = _all_reduce(sent[::-1] if reverse else sent)
    replay = types.SimpleNamespace(mesh=mesh, all_reduce=lambda t, tag: t.copy_(total))
    for r in range(n):
        got_values, same = agree(replay, values[r], rows[r])
        assert got_values == [n * (n - 1) / 2, float(n)] and same == truth
