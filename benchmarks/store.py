"""NVMe store benchmark (issue #4): NVMeStore (uring, aio) vs raw tensornvme vs fio, on 1 GiB as 64 x 16 MiB.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/store.py --reps 5 --dir /var/tmp/fshard-bench
    .venv/bin/python benchmarks/store.py --rss            # RSS: put 1 GiB and drop it vs keep it

Per repetition and per contender, before each timed write and each timed read: settle() (sync, drop the page
cache, then wait until the guest's free page reporting has gone quiet, so every contender, fio included, starts
from the same memory state; see RESULTS.md (NVMe store) for why), then write 1 GiB, fsync (durable), settle, and time a
cold read. fio runs with direct=1, bs=1M, iodepth=32 (io_uring and libaio) on a 1 GiB file in the same directory.
NVMeStore writes items >= 1 MiB with O_DIRECT; `[...,buffered]` is the same store with direct=False. Raw
tensornvme is the bare engine as shipped (buffered), and `[...,direct]` the same engine on page-aligned copies of
the tensors with O_DIRECT set on its descriptor. Medians over the repetitions are printed with ratios; all figures
come from the same run. --no-settle restores the old protocol (evict the files only).

Read destinations: `NVMeStore[be]` is the issue's API, `get(key).wait()` without `out`: each round returns new
results, in memory the store lends (the previous round's results, dropped, are reused). `[be,out]` reads into
ordinary preallocated `torch.empty` tensors (shared with the raw engine), which the store reads through a pool
buffer plus one copy; `[be,out=empty_for]` into `store.empty_for(key)` tensors (the store's own huge-page memory,
as the offloaded optimizer's stream buffers are), in place. The "read request KiB" column is the average size of
the disk's read requests during the cold read (/sys/dev/block).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fshard as fs  # noqa: E402

N, MIB = 64, 1 << 20
ITEM = 16 * MIB
TOTAL = N * ITEM


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_all(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


REPORTED = "/sys/module/page_reporting/parameters/reported_kib"
SETTLE = True


def settle(paths=()) -> None:
    """Same starting state for every contender: nothing dirty, nothing cached, free memory already reported to
    the host (virtio-balloon free page reporting; a page the host took back costs a host fault on next touch)."""
    if not SETTLE:
        return evict(paths)
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        evict(paths)
    if not os.path.exists(REPORTED):
        return
    last, still, t0 = None, 0.0, time.perf_counter()
    while still < 1.0 and time.perf_counter() - t0 < 10:
        cur = open(REPORTED).read()
        still = still + 0.25 if cur == last else 0.0
        last = cur
        time.sleep(0.25)


@functools.lru_cache(maxsize=None)
def _stat_file(directory: str) -> str:
    dev = os.stat(directory).st_dev
    return f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"


def disk_reads(directory: str):
    """(read requests completed, bytes read) so far on the device holding `directory`: the average request size of
    a cold read shows how the kernel split it (a destination of scattered 4 KiB pages caps a request at
    max_segments pages)."""
    f = open(_stat_file(directory)).read().split()
    return int(f[0]), int(f[2]) * 512


def req_kib(directory: str, before) -> float:
    n, b = disk_reads(directory)
    return (b - before[1]) / max(n - before[0], 1) / 1024


def gbps(seconds: float) -> float:
    return TOTAL / seconds / 1e9


class StoreRun:
    def __init__(self, directory, backend, srcs, outs, checksum, writes=16, label="", direct=True, at_phase=False,
                 fresh=False):
        self.name = f"NVMeStore[{backend}{label}]"
        self.store = fs.NVMeStore(directory, backend=backend, checksum=checksum, max_inflight_writes=writes,
                                  direct=direct)
        self.srcs, self.outs = srcs, outs
        # Warm-up: two rounds create the slots for the live and the next versions (aio engines take ~65 ms each to
        # set up) and write their blocks once; steady state then overwrites allocated blocks. Also faults in `outs`.
        self.round()
        if at_phase:  # destinations from store.empty_for: read in place (made once, faulted in by the warm-up)
            self.outs = [self.store.empty_for(i).fill_(0) for i in range(len(srcs))]
        if fresh:  # get(key) without out: the store allocates each result (fresh memory every round)
            self.outs = [None] * len(srcs)
        self.round()

    def round(self):
        s = self.store
        settle(s.files())  # cold write for every contender: no destination page is cached, no writeback pending
        t0 = time.perf_counter()
        for h in [s.put(i, t) for i, t in enumerate(self.srcs)]:
            h.wait()
        t1 = time.perf_counter()
        live = [s.file_of(i) for i in range(N)]
        fsync_all(live)
        t2 = time.perf_counter()
        settle(live)
        d0 = disk_reads(s.directory)
        t3 = time.perf_counter()
        # wait() verifies checksums; the results stay alive until the clock stops, so a `fresh` round does not
        # time unmapping them (as in runs J and K)
        got = [h.wait() for h in [s.get(i, out=o) for i, o in enumerate(self.outs)]]  # noqa: F841
        t4 = time.perf_counter()
        return {"write": t1 - t0, "write+fsync": t2 - t0, "cold read": t4 - t3, "req KiB": req_kib(s.directory, d0)}

    def close(self):
        self.store.close()


class RawRun:
    """tensornvme's engine used directly: one async_writev / async_readv of all 64 tensors, no checks."""

    def __init__(self, directory, backend, srcs, outs, direct=False):
        import fcntl
        from tensornvme._C import Offloader
        from fshard.store._layout import _engine_fd

        self.name = f"raw tensornvme[{backend}{',direct' if direct else ''}]"
        self.path = os.path.join(directory, f"raw-{backend}{'-direct' if direct else ''}.bin")
        self.engine = Offloader(self.path, 32, backend)
        if direct:  # O_DIRECT needs page-aligned buffers: aligned copies of the same tensors
            from fshard.store import aligned_empty_like
            srcs = [aligned_empty_like(t).copy_(t) for t in srcs]
            outs = [aligned_empty_like(t) for t in outs]
            st = os.stat(self.path)
            fd = _engine_fd(st.st_ino, st.st_dev, -1)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        self.srcs, self.outs = srcs, outs
        self.round()

    def round(self):
        e = self.engine
        settle([self.path])
        t0 = time.perf_counter()
        e.async_writev(self.srcs, "all")
        e.synchronize()
        t1 = time.perf_counter()
        fsync_all([self.path])
        t2 = time.perf_counter()
        settle([self.path])
        d0 = disk_reads(self.path)
        t3 = time.perf_counter()
        e.async_readv(self.outs, "all")
        e.synchronize()
        t4 = time.perf_counter()
        kib = req_kib(self.path, d0)
        assert torch.equal(self.outs[0], self.srcs[0]) and torch.equal(self.outs[-1], self.srcs[-1])
        self.outs[0].zero_()
        return {"write": t1 - t0, "write+fsync": t2 - t0, "cold read": t4 - t3, "req KiB": kib}

    def close(self):
        self.engine = None


