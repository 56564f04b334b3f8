"""New large CPU buffers written once: torch.empty's pages against the same after ``fshard._pages.advise`` (issue
#42, session 44), and a buffer already mapped, in one process, medians of --reps.

    .venv/bin/python benchmarks/s44/pages.py [--sizes 50,25,12.5] [--count 8] [--reps 10]

Each repetition allocates --count buffers of a size, writes each once (``torch.mul(src, 0.5, out=b)``, as a bucket's
section is written) and frees them: the time and the page faults (``ru_minflt``) a repetition. The advised rows
lower ``_pages.MIN_BYTES`` so that every size is advised."""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from fshard import _pages


def run(make, n: int, count: int, reps: int) -> tuple[float, float]:
    src, ts = torch.randn(n), []
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(reps):
        t = time.perf_counter()
        bufs = [make(n) for _ in range(count)]
        for b in bufs:
            torch.mul(src, 0.5, out=b)
        ts.append(time.perf_counter() - t)
        del bufs
    return statistics.median(ts) * 1e3, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50,25,12.5", help="MiB a buffer, comma-separated")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _pages.MIN_BYTES = 1 << 20
    print(f"huge pages asked for: {_pages.available()}; {args.count} buffers a repetition, medians of {args.reps}")
    print("| MiB a buffer | torch.empty ms | faults | advised ms | faults | already mapped ms |")
    print("|---|---|---|---|---|---|")
    for mb in (float(s) for s in args.sizes.split(",")):
        n = int(mb * 2**20) // 4
        kept = [torch.zeros(n) for _ in range(args.count)]
        it = iter(range(10**9))
        plain = run(lambda n: torch.empty(n), n, args.count, args.reps)
        advised = run(lambda n: _pages.empty(n, torch.float32, "cpu"), n, args.count, args.reps)
        mapped = run(lambda n: kept[next(it) % args.count], n, args.count, args.reps)
        print(f"| {mb:g} | {plain[0]:.1f} | {plain[1]:.0f} | {advised[0]:.1f} | {advised[1]:.0f} | {mapped[0]:.1f} |")


if __name__ == "__main__":
    main()
