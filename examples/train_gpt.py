"""Train the example GPT with fshard: a user-written loop over the public API.

    python examples/train_gpt.py --tiny --steps 50                       # world size 1
    torchrun --nproc-per-node 2 examples/train_gpt.py --tiny --steps 50   # any N; gloo on CPU, nccl on CUDA
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 20          # the 27.4M-parameter default GPT
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 4 --timeline docs/timeline.png  # the last step, drawn
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 2 examples/train_gpt.py \
        --checkpoint-dir ckpt --save-every 20  # resumes from fs.latest(ckpt) whenever it (re)starts (the variable:
                                               # pytorch/pytorch#135712: a restarted rank read a dead peer's address)

The model is built on the meta device and materialised by ``fs.init`` unit by unit with the GPT-2 init
(``init_fn=init_weights``). Each rank draws its own slice of a deterministic global batch (``synthetic_batches``),
so runs at different world sizes with the same global batch see the same data.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import fshard as fs  # noqa: E402
from gpt import GPT, GPTConfig, init_weights, loss_fn, synthetic_batches  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the example GPT with fshard.")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="cosine: linear warmup over --warmup-steps, then cosine decay to lr/10 at the last step")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--decay-all", action="store_true",
                   help="decay every parameter (default: only matrices, p.ndim >= 2, not biases and norms)")
    p.add_argument("--tiny", action="store_true", help="GPTConfig.tiny() (vocab 97, dim 32, 2 layers)")
    p.add_argument("--tie-weights", action="store_true", help="tie lm_head.weight to the token embedding")
    p.add_argument("--nvme-dir", default=None, help="keep the AdamW moments in an NVMe store in this directory")
    p.add_argument("--offload-fraction", type=float, default=1.0, help="share of the moments offloaded")
    p.add_argument("--offload-params", action="store_true",
                   help="with --nvme-dir: the fp32 parameter shards in the store too (read ahead of each gather), "
                        "placed there by fs.init, and one bucket per unit (each gradient shard freed once updated)")
    p.add_argument("--depth", type=int, default=2, help="gather_ahead depth (0: blocking gathers)")
    p.add_argument("--bucket-mb", type=float, default=25, help="bucket_reduce bucket size (0: blocking reduce)")
    p.add_argument("--clip", type=float, default=1.0, help="clip_by_global_norm max norm (0: no clipping)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="bf16: fs.mixed_precision() (bf16 gathers and compute, fp32 reduce and master state); "
                        "fp16: the same in fp16, with dynamic loss scaling (the scale lives in the state)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", action="store_true", help="print step.plan(state, batch) (rank 0) before training")
    p.add_argument("--log-every", type=int, default=10, help="print a log line every N steps (0: never)")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="record every step's timeline and draw the last step's as a PNG here (fs.timeline)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="resume from fs.latest(DIR) at start, and save there every --save-every steps and at the end")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints kept in --checkpoint-dir")
    p.add_argument("--async-save", action="store_true",
                   help="save in the background (fs.save(..., blocking=False)); steps then do not donate their input")
    p.add_argument("--export", default=None, metavar="PATH",
                   help="at the end, torch.save(fs.full_state_dict(state, rank0_only=True)) on rank 0")
    p.add_argument("--fault-at", type=int, default=None, metavar="STEP",
                   help="testing restarts: the last rank kills itself (SIGKILL) before this step, in torchrun's "
                        "first attempt only (TORCHELASTIC_RESTART_COUNT 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: CPUs / ranks on this node, at least 1)")
    args = p.parse_args(argv)
    if args.offload_params and not args.nvme_dir:
        p.error("--offload-params keeps the parameter shards in the NVMe store: give --nvme-dir DIR too")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))

    mesh = fs.Mesh.from_env()
    rank, world = mesh.rank, mesh.world_size
    log = print if rank == 0 else (lambda *a, **k: None)

    cfg = (GPTConfig.tiny if args.tiny else GPTConfig)(tie_weights=args.tie_weights)
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = model.num_params()

    lr = args.lr
    if args.schedule == "cosine" and args.steps > 1:
        warmup = min(args.steps - 1, args.warmup_steps if args.warmup_steps is not None else args.steps // 10)
        lr = fs.schedules.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, end_value=args.lr / 10)
    opt = fs.adamw(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay,
                   weight_decay_mask=None if args.decay_all else (lambda name, p: p.ndim >= 2))
    latest = fs.latest(args.checkpoint_dir) if args.checkpoint_dir else None
    store = offload = None
    if args.nvme_dir:
        store = fs.NVMeStore(os.path.join(args.nvme_dir, f"rank{rank}"))
        offload = fs.offload_state(store, fraction=args.offload_fraction, params=args.offload_params)
    torch.manual_seed(args.seed)
    # resuming: an abstract state (shapes only) to load into, so the initial weights are never made; with
    # --offload-params each unit's shard and moments go to the store as fs.init makes it (never the whole model)
    state = fs.init(model, mesh, opt, init_fn=init_weights, seed=args.seed, abstract=latest is not None,
                    offload=offload if args.offload_params and latest is None else None)
    del model  # the state owns the (sharded) parameters now

    transforms = [fs.gather_ahead(args.depth)] if args.depth else []
    if args.bucket_mb:
        transforms.append(fs.bucket_reduce(per_unit=True) if args.offload_params else fs.bucket_reduce(args.bucket_mb))
    if args.precision != "fp32":  # wraps the gather and reduce stages: after the transforms that set them
        transforms.append(fs.mixed_precision(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[args.precision]),
                                             torch.float32))
    if args.clip:  # fp16's loss scaling skips overflowing steps itself (and backs the scale off)
        transforms += [fs.clip_by_global_norm(args.clip)] + ([fs.skip_nonfinite()] if args.precision != "fp16" else [])
    if offload is not None:
        transforms.append(offload)
    done = 0  # steps (batches) already trained: a checkpoint's update and skip counts
    if latest is not None:
        state = fs.load(latest, like=state, offload=offload)  # moments straight into the store, if offloaded
        done = int(state.step) + int(state.skipped)
        log(f"resumed from {latest} (step {done})")
    # donate=True: each step updates the state it is given in place (the loop never reuses an old state), so the
    # step holds one state, not the input and the output (design/ARCHITECTURE.md, "What a step costs"). A
    # background save reads the state while training goes on, so that the step must leave it as it is.
    step = fs.compose(loss_fn, *transforms, donate=not args.async_save, timeline=bool(args.timeline))
    log(f"transforms: {', '.join(map(repr, transforms)) or 'none (blocking)'}")
    log(f"GPT {n_params:,} params | world {world} | batch {args.batch_size}/rank "
        f"({args.batch_size * world} global) x seq {cfg.seq} | {args.steps} steps | "
        f"threads/rank {torch.get_num_threads()}")

    batches = synthetic_batches(cfg, args.batch_size, args.steps, args.seed, rank, world)
    bar = None
    if rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=args.steps, initial=done, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout,
                   mininterval=0.1 if sys.stdout.isatty() else 2.0)

    batches = list(batches)[done:]
    saving = None  # the background save in flight (--async-save)

    def save(n: int):
        nonlocal saving
        if saving is not None:
            saving.wait()  # one save at a time; also before the next one rotates the directory
        path = os.path.join(args.checkpoint_dir, f"step-{n:08d}")
        handle = fs.save(path, state, keep_last=args.keep_last, blocking=not args.async_save)
        saving = handle if args.async_save else None

    if args.plan and batches:  # what a step will hold and move on this rank, before it runs (no collective)
        log(step.plan(state, batches[0]))
    metrics: dict = {}
    losses, times = [], []
    t_start = time.perf_counter()
    for i, batch in enumerate(batches, start=done):
        if args.fault_at == i and rank == world - 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)  # as a crashed node would: torchrun restarts the group
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        dt = time.perf_counter() - t0
        loss = float(metrics["loss"])
        losses.append(loss)
        times.append(dt)
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} at step {i}")
        if bar is not None:
            post = dict(loss=f"{loss:.4f}", step_s=f"{dt:.3f}")
            if "grad_norm" in metrics:
                post["gnorm"] = f"{metrics['grad_norm']:.3f}"
            if "loss_scale" in metrics:
                post["scale"] = f"{metrics['loss_scale']:g}"
            if "io/read_bytes" in metrics:
                post["io_MB"] = f"{(metrics['io/read_bytes'] + metrics['io/write_bytes']) / 1e6:.1f}"
            bar.set_postfix(**post, refresh=False)
            bar.update(1)
            if args.log_every and (i + 1) % args.log_every == 0:
                bar.write(f"step {i + 1:5d}  loss {loss:.4f}  {dt:.3f} s/step")
        if args.checkpoint_dir and args.save_every and (i + 1) % args.save_every == 0 and i + 1 < args.steps:
            save(i + 1)
    if args.checkpoint_dir and done < args.steps:
        save(args.steps)
    if saving is not None:
        saving.wait()
    wall = time.perf_counter() - t_start
    step.close()  # ends the offload worker thread; the store stays open until store.close()
    if bar is not None:
        bar.close()
    if args.timeline and losses:  # a collective: every rank passes its metrics of the last step; rank 0 draws
        tl = fs.timeline(metrics, args.timeline, mesh=mesh,
                         title=f"examples/train_gpt.py: GPT {n_params / 1e6:.1f}M params, {world} ranks "
                               f"({mesh.backend}), {' + '.join(t.name for t in transforms) or 'blocking'}, step "
                               f"{len(losses)} of {len(losses)}")
        log(f"timeline of step {len(losses)}: {tl.path} ({tl.step_seconds:.3f} s, overlap {tl.overlap:.0%})")

    if args.export:  # a collective: rank 0 gets model.state_dict() of the trained model, unit by unit
        sd = fs.full_state_dict(state, rank0_only=True)
        if rank == 0:
            torch.save(sd, args.export)
            log(f"exported {len(sd)} entries to {args.export}")
        del sd
    full = fs.full_params(state)  # collective: every rank must call it
    norm = math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in full.values()))
    steady = sorted(times[1:] or times)
    summary = {
        "steps": len(losses),
        "skipped_steps": int(state.skipped),
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": losses[-1] if losses else float("nan"),
        "median_step_s": steady[len(steady) // 2] if steady else float("nan"),
        "tokens_per_s": args.batch_size * world * cfg.seq * len(losses) / wall if wall > 0 else float("nan"),
        "param_l2_norm": norm,
        "n_full_params": len(full),
    }
    log("final metrics:")
    for k, v in metrics.items():
        if k.startswith("trace/"):
            continue
        log(f"  {k:24s} {v:.6g}" if isinstance(v, float) else f"  {k:24s} {v}")
    log("summary:")
    for k, v in summary.items():
        log(f"  {k:24s} {v:.6g}" if isinstance(v, float) else f"  {k:24s} {v}")
    log(f"final state:\n{state!r}")
    del state
    if store is not None:
        store.close()  # removes this run's files
    return summary


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
        dist.destroy_process_group()