def fio(directory, engine):
    path = os.path.join(directory, f"fio-{engine}.dat")
    res = {}
    for rw, label in (("write", "write+fsync"), ("read", "cold read")):
        settle([path] if os.path.exists(path) else [])
        cmd = ["fio", "--name=b", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--size=1G",
               f"--ioengine={engine}", "--iodepth=32", "--direct=1", "--end_fsync=1", "--output-format=json"]
        d0 = disk_reads(directory)
        out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        if rw == "read":
            res["req KiB"] = req_kib(directory, d0)
        job = out["jobs"][0][rw]
        res[label] = TOTAL / job["bw_bytes"]  # seconds for 1 GiB at fio's bandwidth
    # The file is kept and overwritten by the next rep (as the stores overwrite their slots): deleting 1 GiB on
    # this ext4 mount (-o discard) slows whatever writes next for seconds.
    return res


def bench(args):
    os.makedirs(args.dir, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(ITEM // 4, generator=g) for _ in range(N)]
    outs = [torch.empty(ITEM // 4) for _ in range(N)]
    global SETTLE
    SETTLE = not args.no_settle
    runs = [RawRun(args.dir, "uring", srcs, outs), RawRun(args.dir, "aio", srcs, outs),
            RawRun(args.dir, "uring", srcs, outs, direct=True)]
    for be in ("uring", "aio"):
        runs.append(StoreRun(args.dir, be, srcs, outs, args.checksum, fresh=True))
        runs.append(StoreRun(args.dir, be, srcs, outs, args.checksum, label=",out"))
        runs.append(StoreRun(args.dir, be, srcs, outs, args.checksum, label=",out=empty_for", at_phase=True))
    if args.buffered:
        runs.append(StoreRun(args.dir, "uring", srcs, outs, args.checksum, label=",buffered", direct=False))
    runs.sort(key=lambda r: r.name)  # stable report order
    have_fio = shutil.which("fio") is not None
    fio_names = ["fio[io_uring]", "fio[libaio]"] if have_fio else []
    times = {r.name: [] for r in runs}
    times.update({n: [] for n in fio_names})
    jobs = [(r.name, r.round) for r in runs]
    jobs += [(n, (lambda eng=eng: fio(args.dir, eng))) for n, eng in zip(fio_names, ("io_uring", "libaio"))]
    for rep in range(args.reps):
        for name, job in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]:  # rotate the order every rep
            times[name].append(job())
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    for r in runs:
        r.close()
    for eng in ("io_uring", "libaio"):
        if os.path.exists(os.path.join(args.dir, f"fio-{eng}.dat")):
            os.unlink(os.path.join(args.dir, f"fio-{eng}.dat"))
    med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in times.items()}
    print(f"\n1 GiB as {N} x 16 MiB, dir {args.dir}, {args.reps} reps, checksum={args.checksum}; medians, GB/s")
    print(f"{'contender':30s} {'write':>8s} {'write+fsync':>12s} {'cold read':>10s} {'read request KiB':>17s}")
    for n, m in med.items():
        w = f"{gbps(m['write']):8.2f}" if "write" in m else f"{'-':>8s}"
        print(f"{n:30s} {w} {gbps(m['write+fsync']):12.2f} {gbps(m['cold read']):10.2f} {m['req KiB']:17.0f}")
    print("\nratios of throughput (>1: ours faster): of the medians, and the median of the per-rep ratios")
    for be, fe in (("uring", "io_uring"), ("aio", "libaio")):
        pairs = [(f"raw[{be}]", f"raw tensornvme[{be}]", ("write", "write+fsync", "cold read"))]
        if be == "uring":
            pairs.append(("raw[uring,dir]", "raw tensornvme[uring,direct]", ("write+fsync", "cold read")))
        if have_fio:
            pairs.append((f"fio[{fe}]", f"fio[{fe}]", ("write+fsync", "cold read")))
        for ours in (f"NVMeStore[{be}]", f"NVMeStore[{be},out]", f"NVMeStore[{be},out=empty_for]"):
            for label, other, phases in pairs:
                for k in phases:
                    per_rep = statistics.median(o[k] / m[k] for o, m in zip(times[other], times[ours]))
                    print(f"  {ours:30s} / {label:15s} {k:12s} {med[other][k] / med[ours][k]:6.3f}   "
                          f"per-rep {per_rep:6.3f}")
    # per-rep ratios, to show the spread on this shared machine
    print("\nper-rep cold read GB/s: " + "; ".join(
        f"{n}: " + ",".join(f"{gbps(x['cold read']):.2f}" for x in v) for n, v in times.items()))
    print("per-rep write+fsync GB/s: " + "; ".join(
        f"{n}: " + ",".join(f"{gbps(x['write+fsync']):.2f}" for x in v) for n, v in times.items()))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def rss_child(directory, mode):
    g = torch.Generator().manual_seed(0)
    base = rss_bytes()
    tensors = [torch.randn(ITEM // 4, generator=g) for _ in range(N)]
    allocated = rss_bytes()
    store = fs.NVMeStore(directory)
    for h in [store.put(i, t) for i, t in enumerate(tensors)]:
        h.wait()
    if mode == "drop":
        del tensors, h
        gc.collect()
    after = rss_bytes()
    # after the measurement: the first tensor, regenerated, must read back equal
    ok = torch.equal(store.get(0).wait(), torch.randn(ITEM // 4, generator=torch.Generator().manual_seed(0)))
    store.close()
    print(json.dumps({"mode": mode, "base": base, "allocated": allocated, "after_put": after, "ok": ok}))


def rss(args):
    res = {}
    for mode in ("keep", "drop"):
        out = subprocess.run([sys.executable, __file__, "--rss-child", mode, "--dir", args.dir],
                             check=True, capture_output=True, text=True).stdout
        res[mode] = json.loads(out.strip().splitlines()[-1])
    mib = lambda b: b / MIB  # noqa: E731
    for mode, r in res.items():
        print(f"{mode:5s}: RSS before {mib(r['base']):7.1f} MiB, after allocating 1 GiB {mib(r['allocated']):7.1f}, "
              f"after put (+{'drop' if mode == 'drop' else 'keep'}) {mib(r['after_put']):7.1f} MiB")
    print(f"RSS saved by putting 1 GiB into NVMeStore and dropping it: "
          f"{mib(res['keep']['after_put'] - res['drop']['after_put']):.1f} MiB (expected ~1024); "
          f"read back equal: {res['drop']['ok'] and res['keep']['ok']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/var/tmp/fshard-bench")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--checksum", default="fast", choices=["fast", "crc32"])
    p.add_argument("--rss", action="store_true")
    p.add_argument("--no-settle", action="store_true", help="evict files only (the old, unequal protocol)")
    p.add_argument("--buffered", action="store_true", help="also run the uring store with direct=False")
    p.add_argument("--rss-child", choices=["keep", "drop"])
    a = p.parse_args()
    if a.rss_child:
        rss_child(a.dir, a.rss_child)
    elif a.rss:
        rss(a)
    else:
        bench(a)
