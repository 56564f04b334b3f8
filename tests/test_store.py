"""Tests of fshard.store: round trips (hypothesis), streaming order and overlap, faults, bounded disk footprint."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("tensornvme")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fshard as fs
from fshard.store import (BufferPool, CorruptedItemError, EventLog, MissingKeyError, PoolExhaustedError,
                          Store, StoreClosedError, StoreDirectoryError, StoreError, StoreWriteError)
from fshard.store._checksum import checksum

BACKENDS = ["uring", "aio"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bytes viewed as `dtype`: NaN payloads and odd bit patterns included, compared bit for bit."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


@pytest.fixture(scope="module", params=BACKENDS)
def store(request, tmp_path_factory):
    with fs.NVMeStore(str(tmp_path_factory.mktemp(f"store-{request.param}")), backend=request.param) as s:
        yield s


shapes = st.one_of(
    st.just(()),  # 0-dim
    st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(lambda s: 0 in s),  # empty
    st.lists(st.integers(1, 70), min_size=1, max_size=3),  # small, unaligned
    st.tuples(st.integers(4000, 40000)),  # a few blocks, rarely a multiple of 4096 bytes
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), shape=shapes, seed=st.integers(0, 2**31 - 1), transpose=st.booleans())
def test_round_trip_bit_exact(store, dtype, shape, seed, transpose):
    x = random_tensor(dtype, shape, seed)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, 1)  # non-contiguous: staged through a pool buffer
    h = store.put(("k", seed), x)
    h.wait()
    assert h.done() and h.state == "done"
    first = store.get(("k", seed)).wait()  # through tensornvme
    again = store.get(("k", seed)).wait()  # the engine consumed its entry: the pread path
    out = torch.empty(x.shape, dtype=x.dtype)
    store.get(("k", seed), out=out).wait()
    for y in (first, again, out):
        assert same_bits(x, y)
    store.delete(("k", seed))
    assert ("k", seed) not in store


@settings(max_examples=15, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_cpu_store_round_trip(dtype, shape, seed):
    x = random_tensor(dtype, shape, seed)
    with fs.CPUStore() as s:
        assert isinstance(s, Store)
        s.put("k", x).wait()
        x_copy = x.clone()
        x.zero_() if x.dtype != torch.bool else x.fill_(False)  # the store kept its own copy
        assert same_bits(s.get("k").wait(), x_copy)


def test_put_overwrite_and_caller_reuse(store):
    x = torch.arange(10000, dtype=torch.float32)
    h = store.put("w", x)
    h.wait()
    x.fill_(-1)  # reuse after wait() must not affect what was stored
    assert torch.equal(store.get("w").wait(), torch.arange(10000, dtype=torch.float32))
    store.put("w", torch.ones(3, dtype=torch.int64)).wait()  # new dtype and size under the same key
    assert torch.equal(store.get("w").wait(), torch.ones(3, dtype=torch.int64))
    # A dropped source tensor is kept alive by the handle until the write is reaped.
    h = store.put("w2", torch.full((100000,), 7.0))
    assert torch.equal(store.get("w2").wait(), torch.full((100000,), 7.0))
    assert h.done()


def test_inflight_writes_bounded(tmp_path):
    with fs.NVMeStore(str(tmp_path), max_inflight_writes=2) as s:
        hs = [s.put(i, torch.full((1000,), float(i))) for i in range(10)]
        assert sum(not h.done() for h in hs) <= 2 and all(h.done() for h in hs[:8])
        assert [s.get(i).wait()[0].item() for i in range(10)] == [float(i) for i in range(10)]


def test_missing_key(store):
    with pytest.raises(MissingKeyError, match="nope"):
        store.get("nope")
    with pytest.raises(KeyError):
        store.delete("nope")
    store.put("gone", torch.ones(5)).wait()
    store.delete("gone")
    with pytest.raises(MissingKeyError, match="gone"):
        store.get("gone")


# ---- streaming ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_overlap_order_and_writeback(backend, tmp_path):
    """Proof of overlap from recorded states, not timing: while the caller computes on item i, the read of item
    i+1 has been submitted and not yet completed (observed), and the write-back of item i-1 is still in flight."""
    log = EventLog()
    keys = [f"m{i}" for i in range(6)]
    with fs.NVMeStore(str(tmp_path), backend=backend, events=log) as s:
        for i, k in enumerate(keys):
            s.put(k, torch.full((5000,), float(i))).wait()
        log.clear()
        order = []
        with s.stream(keys, depth=2, writeback=True) as stream:
            for item in stream:
                i = item.index
                order.append(item.key)
                log.record("compute_start", item.key)
                if i + 1 < len(keys):
                    assert keys[i + 1] in stream.inflight_reads()
                if i >= 1:
                    assert keys[i - 1] in stream.inflight_writes()
                item.tensor.add_(100)  # the "update"
                log.record("compute_end", item.key)
                stream.writeback(item)
        assert order == keys
        pos = {e: n for n, e in enumerate(log)}
        for i, k in enumerate(keys):
            assert pos[("read_done", k)] < pos[("compute_start", k)]
            if i + 1 < len(keys):
                nxt = keys[i + 1]
                assert pos[("read_submitted", nxt)] < pos[("compute_start", k)] < pos[("compute_end", k)]
                assert pos[("compute_end", k)] < pos[("read_done", nxt)]
            if i >= 1:
                prev = keys[i - 1]
                assert pos[("write_submitted", prev)] < pos[("compute_start", k)]
                assert pos[("compute_end", k)] < pos[("write_done", prev)]
        for i, k in enumerate(keys):
            assert torch.equal(s.get(k).wait(), torch.full((5000,), float(i) + 100))
        assert s.pool.in_use == 0


def test_stream_bounded_buffers_and_misuse(tmp_path):
    with fs.NVMeStore(str(tmp_path), max_buffers=6, max_buffer_bytes=6 * 65536) as s:
        keys = [f"b{i}" for i in range(30)]
        for k in keys:
            s.put(k, torch.randn(16384)).wait()  # 64 KiB each
        seen = 0
        with s.stream(keys, depth=3, writeback=True) as stream:
            for item in stream:
                assert s.pool.resident_bytes <= 6 * 65536 and s.pool.in_use <= 6
                item.tensor.mul_(0)
                stream.writeback(item)
                seen += 1
        assert seen == 30 and all(torch.count_nonzero(s.get(k).wait()) == 0 for k in keys)
        slots_after_one_round = s.slots
        with s.stream(keys, depth=3, writeback=True) as stream:  # a second round reuses the freed slots
            for item in stream:
                stream.writeback(item)
        assert s.slots == slots_after_one_round <= 2 * len(keys) + 3
        with pytest.raises(StoreError, match="neither written back nor released"):
            with s.stream(keys[:3], depth=1, writeback=True) as stream:
                next(stream)
                next(stream)
        # read-only streams release each item when the next one is requested
        with s.stream(keys, depth=2) as stream:
            assert sum(1 for _ in stream) == 30
        assert s.pool.in_use == 0


def test_cpu_store_stream():
    with fs.CPUStore() as s:
        for i in range(4):
            s.put(i, torch.tensor([float(i)])).wait()
        with s.stream(range(4), depth=2, writeback=True) as stream:
            for item in stream:
                item.tensor.add_(1)
                stream.writeback(item)
        assert [s.get(i).wait().item() for i in range(4)] == [1.0, 2.0, 3.0, 4.0]


# ---- integrity ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("second_read", [False, True], ids=["engine-read", "pread"])
@pytest.mark.parametrize("fault", ["truncate", "corrupt", "delete"])
def test_tampered_file_raises(store, fault, second_read):
    key = f"t-{fault}-{second_read}"
    x = torch.randn(10000)
    store.put(key, x).wait()
    if second_read:
        assert torch.equal(store.get(key).wait(), x)
    path = store.file_of(key)
    if fault == "truncate":
        os.truncate(path, 4096 * 3 + 5)
    elif fault == "corrupt":
        with open(path, "r+b") as f:
            f.seek(12345)
            b = f.read(1)
            f.seek(12345)
            f.write(bytes([b[0] ^ 0x10]))
    else:
        os.unlink(path)
    expect = {"truncate": "truncated", "corrupt": "checksum mismatch", "delete": "deleted"}[fault]
    with pytest.raises(CorruptedItemError, match=expect) as err:
        store.get(key).wait()
    assert key in str(err.value)
    store.delete(key)


def test_checksum_sees_flips_and_moved_blocks():
    x = torch.randint(0, 256, (3 * 4096 + 77,), dtype=torch.uint8)
    base = checksum(x)
    y = x.clone()
    y[5000] ^= 1
    assert checksum(y) != base
    z = x.clone()
    z[:4096], z[4096:8192] = x[4096:8192].clone(), x[:4096].clone()  # two blocks swapped
    assert checksum(z) != base
    assert checksum(x[:-1]) != base and checksum(x, "crc32") != checksum(y, "crc32")


# ---- directories, cleanup -------------------------------------------------------------------------------------
def test_bad_directories(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(StoreDirectoryError, match="missing.*does not exist"):
        fs.NVMeStore(str(missing), create=False)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StoreDirectoryError, match="cannot create store directory .*afile/sub"):
        fs.NVMeStore(str(afile / "sub"))
    with pytest.raises(StoreDirectoryError, match="is not a directory"):
        fs.NVMeStore(str(afile))
    created = tmp_path / "new" / "deeper"
    with fs.NVMeStore(str(created)) as s:  # a missing directory is created by default
        s.put("a", torch.ones(2)).wait()
    assert created.is_dir() and os.listdir(created) == []


def test_unwritable_directory(tmpfs):
    ro = tmpfs("ro,size=1m")
    with pytest.raises(StoreDirectoryError, match=f"{ro}.*not writable"):
        fs.NVMeStore(str(ro))


@pytest.mark.parametrize("reserve", [True, False], ids=["fallocate", "short-write-check"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_disk_full_keeps_previous_versions(tmpfs, backend, reserve, monkeypatch):
    """Disk full on a 1 MiB tmpfs. With fallocate the failure shows before writing; without it (a filesystem
    where fallocate is absent), tensornvme's unreported short write must be caught by the size check."""
    if not reserve:
        from fshard.store._layout import Slot

        monkeypatch.setattr(Slot, "reserve", lambda self, nbytes: None)
    small = tmpfs("size=1m")
    with fs.NVMeStore(str(small), backend=backend) as s:
        old = torch.randn(64 * 1024)  # 256 KiB
        s.put("a", old).wait()
        with pytest.raises(StoreWriteError, match="'a'.*previous version is kept"):
            s.put("a", torch.randn(512 * 1024)).wait()  # 2 MiB does not fit in 1 MiB
        assert torch.equal(s.get("a").wait(), old)
        stored, failed = {}, None
        for i in range(20):  # fill the disk with fresh keys until a write fails
            t = torch.full((32 * 1024,), float(i))
            try:
                s.put(i, t).wait()
                stored[i] = t
            except StoreWriteError as e:
                failed = (i, e)
                break
        assert failed is not None and "nothing was stored" in str(failed[1])
        assert failed[0] not in s and len(stored) >= 1
        for i, t in stored.items():
            assert torch.equal(s.get(i).wait(), t)
        assert torch.equal(s.get("a").wait(), old)
        for i in stored:  # deleting gives the space back: the failed key now fits
            s.delete(i)
        s.put(failed[0], torch.ones(32 * 1024)).wait()
        assert torch.equal(s.get(failed[0]).wait(), torch.ones(32 * 1024))


