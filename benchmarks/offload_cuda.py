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
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from pathlib import Path

import torch

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
    ap.add_argument("--chunk-mb", type=float, default=64, help="MiB of each moment per store item")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
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
    out = {"params": n, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if not a.skip_peer:
        out["plain_torch"] = plain_torch(cfg, batches[0])
        print(f"[offload_cuda] plain torch (AdamW fused, autocast bf16): {out['plain_torch']}", flush=True)

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
    if a.nvme:
        store, frac = fs.NVMeStore(a.nvme), a.nvme_fraction
    else:
        store, frac = fs.CPUStore(), 1.0
    offload = fs.offload_state(store, fraction=frac, chunk_mb=a.chunk_mb)
    # offload=: the moments go to the store unit by unit; made on the GPU first, they would not fit beside the weights
    state = fs.init(model, fs.Mesh.local("cuda"), fs.adamw(lr=a.lr, weight_decay=0.1), seed=0, offload=offload)
    torch.cuda.synchronize()
    out["init_s"] = time.perf_counter() - t0
    print(f"[offload_cuda] fs.init {out['init_s']:.1f} s, GPU {torch.cuda.memory_allocated() / GIB:.1f} GiB, "
          f"host RSS {rss_gib():.1f} GiB; moments: {frac:.0%} in {type(store).__name__}", flush=True)
    rows = []
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.mixed_precision(), offload, donate=True) as step:
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
                  f" update {row.get('time/update', 0):.2f} s, io wait {row.get('time/io_wait', 0):.2f} s", flush=True)
    out["steps"] = rows
    losses = [r["loss"] for r in rows]
    out["loss_falls"] = losses[-1] < losses[0]
    print(f"[offload_cuda] losses {' '.join(f'{x:.4f}' for x in losses)}: "
          f"{'falling' if out['loss_falls'] else 'NOT falling'}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
