"""One GPU, world size 1: train a GPT whose fp32 AdamW state does not fit in GPU memory (issue #23, "offload past
device memory").

The model (examples/gpt.py; default dim 4096, 30 layers, vocab 32768: 6.3B parameters) costs 16 bytes per
parameter of fp32 AdamW state (weights, gradients, two moments): about 100 GB against the H100's 80. fshard keeps
the fp32 master shards, the gradients and the bf16 compute copies on the GPU and the two moments in pinned host
memory (``fs.offload_state(fs.CPUStore())``), or on disk (``--nvme DIR``: an NVMeStore holds ``--nvme-fraction``
of the moments, default all of them, and the GPU the rest). The update runs on the host (fshard.ops' AVX-512 kernel)
and sends the parameters back: ZeRO-Offload's arrangement. ``donate=True``: the update writes in place (a second
24 GB copy of the weights would not fit).

First the peer: plain torch (the model on the GPU, ``AdamW(fused=True)``, bf16 autocast) on the same model, which
is expected to run out of memory; its outcome is printed, so the claim "does not fit" is measured, not assumed.
DeepSpeed is not on the GPU image, so ZeRO-Offload is not run.

Reported per step: wall seconds, the loss, peak GPU memory (``max_memory_allocated``), host RSS (and its peak),
and fshard's own timings (``time/update``: the host update with its transfers, all exposed at world size 1;
``time/io_wait`` for the NVMe store).

    python benchmarks/offload_cuda.py --json $OUT/offload_cuda.json
    python benchmarks/offload_cuda.py --nvme /tmp/moments --skip-peer

Issue #43 adds three modes, each best run in a process of its own (``--mode all`` runs them so, one after the
other, and writes one JSON):

* ``--mode floors``: what the machine allows. PCIe: pinned host <-> device copies of 1 GiB, each way (median of
  5); host DRAM: a 2 GiB tensor copy with all of torch's threads (bytes read + written); and fshard's host AdamW
  kernel over 256M fp32 parameters (28 bytes a parameter: p, g, m, v read; p, m, v written). The step's floor is
  the issue's: bf16 gradients down and bf16 parameters up (2 + 2 bytes a parameter over PCIe) plus one fp32 AdamW
  pass in host DRAM (28 bytes a parameter), each at the measured speed (DRAM: the faster of the copy and the
  kernel's own pass, a bandwidth the machine reached).
* ``--mode fshard --params``: moments AND master weights in host memory (``offload_state(CPUStore(pin=...),
  params=True, overlap_backward=True)``): with ``--pin`` each gather copies its unit's fp32 items straight from the
  store's pinned memory to the GPU and casts them there (the copy engine's work, as FSDP2's offload); without,
  the reader thread reads and casts them into pinned memory and the bf16 shard goes up. The gradients go down whole
  units at a time on a copy stream (fshard/offload/_staging.py) and each unit's host update starts once its gradient is
  final, during backward.
* ``--mode fsdp2``: the peer, FSDP2 ``fully_shard`` per block and the root with ``CPUOffloadPolicy()`` (parameters,
  gradients and the optimizer step on the host: torch's ``AdamW(fused=True)`` on CPU tensors) and
  ``MixedPrecisionPolicy(bf16, fp32)``, built on meta and initialised on the host.

    python benchmarks/offload_cuda.py --mode all --json $OUT/offload.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

# Pinned host memory through malloc, its pages touched by 8 threads, then cudaHostRegister: 7.6-8.5 GiB/s on an H100
# where cudaHostAlloc (torch's default) gave 2.2-2.4, most of fs.init's time with 70 GiB of pinned items
# (design/OFFLOAD.md, "What init costs"). Every mode (the FSDP2 peer pins its parameters too) runs under it; a
# PYTORCH_CUDA_ALLOC_CONF of the caller's own wins. Set before torch starts CUDA, which reads it once.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import fshard as fs  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn, synthetic_batches  # noqa: E402

GIB = 1 << 30


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / (1 << 20)
    return float("nan")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def plain_torch(cfg, batch) -> str:
    """The peer: can plain torch hold this model's AdamW step on the GPU?"""
    model = opt = None
    try:
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        return f"ran (loss {loss.item():.4f}), peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB"
    except torch.OutOfMemoryError as e:
        return f"out of memory at {torch.cuda.max_memory_allocated() / GIB:.1f} GiB: {str(e).splitlines()[0][:150]}"
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--nvme", default=None, help="a directory: put --nvme-fraction of the moments in an NVMeStore")
    ap.add_argument("--nvme-fraction", type=float, default=1.0)
    ap.add_argument("--fraction", type=float, default=1.0, help="the share of the moments' bytes in the CPUStore, "
                    "as whole units in model order; the rest stay on the GPU (offload_state(fraction=): DeepSpeed "
                    "ZeRO-Offload++'s ratio); with --nvme, --nvme-fraction instead")
    ap.add_argument("--chunk-mb", type=float, default=64, help="MiB of each moment per store item")
    ap.add_argument("--depth", type=int, default=2, help="offload_state(depth=): reads ahead, and with the update on "
                    "the GPU the chunks whose copies down may be in flight")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mode", default="fshard", choices=("fshard", "fsdp2", "floors", "all"))
    ap.add_argument("--params", action="store_true", help="master weights in the store too (params=True)")
    ap.add_argument("--timeline", default=None, help="fshard mode: write the last step's timeline (PNG and spans"
                    " as JSON beside it) here")
    ap.add_argument("--update-on", default="host", type=_update_on,
                    help="offload_state(update_on=): host (the update on the host's cores), device (on the GPU, "
                    "the stored chunks copied up and back), or a share of the units updated on the GPU while the "
                    "host's cores update the rest (0.4)")
    ap.add_argument("--pin", action="store_true", help="CPUStore(pin=True): store items in pinned memory")
    ap.add_argument("--timeout", type=float, default=400, help="--mode all: seconds for each mode's process")
    ap.add_argument("--partial-fraction", type=float, default=0.7,
                    help="--mode all: the fshard_partial run's --fraction (the rest of the moments on the GPU)")
    ap.add_argument("--all-modes", default="floors,fshard,fsdp2",
                    help="--mode all: what to run, in order, of floors, fshard (params=True), fshard_moments (master "
                    "weights on the GPU, moments on the host), fshard_partial (the same, --partial-fraction of "
                    "the moments on the host), fshard_device and fshard_device_params (fshard_moments and fshard "
                    "with the update on the GPU), fshard_splitNN (fshard_device with NN%% of the units on the GPU "
                    "and the rest on the host's cores meanwhile: fshard_split40), fshard_device_dN (fshard_device at "
                    "--depth N) and fsdp2")
    a = ap.parse_args()
    if a.mode == "all":
        return run_all(a)
    if a.mode == "floors":
        return floors(a)
    if a.mode == "fsdp2":
        return fsdp2(a)
    if not torch.cuda.is_available():
        print("offload_cuda.py needs a CUDA device", file=sys.stderr)
        return 2
    cfg = GPTConfig(vocab=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, seq=a.seq)
    with torch.device("meta"):
        n = GPT(cfg).num_params()
    print(f"[offload_cuda] {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {n / 1e9:.2f}B params, "
          f"fp32 AdamW state {16 * n / GIB:.0f} GiB vs {torch.cuda.get_device_properties(0).total_memory / GIB:.0f}"
          f" GiB of GPU memory; batch {a.batch} x seq {a.seq}", flush=True)
    batches = [tuple(t.cuda() for t in b) for b in synthetic_batches(cfg, a.batch, a.steps, seed=0)]
    out = {"params": n, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if not a.skip_peer:
        out["plain_torch"] = plain_torch(cfg, batches[0])
        print(f"[offload_cuda] plain torch (AdamW fused, autocast bf16): {out['plain_torch']}", flush=True)

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
    if a.nvme:
        store, frac = fs.NVMeStore(a.nvme), a.nvme_fraction
    else:
        store, frac = fs.CPUStore(pin=a.pin), a.fraction
    device = a.update_on == "device" or (a.update_on != "host" and a.update_on > 0)  # (after backward: up and back)
    offload = fs.offload_state(store, fraction=frac, chunk_mb=a.chunk_mb, params=a.params, update_on=a.update_on,
                               depth=a.depth, overlap_backward=True if a.params and not device else None)
    # offload=: the moments go to the store unit by unit; made on the GPU first, they would not fit beside the weights
    state = fs.init(model, fs.Mesh.local("cuda"), fs.adamw(lr=a.lr, weight_decay=0.1), seed=0, offload=offload)
    torch.cuda.synchronize()
    out["init_s"] = time.perf_counter() - t0
    print(f"[offload_cuda] fs.init {out['init_s']:.1f} s, GPU {torch.cuda.memory_allocated() / GIB:.1f} GiB, "
          f"host RSS {rss_gib():.1f} GiB; moments: {frac:.0%} in {type(store).__name__}", flush=True)
    rows = []
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.mixed_precision(), offload, donate=True,
                    timeline=a.timeline is not None) as step:
        for s, batch in enumerate(batches):
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t = time.perf_counter()
            state, m = step(state, batch)
            torch.cuda.synchronize()
            row = dict(step=s, seconds=time.perf_counter() - t, loss=m["loss"],
                       gpu_peak_gib=torch.cuda.max_memory_allocated() / GIB,
                       gpu_gib=torch.cuda.memory_allocated() / GIB, rss_gib=rss_gib(), rss_peak_gib=peak_rss_gib(),
                       **{k: v for k, v in m.items() if k.startswith(("time/", "io/", "store/"))
                          and isinstance(v, (int, float))})
            rows.append(row)
            print(f"[offload_cuda] step {s}: {row['seconds']:.2f} s, loss {row['loss']:.4f}, GPU peak "
                  f"{row['gpu_peak_gib']:.1f} GiB, host RSS {row['rss_gib']:.1f} GiB (peak {row['rss_peak_gib']:.1f}),"
                  f" update {row.get('time/update', 0):.2f} s, io wait {row.get('time/io_wait', 0):.2f} s"
                  + (f", split: device part {row['time/split_device']:.2f} s, host part {row['time/split_host']:.2f} s"
                     if "time/split_device" in row else ""), flush=True)
            if a.json:  # after each step: a run cut off by its limit still leaves what it measured
                Path(a.json).write_text(json.dumps({**out, "steps": rows}, indent=1))
            if a.timeline and s == len(batches) - 1:
                tl = fs.timeline(m, a.timeline, title=f"offload_cuda fshard step {s}")
                Path(a.timeline).with_suffix(".json").write_text(json.dumps(
                    [list(sp) for sp in tl.spans], default=str))
                print(f"[offload_cuda] timeline: {a.timeline} (overlap {getattr(tl, 'overlap', None)})", flush=True)
    out["steps"] = rows
    out["config"] = dict(params=a.params, pin=a.pin, chunk_mb=a.chunk_mb, batch=a.batch, seq=a.seq,
                         update_on=a.update_on, fraction=frac)
    losses = [r["loss"] for r in rows]
    out["loss_falls"] = losses[-1] < losses[0]
    print(f"[offload_cuda] losses {' '.join(f'{x:.4f}' for x in losses)}: "
          f"{'falling' if out['loss_falls'] else 'NOT falling'}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def _update_on(text: str):
    """--update-on: "host", "device", or a share in [0, 1] (offload_state's update_on)."""
    return text if text in ("host", "device") else float(text)


def _cfg(a):
    return GPTConfig(vocab=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, seq=a.seq)


def _bw(fn, nbytes: int, rounds: int = 5) -> float:
    """Median GB/s of ``fn()`` moving ``nbytes`` (CUDA-synchronised)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return nbytes / sorted(ts)[len(ts) // 2] / 1e9


def floors(a) -> int:
    """PCIe each way (pinned), host DRAM copy, and fshard's host AdamW kernel: the step's floor for this model."""
    import fshard.ops as ops
    n = 1 << 28  # 1 GiB of fp32
    host = torch.empty(n, pin_memory=True).fill_(1.0)
    dev = torch.empty(n, device="cuda")
    h2d = _bw(lambda: dev.copy_(host, non_blocking=True), 4 * n)
    d2h = _bw(lambda: host.copy_(dev, non_blocking=True), 4 * n)
    # both ways at once, on two streams (update_on="device": chunk i+1 goes up while chunk i-1 comes down)
    host2, dev2 = torch.empty(n, pin_memory=True), torch.empty(n, device="cuda")
    up_s, down_s = torch.cuda.Stream(), torch.cuda.Stream()

    def duplex():
        cur = torch.cuda.current_stream()
        up_s.wait_stream(cur)
        down_s.wait_stream(cur)
        with torch.cuda.stream(up_s):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(down_s):
            host2.copy_(dev2, non_blocking=True)
        cur.wait_stream(up_s)
        cur.wait_stream(down_s)
    both = _bw(duplex, 4 * n)  # GB/s each way while the other runs
    host = dev = host2 = dev2 = None  # (free before the next)
    src, dst = torch.ones(1 << 29), torch.empty(1 << 29)  # 2 GiB each
    dram = _bw(lambda: dst.copy_(src), 2 * 4 * (1 << 29))
    src = dst = None
    m = 1 << 28
    p, g, mm, v = torch.randn(m), torch.randn(m), torch.zeros(m), torch.zeros(m)
    adam = _bw(lambda: ops.adamw_([p], [g], [mm], [v], step=1, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                                  weight_decay=0.1, grad_scale=1.0, param_copies=None, check_finite=False), 28 * m)
    p = g = mm = v = None
    out_probe = _update_probe(a.chunk_mb)
    with torch.device("meta"):
        params = GPT(_cfg(a)).num_params()
    pcie_s = 2 * params / (d2h * 1e9) + 2 * params / (h2d * 1e9)
    # host DRAM's speed: the faster of the copy and the AdamW kernel's own pass (a bandwidth it reached)
    dram_s = 28 * params / (max(dram, adam) * 1e9)
    # the update on the GPU with the moments on the host (update_on="device"): AdamW's two fp32 rows up and back
    device_s = 8 * params / (both * 1e9)
    out = dict(h2d_gbps=h2d, d2h_gbps=d2h, duplex_gbps=both, device_update_floor_s=device_s, dram_copy_gbps=dram,
               host_adamw_gbps=adam, threads=torch.get_num_threads(), params=params, pcie_floor_s=pcie_s,
               dram_floor_s=dram_s, floor_s=pcie_s + dram_s, adamw_kernel_s=28 * params / (adam * 1e9),
               update_probe=out_probe)
    print(f"[offload_cuda] floors: PCIe h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s; host DRAM copy {dram:.1f} GB/s; "
          f"host AdamW kernel {adam:.1f} GB/s ({torch.get_num_threads()} threads); {params / 1e9:.2f}B params: "
          f"PCIe floor {pcie_s:.2f} s + DRAM floor {dram_s:.2f} s = {pcie_s + dram_s:.2f} s (kernel pass "
          f"{out['adamw_kernel_s']:.2f} s); both ways at once {both:.1f} GB/s each: the moments up and back "
          f"(update_on='device') {device_s:.2f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def _update_probe(chunk_mb: float) -> dict:
    """The host update's kernel as offload_state's worker runs it: bf16 gradients, 256M parameters in calls of
    ``chunk_mb`` MiB of fp32, from a thread of its own at nice 0 or 5 (offload_state's worker_nice), alone, beside a
    thread that spins (a CUDA synchronisation's wait), or beside pinned host-to-device copies (a gather's upload):
    GB/s at 26 bytes a parameter; also beside a Python thread (the GIL, which each chunk's call takes back). Says what keeps the step's update below the kernel's bare speed."""
    import threading
    import fshard.ops as ops
    from fshard.dist._threads import lower_priority
    n, k = 1 << 28, max(1, int(chunk_mb * 2**20) // 4)
    p, mm, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(torch.bfloat16)
    host = torch.empty(1 << 28, pin_memory=True)
    dev = torch.empty(1 << 28, device="cuda")

    def one_pass():
        for lo in range(0, n, k):
            hi = min(n, lo + k)
            ops.adamw_([p[lo:hi]], [g[lo:hi]], [mm[lo:hi]], [v[lo:hi]], step=1, lr=1e-4, beta1=0.9, beta2=0.95,
                       eps=1e-8, weight_decay=0.1, grad_scale=1.0, param_copies=None, check_finite=False)

    def timed(nice: int, load: str | None) -> float:
        res, stop = [], threading.Event()

        def worker():
            lower_priority(nice)
            one_pass()
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                one_pass()
                ts.append(time.perf_counter() - t)
            res.append(sorted(ts)[1])

        def spin():  # a CUDA wait (the driver spins with the GIL let go)
            while not stop.is_set():
                torch.cuda._sleep(10**7)
                torch.cuda.synchronize()

        def python():  # Python code on another thread (the GIL held, let go when the worker asks)
            x = 0
            while not stop.is_set():
                x += 1

        def dma():
            s = torch.cuda.Stream()
            while not stop.is_set():
                with torch.cuda.stream(s):
                    dev.copy_(host, non_blocking=True)
                s.synchronize()

        side = None if load is None else threading.Thread(target={"spin": spin, "dma": dma, "python": python}[load], daemon=True)
        if side is not None:
            side.start()
        w = threading.Thread(target=worker)
        w.start()
        w.join()
        stop.set()
        if side is not None:
            side.join()
        return 26 * n / res[0] / 1e9

    out = {f"nice{nice}_{load or 'alone'}": timed(nice, load)
           for nice, load in ((0, None), (5, None), (5, "spin"), (0, "spin"), (5, "dma"), (5, "python"))}
    out["chunk_numel"], out["threads"] = k, torch.get_num_threads()
    print(f"[offload_cuda] update probe (GB/s, 26 B/param, chunks of {k} elements): "
          + ", ".join(f"{key} {val:.1f}" for key, val in out.items() if isinstance(val, float)), flush=True)
    return out


def fsdp2(a) -> int:
    """The peer: FSDP2 with CPUOffloadPolicy (the optimizer step on the host through torch's fused AdamW)."""
    import os
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from gpt import init_weights
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    cfg = _cfg(a)
    batches = [tuple(t.cuda() for t in b) for b in synthetic_batches(cfg, a.batch, a.steps, seed=0)]
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
    dm = init_device_mesh("cuda", (1,))
    mp, off = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), CPUOffloadPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=dm, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=dm, mp_policy=mp, offload_policy=off)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.apply(init_weights)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, fused=True)
        kind = "fused"
    except Exception as e:  # noqa: BLE001 - an older torch without the CPU fused kernel
        opt, kind = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1), f"foreach ({e})"
    out = {"params": sum(p.numel() for p in model.parameters()), "init_s": time.perf_counter() - t0,
           "optimizer": kind, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"[offload_cuda] FSDP2 CPUOffloadPolicy: init {out['init_s']:.1f} s, AdamW {kind}, host RSS "
          f"{rss_gib():.1f} GiB", flush=True)
    rows = []
    for s, batch in enumerate(batches):
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = loss_fn(model, batch)
        loss.backward()
        tb = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        row = dict(step=s, seconds=time.perf_counter() - t, update_s=time.perf_counter() - tb, loss=loss.item(),
                   gpu_peak_gib=torch.cuda.max_memory_allocated() / GIB, rss_gib=rss_gib(),
                   rss_peak_gib=peak_rss_gib())
        rows.append(row)
        print(f"[offload_cuda] FSDP2 step {s}: {row['seconds']:.2f} s (optimizer {row['update_s']:.2f} s), loss "
              f"{row['loss']:.4f}, GPU peak {row['gpu_peak_gib']:.1f} GiB, host RSS {row['rss_gib']:.1f} GiB",
              flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({**out, "steps": rows}, indent=1))
    out["steps"] = rows
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    return 0