@pytest.mark.parametrize("backend", BACKENDS)
def test_footprint_bounded_over_1000_rounds(backend, tmp_path):
    keys, n = ["p", "q", "r", "s"], 16 * 1024  # 4 x 64 KiB
    with fs.NVMeStore(str(tmp_path), backend=backend) as s:
        peak_disk = peak_slots = 0
        for r in range(1000):
            hs = [s.put(k, torch.full((n,), float(r))) for k in keys]
            for h in hs:
                h.wait()
            for k in keys:
                assert s.get(k).wait()[0].item() == float(r)
            peak_disk = max(peak_disk, s.disk_bytes())
            peak_slots = max(peak_slots, s.slots)
        live = len(keys) * n * 4
        assert peak_disk <= 2 * live  # live items + the new versions written before the old ones are released
        assert peak_slots <= 2 * len(keys)
        du = sum(os.stat(os.path.join(s.directory, f)).st_blocks * 512 for f in os.listdir(s.directory))
        assert du <= 2 * live + 4096  # + the owner record (owner.json, one block)


def test_close_context_manager_and_exit_cleanup(tmp_path):
    s = fs.NVMeStore(str(tmp_path))
    s.put("a", torch.ones(10)).wait()
    d = s.directory
    assert os.listdir(d)
    s.close()
    assert not os.path.exists(d) and os.listdir(tmp_path) == []
    with pytest.raises(StoreClosedError):
        s.put("a", torch.ones(1))
    s.close()  # idempotent
    s = fs.NVMeStore(str(tmp_path))
    s.put("a", torch.ones(10)).wait()
    d = s.directory
    del s
    gc.collect()  # garbage collection alone also cleans up (weakref.finalize)
    assert not os.path.exists(d)
    code = textwrap.dedent(f"""
        import torch, fshard as fs
        s = fs.NVMeStore({str(tmp_path)!r})
        s.put("a", torch.ones(1000)).wait()
        h = s.put("b", torch.ones(1000))  # still in flight at exit
        print(s.directory)
    """)  # no close(): weakref.finalize's atexit hook must remove the files
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert os.path.basename(out.stdout.strip()).startswith("fshard-store-")
    assert os.listdir(tmp_path) == [], out.stderr


