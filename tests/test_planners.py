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


def _cuts(u) -> list[int]:
    """Where the plan may cut a unit: its ends and the start of each trainable parameter."""
    return sorted({0, u.numel} | {s.offset for s in u.trainable})


# ---------------------------------------------------------------- 1. plan_buckets

@st.composite
def bucket_sizes(draw, units):
    """From 1 byte (a bucket per segment) to everything in one; half the time exactly at (or 1 below) the size
    of the first few segments of one dtype, where an off-by-one in the packing shows."""
    train = [u for u in units if u.trainable]
    lead = itertools.takewhile(lambda u: u.dtype == train[0].dtype, train)  # the first bucket's candidates
    nbytes = [(c - a) * u.dtype.itemsize for u in lead for a, c in itertools.pairwise(_cuts(u))]
    edges = [sum(nbytes[:k]) + d for k in range(2, len(nbytes) + 1) for d in (-1, 0)]
    if edges and draw(st.booleans()):
        return draw(st.sampled_from(edges))
    return draw(st.one_of(st.sampled_from([1, 2**62]), st.integers(1, 2**16)))


@given(ft.world_sizes(), st.data())
def test_bucket_plan(n, data):
    units = [data.draw(layouts(n, f"u{i}")) for i in range(data.draw(st.integers(1, 4)))]
    bucket_bytes = data.draw(bucket_sizes(units))
    buckets = plan_buckets(units, n, bucket_bytes)
    by_name = {u.name: u for u in units}
    pieces = [p for b in buckets for p in b.pieces]
    for u in units:  # every rank gets every element of its shard of a trainable unit once, nothing else
        mine = [p for p in pieces if p.unit == u.name]
        if not u.trainable:
            assert not mine and all(u.name not in b.units for b in buckets)
            continue
        for r in range(n):
            assert _tiles([(p.lo, p.hi) for p in mine if p.rank == r], *u.shard_range(r)), (u, r)
        cuts = _cuts(u)  # a piece never straddles a trainable parameter's start: units are cut only there
        assert all(not p.lo < c < p.hi for p in mine for c in cuts)

    order = []  # (unit, lo, hi) per bucket, in plan order
    for i, b in enumerate(buckets):
        assert b.index == i and b.units == {p.unit for p in b.pieces}
        assert all(by_name[name].dtype == b.dtype for name in b.units), "a bucket mixes dtypes"
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
        # what the bucket holds of each unit is one contiguous range of it, from cut to cut
        spans = []
        for name in sorted(b.units, key=[u.name for u in units].index):  # (pieces are rank-major, not in order)
            mine = [(p.lo, p.hi) for p in b.pieces if p.unit == name]
            lo, hi = min(a for a, _ in mine), max(c for _, c in mine)
            assert _tiles(mine, lo, hi) and lo in _cuts(by_name[name]) and hi in _cuts(by_name[name])
            spans.append((name, lo, hi))
        order.append(spans)

    # units are taken in the given order, each from 0 to its end, possibly across buckets
    flat = [s for spans in order for s in spans]
    assert [k for k, _ in itertools.groupby(name for name, _, _ in flat)] == [u.name for u in units if u.trainable]
    for u in units:
        ends = [(lo, hi) for name, lo, hi in flat if name == u.name]
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
        assert not ends or (ends[0][0], ends[-1][1]) == (0, u.numel)

    # size, greedy packing: a bucket holds more than bucket_bytes only when it is a single segment (from a
    # trainable parameter's start to the next one's, or to the unit's end: frozen parameters and padding
    # included) larger than that; and a bucket is closed only when the next segment has another dtype or would
    # take it past bucket_bytes.
    def segments(spans):
        return [(name, a, c) for name, lo, hi in spans
                for a, c in itertools.pairwise([x for x in _cuts(by_name[name]) if lo <= x <= hi])]

    for b, spans, nxt in zip(buckets, order, buckets[1:] + [None]):
        nbytes = b.numel * b.dtype.itemsize
        assert nbytes <= bucket_bytes or len(segments(spans)) == 1, (nbytes, bucket_bytes, spans)
        if nxt is not None and nxt.dtype == b.dtype:
            name, a, c = segments(order[nxt.index])[0]
            assert nbytes + (c - a) * b.dtype.itemsize > bucket_bytes, "closed a bucket the next segment fits in"


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
