"""New large CPU buffers in transparent huge pages where the kernel maps them afresh (fshard/_pages.py): the planner
of the ranges to ask for (a property test), ``advise`` on new and on reused memory, the switch, and a two-rank step
whose gathers, sections and receive buffers are advised, bitwise the same as without."""
from __future__ import annotations

import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _dist import run_ranks
from fshard import _pages

PER = _pages.HUGE // _pages.PAGE  # base pages a huge page

# mincore's bytes for 0-6 huge pages: each huge page wholly unbacked, or with one or all of its pages resident
# (bit 0), and reserved bits set either way (they must not count)
_huge_page = st.builds(
    lambda backed, at, fill: bytes([fill]) * PER if not backed else bytes([fill | 1]) * PER if at is None else (
        bytes([fill]) * at + bytes([fill | 1]) + bytes([fill]) * (PER - at - 1)),
    st.booleans(), st.one_of(st.none(), st.integers(0, PER - 1)), st.sampled_from([0, 2, 4, 254]))


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(_huge_page, max_size=6), first=st.integers(0, 1 << 20))
def test_the_ranges_asked_for_are_the_maximal_runs_of_wholly_unbacked_huge_pages(pages, first):
    start = first * _pages.HUGE
    runs = _pages.unbacked(start, b"".join(pages))
    free = [not any(b & 1 for b in p) for p in pages]
    covered = [False] * len(pages)
    for addr, length in runs:
        assert addr % _pages.HUGE == 0 and length % _pages.HUGE == 0 and length > 0
        k0, k1 = (addr - start) // _pages.HUGE, (addr + length - start) // _pages.HUGE
        assert 0 <= k0 < k1 <= len(pages) and all(free[k0:k1])  # only unbacked huge pages
        assert (k0 == 0 or not free[k0 - 1]) and (k1 == len(pages) or not free[k1])  # maximal: no neighbour left
        covered[k0:k1] = [True] * (k1 - k0)
    assert covered == free  # every unbacked huge page asked for
    assert [a for a, _ in runs] == sorted(a for a, _ in runs)


def _recording(monkeypatch):
    """``_pages``' libc with ``madvise`` recorded (and still made): the list of (address, bytes, advice)."""
    fns = _pages._libc()
    if fns is None:
        pytest.skip("no transparent huge pages to ask for here (FSHARD_HUGE_PAGES=0, not Linux, or 'never')")
    madvise, mincore, huge = fns
    calls = []

    def recorded(addr, length, advice):
        calls.append((addr, length, advice))
        return madvise(addr, length, advice)
    monkeypatch.setattr(_pages, "_libc", lambda: (recorded, mincore, huge))
    return calls


def test_advise_asks_for_the_whole_huge_pages_of_new_memory_and_leaves_reused_memory_alone(monkeypatch):
    calls = _recording(monkeypatch)
    monkeypatch.setattr(_pages, "MIN_BYTES", 4 << 20)  # (a small buffer for the test)
    mm = mmap.mmap(-1, 9 << 20, flags=mmap.MAP_PRIVATE)  # a new mapping: no page of it backed yet
    new = torch.frombuffer(mm, dtype=torch.uint8, count=(9 << 20) - 4096, offset=4096)
    lo, hi = new.data_ptr(), new.data_ptr() + new.nbytes
    _pages.advise(new)
    assert len(calls) == 1 and calls[0][2] == mmap.MADV_HUGEPAGE
    addr, length, _ = calls[0]
    huge = _pages._libc()[2]
    assert addr == -(-lo // huge) * huge and addr + length == hi // huge * huge
    assert huge != _pages.HUGE or length >= 3 * huge  # (9 MiB less its first page: 3 or 4 whole 2 MiB pages)
    new.fill_(3)
    assert new.sum().item() == 3 * new.numel()  # (a hint: the memory is as it was)
    calls.clear()
    _pages.advise(new)  # every page resident now: nothing to ask for
    _pages.advise(_pages.empty(1 << 14, torch.float32, "cpu"))  # under MIN_BYTES
    monkeypatch.setattr(_pages, "MIN_BYTES", 64 << 20)
    _pages.advise(torch.frombuffer(mmap.mmap(-1, 9 << 20, flags=mmap.MAP_PRIVATE), dtype=torch.uint8))  # (new, small)
    assert calls == []
    del new
    mm.close()


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(_huge_page, max_size=6), first=st.integers(0, 1 << 20))
def test_the_ranges_collapsed_are_the_rest_of_the_buffers_whole_huge_pages(pages, first):
    start = first * _pages.HUGE
    end = start + len(pages) * _pages.HUGE
    asked = _pages.unbacked(start, b"".join(pages))
    rest = _pages._between(start, end, asked)
    both = sorted(asked + rest)
    assert all(length > 0 for _, length in both)
    assert [a for a, _ in both[1:]] == [a + n for a, n in both[:-1]]  # no gap, no overlap
    assert not both or (both[0][0] == start and both[-1][0] + both[-1][1] == end)
    for addr, length in rest:  # each is backed huge pages only, and maximal (asked runs, or the ends, around it)
        k0, k1 = (addr - start) // _pages.HUGE, (addr + length - start) // _pages.HUGE
        assert all(any(b & 1 for b in p) for p in pages[k0:k1])