# ---- buffer pool ----------------------------------------------------------------------------------------------
def test_large_buffers_start_on_a_huge_page_boundary():
    """From 2 MiB up a buffer (and a lent result) starts on a 2 MiB boundary, so huge pages can cover all of it, and
    its tensors still have storages of exactly the bytes asked for (tensornvme sizes iovecs by storage)."""
    from fshard.store._pool import AlignedBuffer

    for cap in ((2 << 20), (16 << 20) + 4096):
        buf = AlignedBuffer(cap)
        t = buf.bytes(cap)
        assert t.data_ptr() == buf.address and buf.address % (2 << 20) == 0
        assert t.untyped_storage().nbytes() == cap
        t.fill_(7)  # the whole capacity is inside the mapping
    lent = BufferPool().lend(3 << 20)
    assert lent.data_ptr() % (2 << 20) == 0 and lent.untyped_storage().nbytes() == 3 << 20
    assert AlignedBuffer(8192).address % 4096 == 0


def test_buffer_pool_aligned_reused_bounded():
    pool = BufferPool(max_buffers=3, max_bytes=3 * 8192, block=4096)
    a = pool.acquire(5000)
    assert a.capacity == 8192 and a.bytes(5000).data_ptr() % 4096 == 0
    assert a.bytes(5000).untyped_storage().nbytes() == 5000  # exact storage: safe for tensornvme's iovecs
    pool.release(a)
    b = pool.acquire(6000)
    assert b is a  # reused, best fit
    c, d = pool.acquire(100), pool.acquire(100)
    assert pool.resident_bytes == 8192 + 4096 + 4096
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        pool.acquire(10)
    pool.release(c)
    e = pool.acquire(8000)  # drops the free 4 KiB buffer to make room
    assert e.capacity == 8192 and pool.resident_bytes <= 3 * 8192
    for x in (b, d, e):
        pool.release(x)
    pool.clear()
    assert pool.resident_bytes == 0


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_raw_tensornvme_grows_where_store_does_not(tmp_path):
    """The defect the store guards against, shown on the raw engine: per-tensor rounds leak file space."""
    from tensornvme import DiskOffloader

    off = DiskOffloader(str(tmp_path / "raw"), backend="uring")
    ts = [torch.ones(1024 * 256) for _ in range(4)]
    path = os.path.join(str(tmp_path / "raw"), os.listdir(tmp_path / "raw")[0])
    sizes = []
    for _ in range(4):
        for t in ts:
            off.async_write(t)
        off.synchronize()
        for t in ts:
            off.async_read(t)
        off.synchronize()
        sizes.append(os.path.getsize(path))
    assert sizes[-1] > sizes[0]
    del off