def run_all(a) -> int:
    """floors, fshard (--params), FSDP2: each in a process of its own (the host memory of one is gone before the
    next), then the ratios: fshard's step against the floor (target <= 3x) and against FSDP2's (target <= 0.5x)."""
    import subprocess
    import tempfile
    common = ["--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads), "--vocab", str(a.vocab),
              "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps), "--chunk-mb", str(a.chunk_mb)]
    res = {}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        pin, tl = (["--pin"] if a.pin else []), (["--timeline", a.timeline] if a.timeline else [])
        # label -> (mode, its arguments); fshard_moments: master weights on the GPU, only the moments on the host
        runs = {"floors": ("floors", []), "fsdp2": ("fsdp2", []),
                "fshard": ("fshard", ["--params", "--skip-peer"] + pin + tl),
                "fshard_moments": ("fshard", ["--skip-peer"] + pin),
                # fshard_moments with 1 - --partial-fraction of the units' moments on the GPU (a partial offload,
                # DeepSpeed ZeRO-Offload++'s ratio: a layout FSDP2's CPUOffloadPolicy has no counterpart of)
                "fshard_partial": ("fshard", ["--skip-peer", "--fraction", str(a.partial_fraction)] + pin),
                # fshard_moments and fshard with the update on the GPU: the stored chunks go up and come back
                "fshard_device": ("fshard", ["--skip-peer", "--update-on", "device"] + pin),
                "fshard_device_params": ("fshard", ["--params", "--skip-peer", "--update-on", "device"] + pin)}
        labels = a.all_modes.split(",")
        for label in labels:  # fshard_splitNN: fshard_device with NN% of the units on the GPU, the rest on the host;
            if re.fullmatch(r"fshard_split\d\d", label):  # fshard_device_dN: fshard_device at depth N
                runs[label] = ("fshard", ["--skip-peer", "--update-on", str(int(label[-2:]) / 100)] + pin)
            if re.fullmatch(r"fshard_device_d\d+", label):
                runs[label] = ("fshard", ["--skip-peer", "--update-on", "device", "--depth", label[15:]] + pin)
        if set(labels) - set(runs):
            raise SystemExit(f"--all-modes: unknown {sorted(set(labels) - set(runs))}; choose from {sorted(runs)}")
        for label in labels:
            mode, extra = runs[label]
            # beside --json where given: a call cut off by its limit still leaves each finished mode's figures
            path = (f"{d}/{label}.json" if not a.json else
                    str(Path(a.json).with_name(f"{Path(a.json).stem}_{label}.json")))
            cmd = [sys.executable, __file__, "--mode", mode, "--json", path, *common, *extra]
            Path(path).unlink(missing_ok=True)  # an earlier run's figures never stand in for a mode that fails
            print(f"[offload_cuda] $ {' '.join(cmd[1:])}", flush=True)
            try:
                rc = subprocess.run(cmd, timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            res[label] = json.loads(Path(path).read_text()) if Path(path).exists() else {"rc": rc}
    med = lambda rows: sorted(r["seconds"] for r in rows[1:])[len(rows[1:]) // 2] if len(rows) > 1 else None  # noqa
    fs_s = med(res.get("fshard", {}).get("steps", []))
    peer_s = med(res.get("fsdp2", {}).get("steps", []))
    moments_s = med(res.get("fshard_moments", {}).get("steps", []))
    partial_s = med(res.get("fshard_partial", {}).get("steps", []))
    device_s = med(res.get("fshard_device", {}).get("steps", []))
    device_params_s = med(res.get("fshard_device_params", {}).get("steps", []))
    floor = res.get("floors", {}).get("floor_s")
    res["summary"] = dict(fshard_step_s=fs_s, fsdp2_step_s=peer_s, floor_s=floor,
                          over_floor=fs_s / floor if fs_s and floor else None,
                          over_fsdp2=fs_s / peer_s if fs_s and peer_s else None, moments_step_s=moments_s,
                          moments_over_fsdp2=moments_s / peer_s if moments_s and peer_s else None,
                          partial_step_s=partial_s,
                          partial_over_fsdp2=partial_s / peer_s if partial_s and peer_s else None,
                          device_step_s=device_s, device_over_fsdp2=device_s / peer_s if device_s and peer_s else None,
                          device_over_floor=device_s / floor if device_s and floor else None,
                          device_floor_s=res.get("floors", {}).get("device_update_floor_s"),
                          device_params_step_s=device_params_s,
                          device_params_over_fsdp2=device_params_s / peer_s if device_params_s and peer_s else None)
    for label in (k for k in res if k.startswith(("fshard_split", "fshard_device_d"))):
        split_s = med(res[label].get("steps", []))
        res["summary"][f"{label}_step_s"] = split_s
        res["summary"][f"{label}_over_fsdp2"] = split_s / peer_s if split_s and peer_s else None
        res["summary"][f"{label}_over_device"] = split_s / device_s if split_s and device_s else None
    print(f"[offload_cuda] summary: {json.dumps(res['summary'])}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