def test_a_state_buffer_asks_for_its_new_huge_pages_and_collapses_the_reused_ones_after_its_write(monkeypatch):
    calls = _recording(monkeypatch)
    huge = _pages._libc()[2]
    if huge != _pages.HUGE:
        pytest.skip(f"huge pages of {huge} bytes here (the test's buffers are sized for 2 MiB ones)")
    mm = mmap.mmap(-1, 12 * huge, flags=mmap.MAP_PRIVATE)
    buf = torch.frombuffer(mm, dtype=torch.float32)
    buf[:(3 * huge) // 4].fill_(1)  # its first three huge pages' worth resident (memory the heap reused)
    lo = -(-buf.data_ptr() // huge) * huge
    hi = (buf.data_ptr() + buf.nbytes) // huge * huge
    out = _pages.settled(buf, lambda t: t.fill_(2))
    assert out is buf and bool((buf == 2).all())  # (hints: the memory is as written)
    new = [(a, n) for a, n, advice in calls if advice == mmap.MADV_HUGEPAGE]
    collapsed = [(a, n) for a, n, advice in calls if advice == _pages.MADV_COLLAPSE]
    kinds = [advice for _, _, advice in calls]
    assert new and collapsed and kinds == [mmap.MADV_HUGEPAGE] * len(new) + [_pages.MADV_COLLAPSE] * len(collapsed)
    covered = sorted(new + collapsed)
    assert covered[0][0] == lo and sum(n for _, n in covered) == hi - lo  # every whole huge page, once
    assert collapsed == [(lo, 3 * huge)]  # the reused ones (unaligned, the third is partly written: reused too)
    calls.clear()
    small = torch.frombuffer(mmap.mmap(-1, _pages.STATE_MIN_BYTES - 4096, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    _pages.settled(small, lambda t: t.fill_(1))  # under STATE_MIN_BYTES: nothing asked
    assert calls == []
    del buf, out
    mm.close()


def test_init_puts_the_state_in_huge_pages_and_it_trains_the_same_without_them(monkeypatch):
    import fshard as fs
    calls = _recording(monkeypatch)
    huge = _pages._libc()[2]
    if huge != _pages.HUGE:
        pytest.skip(f"huge pages of {huge} bytes here (the test's model is sized for 2 MiB ones)")

    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1031, 1031), torch.nn.Linear(1031, 7))  # a unit of 4.25 MB
        state = fs.init(model, fs.Mesh.local(), fs.adamw(lr=1e-2))
        start = state
        step = fs.compose(lambda m, b: m(b).square().mean())  # (donate=False: the update writes new tensors)
        for i in range(2):
            state, _ = step(state, torch.randn(3, 1031, generator=torch.Generator().manual_seed(i)))
        return start, state

    start, state = train()
    big = [t for t in (*start.params.values(), *(r for s in start.opt_state.values() for r in s.rows))
           if t.nbytes >= _pages.STATE_MIN_BYTES]
    assert len(big) == 3  # the first layer's shard and its two moments
    for t in big:  # each whole huge page of each: asked for before its first write, or collapsed after it
        lo, hi = -(-t.data_ptr() // huge) * huge, (t.data_ptr() + t.nbytes) // huge * huge
        got = sorted((a, n) for a, n, _ in calls if lo <= a < hi)
        assert hi > lo and got and got[0][0] == lo and sum(n for _, n in got) == hi - lo, (lo, hi, got)
    after = {k: v.clone() for k, v in state.params.items()}
    monkeypatch.setattr(_pages, "_libc", lambda: None)  # as FSHARD_HUGE_PAGES=0
    calls.clear()
    _, plain = train()
    assert calls == [] and all(torch.equal(after[k], plain.params[k]) for k in after)


def test_advise_is_off_with_fshard_huge_pages_0_a_bad_value_warns_and_is_the_default_and_not_on_other_devices(
        monkeypatch):
    monkeypatch.setattr(_pages, "MIN_BYTES", 4 << 20)  # (so that 8 MiB buffers reach the switch and the device)
    monkeypatch.delenv("FSHARD_HUGE_PAGES", raising=False)
    _pages._libc.cache_clear()
    default = _pages.available()
    try:
        monkeypatch.setenv("FSHARD_HUGE_PAGES", "0")
        _pages._libc.cache_clear()
        assert not _pages.available()
        t = _pages.empty((8 << 20) // 4, torch.float32, "cpu")  # a plain torch.empty, nothing asked
        assert t.numel() == (8 << 20) // 4 and t.untyped_storage().resizable()
        monkeypatch.setenv("FSHARD_HUGE_PAGES", "off")
        _pages._libc.cache_clear()
        with pytest.warns(RuntimeWarning, match="FSHARD_HUGE_PAGES.*'off' is not 0 or 1"):
            assert _pages.available() == default  # ignored: as by default
    finally:
        monkeypatch.delenv("FSHARD_HUGE_PAGES", raising=False)
        _pages._libc.cache_clear()
    calls = _recording(monkeypatch)
    _pages.advise(torch.empty(8 << 20, dtype=torch.uint8, device="meta"))  # not a CPU buffer: nothing asked
    assert calls == []


STEPS = 2


def _train(advised: bool):
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    sizes, advise = [], _pages.advise
    if advised:  # (this rank's process only) every buffer advise is called for, then advised as it would be
        _pages.advise = lambda buf: sizes.append(
            (buf.untyped_storage() if isinstance(buf, torch.Tensor) else buf).nbytes()) or advise(buf)
    else:
        _pages._libc = lambda: None  # as FSHARD_HUGE_PAGES=0
    _pages.MIN_BYTES = 4 << 20  # (a small model's buffers: 10.3 and 5.2 MB)
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(dim=464, n_heads=4)  # a block 10.3 MB: its gathered buffer, sections and receives >= 4 MiB
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=1e-2))
    step = fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(1e-6), donate=True)  # a bucket per unit
    losses, called = [], []
    for batch in synthetic_batches(cfg, 2, STEPS, seed=3, rank=mesh.rank, world_size=mesh.world_size):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        called.append(list(sizes))
        sizes.clear()
    step.close()
    params = {k: v.numpy().tobytes() for k, v in fs.full_params(state).items()}
    block = next(u for u in state.spec.units if u.name == "blocks.0")
    return dict(losses=losses, params=params, called=called, block=block.numel * 4, shard=block.shard_numel * 4)


def test_a_step_advises_its_new_gathered_buffers_and_sections_and_its_results_are_bitwise_the_same():
    advised, plain = (run_ranks(_train, 2, a) for a in (True, False))
    for r in range(2):
        assert advised[r]["losses"] == plain[r]["losses"] and advised[r]["params"] == plain[r]["params"]
        # every step: forward's first gathers of a block (new memory) and this rank's section of each of the two
        # blocks' buckets (the shard's size; the spare's and the exchange's buffers may add more), whether the
        # kernel then maps them afresh or glibc reuses its heap (which the hint leaves alone: the test above)
        got = advised[r]
        assert all(got["block"] in c and c.count(got["shard"]) >= 2 for c in got["called"]), got["called"]