# ---- O_DIRECT path ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_direct_path_round_trips_and_checks(backend, tmp_path):
    """Items >= direct_min_bytes go through O_DIRECT: aligned tensors in place, others staged through the pool
    (padded to whole blocks); reads land in aligned `out` in place, in a pool buffer otherwise. Same checks."""
    from fshard.store import aligned_empty_like
    with fs.NVMeStore(str(tmp_path), backend=backend, direct_min_bytes=4096) as s:
        for n in (4096 * 8, 4096 * 5 + 12, 100_000):
            x = random_tensor(torch.uint8, (n,), n)
            xa = aligned_empty_like(x).copy_(x)
            for key, src in (("a", xa), ("u", x), ("nc", x.view(-1)[::1].as_strided((n // 2,), (2,)))):
                s.put((key, n), src).wait()
                item = s._items[(key, n)]
                assert item.direct and item.slot.direct_ok, "ext4 tmp_path supports O_DIRECT"
                for out in (None, torch.empty_like(src), aligned_empty_like(src)):
                    s.put((key, n), src).wait()  # re-arm: the first get after a put reads through tensornvme
                    got = s.get((key, n), out=out).wait()
                    assert same_bits(got, src) and (out is None or got is out)
                assert same_bits(s.get((key, n)).wait(), src)  # repeat read (buffered pread on the same file)
        s.put("c", x).wait()
        with open(s.file_of("c"), "r+b") as f:
            f.seek(4099)
            b = f.read(1)
            f.seek(4099)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(CorruptedItemError, match="checksum mismatch"):
            s.get("c", out=aligned_empty_like(x)).wait()
        s.put("t", x).wait()
        os.truncate(s.file_of("t"), 4096)
        with pytest.raises(CorruptedItemError, match="truncated"):
            s.get("t").wait()
        assert s.pool.in_use == 0  # staged buffers came back, failures included


@pytest.mark.parametrize("backend", BACKENDS)
def test_direct_in_place_at_any_address(backend, tmp_path):
    """O_DIRECT needs block-aligned memory, file offsets and lengths. An item's bytes start in its file at the
    source's address modulo 4 KiB, so a contiguous tensor at any address (torch's are 64-byte aligned) is written
    in place. A destination in the store's own memory (empty_for, pool buffers) with the same offset in its page
    is read in place: no pool buffer is used, only the partial first and last blocks are copied. Any other
    destination (the caller's memory, or another offset) is read through a pool buffer and copied once."""
    from fshard.store._pool import aligned_empty

    def at(phase: int, n: int) -> torch.Tensor:  # n contiguous bytes whose address is `phase` into a page
        return aligned_empty(phase + n + 4096)[phase:phase + n]

    with fs.NVMeStore(str(tmp_path), backend=backend, direct_min_bytes=1) as s:
        for n in (1, 100, 4096 - 64, 4096, 4096 * 5, 4096 * 5 + 12, 100_003):
            for phase in (0, 64, 4032, 4095):
                x = at(phase, n).copy_(random_tensor(torch.uint8, (n,), n + phase))
                key = (n, phase)
                s.put(key, x).wait()
                item = s._items[key]
                assert item.direct and item.phase == phase and s.phase(key) == phase
                assert os.path.getsize(s.file_of(key)) >= phase + n
                assert s.pool.resident_bytes == 0, "written in place: no staging buffer"
                for read_phase in (phase, (phase + 64) % 4096):
                    s.put(key, x).wait()  # re-arm: the first get after a put reads through tensornvme
                    out = at(read_phase, n)
                    got = s.get(key, out=out).wait()
                    assert got is out and same_bits(got, x), (n, phase, read_phase)
                    assert s.pool.resident_bytes > 0, "the caller's memory is read through the pool"
                    s.pool.clear()
                assert same_bits(s.get(key).wait(), x)  # repeat read: buffered pread at the item's offset
                s.pool.clear()  # the result above was lent, and came back to the spare list when it died
                s.put(key, x).wait()
                dst = s.empty_for(key)  # a destination at the item's phase: read in place
                s.pool.clear()  # the previous dst (lent memory) came back to the spare list when it was replaced
                assert s.get(key, out=dst).wait() is dst and same_bits(dst, x) and s.pool.resident_bytes == 0
                with open(s.file_of(key), "r+b") as f:  # the bytes sit at the phase: corrupt the last one
                    f.seek(phase + n - 1)
                    b = f.read(1)
                    f.seek(phase + n - 1)
                    f.write(bytes([b[0] ^ 0xFF]))
                with pytest.raises(CorruptedItemError, match="checksum mismatch"):
                    s.get(key, out=at(phase, n)).wait()


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_land_in_place_only_in_the_stores_own_memory(backend, tmp_path):
    """A direct read into a caller's tensor (ordinary 4 KiB pages) goes through a pool buffer even at the item's
    phase; into empty_for memory or a pool buffer (what the stream reads into) it lands in place."""
    n = (1 << 20) + 100
    x = random_tensor(torch.uint8, (n,), 3)
    with fs.NVMeStore(str(tmp_path), backend=backend) as s:
        s.put("k", x).wait()
        mem = torch.empty(n + 4096, dtype=torch.uint8)
        out = mem[(s.phase("k") - mem.data_ptr()) % 4096:][:n]
        assert out.data_ptr() % 4096 == s.phase("k")
        h = s.get("k", out=out)
        assert s.pool.in_use == 1  # staged
        assert h.wait() is out and same_bits(out, x) and s.pool.in_use == 0
        for dst in (s.empty_for("k"), None):
            if dst is None:  # a pool buffer at the item's phase, as Stream makes it
                buf = s.pool.acquire(s.phase("k") + n)
                dst = buf.bytes(s.phase("k") + n)[s.phase("k"):]
            s.put("k", x).wait()  # re-arm: the first get after a put reads through tensornvme
            in_use = s.pool.in_use
            h = s.get("k", out=dst)
            assert s.pool.in_use == in_use  # in place: no pool buffer taken
            assert h.wait() is dst and same_bits(dst, x)
        s.pool.release(buf)
        assert not s.pool.owns(torch.empty(8).data_ptr(), 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_results_are_lent_and_come_back_when_dropped(backend, tmp_path):
    """get(key) without `out` returns memory the pool lends: the store keeps no reference to a result once it is
    done, the buffer comes back to the spare list only when the last tensor over it (views included) dies, and
    the next result of that size reuses it. Results stay valid after close()."""
    import weakref

    n = (1 << 20) + 100
    x, y = random_tensor(torch.uint8, (n,), 1), random_tensor(torch.uint8, (n,), 2)
    with fs.NVMeStore(str(tmp_path), backend=backend) as s:
        s.put("x", x).wait()
        s.put("y", y).wait()
        t = s.get("x").wait()
        page = t.data_ptr() // 4096
        assert same_bits(t, x) and s.pool.owns(t.data_ptr(), n) and s.pool.spare_bytes == 0
        view = t[10:20]
        alive = weakref.ref(t)
        del t
        gc.collect()
        assert alive() is None, "the store keeps no reference to a done get's result"
        assert s.pool.spare_bytes == 0 and same_bits(view, x[10:20]), "a view keeps the buffer lent"
        del view
        assert s.pool.spare_bytes > 0 and s.resident_bytes == s.pool.spare_bytes
        s.put("x", y).wait()  # a new version, possibly at another phase: the spare buffer still fits it
        u = s.get("x").wait()
        assert same_bits(u, y) and u.data_ptr() // 4096 == page and s.pool.spare_bytes == 0
        s.pool.max_spare_bytes = 0
        del u
        assert s.pool.spare_bytes == 0, "the spare list is bounded"
        s.pool.max_spare_bytes = 1 << 30
        w = s.get("y").wait()
    assert same_bits(w, y) and s.pool.spare_bytes == 0  # readable after close; close dropped the spares
    del w
    assert s.pool.spare_bytes == 0, "a result dropped after close is not kept"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["get", "drop", "put"]), st.integers(0, 3)), max_size=30),
       sizes=st.lists(st.sampled_from([1, 4096, 5000, (1 << 20) + 3, 3 << 20]), min_size=4, max_size=4))
def test_lent_results_are_never_reused_while_alive(tmp_path, ops, sizes):
    """Whatever the order of gets, drops and new versions, every result the caller holds keeps the bytes it was
    read with: a lent buffer is reused only after its last tensor is gone."""
    with fs.NVMeStore(str(tmp_path), direct_min_bytes=4096) as s:
        version = {k: random_tensor(torch.uint8, (sizes[k],), k) for k in range(4)}
        for k, v in version.items():
            s.put(k, v).wait()
        held = []  # (result, the bytes it must hold)
        for seed, (op, k) in enumerate(ops):
            if op == "get":
                held.append((s.get(k).wait(), version[k]))
            elif op == "drop" and held:
                held.pop(k % len(held))
            elif op == "put":
                version[k] = random_tensor(torch.uint8, (sizes[k],), 100 + seed)
                s.put(k, version[k]).wait()
            for got, want in held:
                assert same_bits(got, want)
        assert s.pool.spare_bytes <= s.pool.max_spare_bytes


def test_stream_depth_beyond_the_pool_is_refused(tmp_path):
    with fs.NVMeStore(str(tmp_path), max_buffers=4) as s:
        s.put("a", torch.ones(10)).wait()
        with pytest.raises(ValueError, match="needs 6 pool buffers.*max_buffers >= 6"):
            s.stream(["a"], depth=4)


def test_direct_off_and_unsupported_fall_back_to_buffered(tmp_path):
    with fs.NVMeStore(str(tmp_path), direct=False) as s:
        x = torch.randn(1 << 18)
        s.put(0, x).wait()
        assert not s._items[0].direct and torch.equal(s.get(0).wait(), x)


def test_direct_items_read_buffered(tmp_path):
    """The direct_reads=False switch: direct-written (padded) items read back buffered, odd sizes included."""
    with fs.NVMeStore(str(tmp_path), direct_min_bytes=4096) as s:
        s.direct_reads = False
        for n in (4096 * 4, 4096 * 4 + 3):
            x = random_tensor(torch.uint8, (n,), n)
            for out in (None, torch.empty_like(x)):
                s.put(n, x).wait()
                assert s._items[n].direct and same_bits(s.get(n, out=out).wait(), x)


def test_a_forwarding_proxy_is_a_store_and_an_incomplete_one_is_not():
    """offload_state checks a store by hasattr over Store's attributes: isinstance(x, Store) looks them up
    statically from Python 3.12 on and refused a wrapper that forwards with __getattr__ (the GPU machine's 3.12)."""
    import typing

    from fshard.store._protocol import STORE_ATTRS, is_store
    protocol = typing._get_protocol_attrs(Store) if hasattr(typing, "_get_protocol_attrs") else Store.__protocol_attrs__
    assert set(STORE_ATTRS) == set(protocol) - {"__init__"}

    class Proxy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with fs.CPUStore() as inner:
        assert is_store(Proxy(inner))
        fs.offload_state(Proxy(inner))
    missing = type("NoStream", (), {a: None for a in STORE_ATTRS if a != "stream"})()
    assert not is_store(missing)
    with pytest.raises(fs.ArgumentTypeError, match="store must be"):
        fs.offload_state(missing)


def test_a_slot_finds_the_engines_descriptor_by_its_hint_or_by_a_scan(tmp_path, monkeypatch):
    """Slot creation looks at the two descriptors the engine opens next (its io_uring, then the file) before it
    scans every descriptor (quadratic in the slots: fshard/store/_layout.py); a wrong hint (another thread opened a
    descriptor in between) falls back to the scan and finds the same one."""
    import os
    from fshard.store import _layout
    a = _layout.Slot(str(tmp_path / "a"), "uring")
    assert a.direct_ok and os.readlink(f"/proc/self/fd/{a.efd}") == str(tmp_path / "a") and a.efd != a.fd
    seen = []
    monkeypatch.setattr(_layout, "_next_fds", lambda n=2: (a.fd, 10_000))  # wrong: our own fd, and none at all
    scan = _layout._engine_fd
    monkeypatch.setattr(_layout, "_engine_fd", lambda *args: (seen.append(args), scan(*args))[1])
    b = _layout.Slot(str(tmp_path / "b"), "uring")
    assert b.direct_ok and os.readlink(f"/proc/self/fd/{b.efd}") == str(tmp_path / "b") and b.efd != b.fd
    assert seen and seen[0][3] == (10_000, a.fd)
    a.destroy()
    b.destroy()


# --- CPUStore: in-place streams and reads that cast (issue #43) ---

def test_an_in_place_stream_updates_the_stored_tensors_and_refuses_another_key():
    """CPUStore.stream_in_place (offload's update with donate=True): each item is the stored tensor itself, so the
    update lands with no copy out and back; its checksum is taken again when asked; writing an item under another
    key (a new version, which must leave the old one intact) is refused."""
    store = fs.CPUStore(pin=False)
    for i in range(3):
        store.put(("k", i), torch.full((1, 5), float(i)))
    before = store.meta(("k", 1)).checksum
    s = store.stream_in_place([("k", i) for i in range(3)])
    for item in s:
        item.tensor.add_(10.0)
        s.writeback(item, key=item.key)
    s.close()
    for i in range(3):
        assert torch.equal(store.get(("k", i)).wait(), torch.full((1, 5), 10.0 + i))
    after = store.meta(("k", 1))
    from fshard.store._protocol import as_bytes
    assert after.checksum != before and after.checksum == checksum(as_bytes(torch.full((1, 5), 11.0)))
    s = store.stream_in_place([("k", 0)])
    item = next(s)
    with pytest.raises(StoreError, match="under their own keys"):
        s.writeback(item, key=("other", 0))
    with pytest.raises(MissingKeyError):
        next(iter(store.stream_in_place([("missing", 0)])))


def test_read_into_casts_in_one_pass_and_a_forwarding_wrapper_keeps_its_own_get():
    """CPUStore.read_into copies an item into a tensor of another dtype (a stored parameter read for a bf16
    gather); StoredParam.load uses it only where the store's class has it, so a wrapper that counts its gets
    through __getattr__ still sees every read."""
    from fshard.state._stored import StoredParam, put_param
    store = fs.CPUStore(pin=False)
    p = torch.randn(37)
    sp = put_param(store, "p", p, 30, 16, [])
    assert isinstance(sp, StoredParam)
    assert torch.equal(sp.load(torch.bfloat16), p.to(torch.bfloat16))
    assert torch.equal(sp.load(), p)

    class Counting:
        def __init__(self, inner):
            self.inner, self.gets = inner, 0

        def get(self, key, out=None):
            self.gets += 1
            return self.inner.get(key, out)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    wrapped = Counting(store)
    sp2 = StoredParam(*(None if part is None else type(part)(wrapped, part.key, part.chunks, rows=part.rows)
                        for part in (sp.head, sp.tail)), sp.numel, sp.opt_numel, sp.dtype, sp.location)
    assert torch.equal(sp2.load(torch.bfloat16), p.to(torch.bfloat16))
    assert wrapped.gets == len(sp.head.chunks) + len(sp.tail.chunks)


# --- CPUStore: one pass per put (fs.init's speed) ---

def test_put_stacked_is_the_padded_stack_copied_once_and_its_checksum_is_taken_when_asked():
    """CPUStore.put_stacked(key, rows, width) stores what put(key, <rows stacked, zero padded to width>) would,
    copying each row straight in (no stack first), and owns its memory; a put's checksum is taken when meta()
    asks, from the bytes stored (not a placeholder)."""
    from fshard.store._protocol import as_bytes
    store = fs.CPUStore(pin=False)
    rows = [torch.randn(7), torch.randn(4), torch.randn(0)]
    want = torch.zeros(3, 7)
    want[0], want[1, :4] = rows[0], rows[1]
    store.put_stacked("s", rows, 7).wait()
    store.put("p", want).wait()
    rows[0].fill_(5.0)
    want_bytes = want.clone()
    want.fill_(3.0)  # neither item aliases what it was made from
    for k in ("s", "p"):
        got = store.get(k).wait()
        assert got.shape == (3, 7) and torch.equal(got.view(torch.uint8), want_bytes.view(torch.uint8))
        m = store.meta(k)
        assert (m.dtype, m.shape, m.nbytes) == (torch.float32, (3, 7), 84)
        assert m.checksum == checksum(as_bytes(want_bytes))
    assert store.resident_bytes == 2 * 84


def test_write_rows_through_a_cpu_store_makes_no_stack_and_the_same_items_as_stack_then_put(monkeypatch):
    """Optimizer rows go into a CPUStore's items through put_stacked: no stacked temporary (torch.stack is never
    called) and the same bytes, for rows of one length (AdamW's) and of several (compact rows, zero padded), as
    through a store that has only put (a forwarding wrapper, which keeps its own put)."""
    from fshard.state._stored import _Items, write_rows

    class Forwarding:
        def __init__(self, inner):
            self.inner, self.puts = inner, 0

        def put(self, key, t):
            self.puts += 1
            return self.inner.put(key, t)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    for lengths in ((50, 50), (50, 19, 0)):
        g = torch.Generator().manual_seed(len(lengths))
        rows = [torch.randn(n, generator=g) for n in lengths]
        chunks = [(0, 16), (16, 32), (32, 48), (48, 50)]
        plain, wrapped = fs.CPUStore(pin=False), Forwarding(fs.CPUStore(pin=False))
        items = {s: _Items(s, "k", chunks, tuple(f"r{i}" for i in range(len(rows)))) for s in (plain, wrapped)}
        write_rows(items[wrapped], rows, [])
        assert wrapped.puts == len(chunks)
        with monkeypatch.context() as m:
            m.setattr(torch, "stack", lambda *a, **k: pytest.fail("a stacked temporary was made"))
            write_rows(items[plain], rows, created := [])
        assert created == [("k", i) for i in range(len(chunks))]
        for k in created:
            a, b = plain.get(k).wait(), wrapped.get(k).wait()
            assert a.shape == b.shape == (len(rows), 16 if k[1] < 3 else 2)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and plain.meta(k) == wrapped.meta(k)
