"""Train the example GPT with fshard on real text: a user-written loop over the public API.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --small --steps 400       # `make train`
    python examples/train_gpt.py --tiny --steps 50 --run-dir runs/tiny                         # world size 1
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 20 --run-dir runs/big            # the 27.4M GPT
    torchrun --nproc-per-node 2 examples/train_gpt.py --data synthetic --tiny --run-dir runs/syn  # no corpus

The data (``--data stdlib``, examples/data.py) is the Python standard library's own source, tokenized by a
byte-level BPE trained on it once (cached under ``--cache-dir``); a ``DataLoader`` with a ``DistributedSampler``
gives each rank its own slice of every epoch, and disjoint files are held out for the validation loss
(``step.eval``, every ``--eval-every`` steps and at the end). The run ends with the line
``validation loss V (unigram baseline U)``: U is what a model that ignores the context scores at best.

Everything a run writes goes into ``--run-dir`` (default ``runs/gpt`` in the checkout, git-ignored):
``ckpt/`` (checkpoints), ``metrics.jsonl``, ``tb/`` (TensorBoard), ``loss.png`` and ``sample.txt``. Running the
same command again resumes from ``fs.latest(run_dir/ckpt)``; delete the directory (or give another) to start fresh.
Under ``torchrun --max-restarts N`` a rank that dies (``--fault-at STEP`` kills one) restarts the group, which
resumes the same way.

The model is built on the meta device and materialised by ``fs.init`` unit by unit with the GPT-2 init.
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
from gpt import GPT, GPTConfig, init_weights, loss_fn  # noqa: E402
from run_io import RunLog, batches_for, evaluate, generate_sample, prepare_data  # noqa: E402

_RUNS = os.path.join(os.path.dirname(_HERE), "runs")


# --optimizer -> (peak lr, peak lr with --small)
_LR = {"adamw": (1e-3, 3e-3), "muon": (1e-3, 3e-3), "lion": (1e-4, 3e-4), "sgd": (0.1, 0.1), "adafactor": (1e-2, 1e-2)}
_MUON_LR = 0.02  # Muon's own rate for the hidden matrices (torch.optim.Muon's examples; adjust_lr_fn None)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the example GPT with fshard.")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--optimizer", choices=tuple(_LR), default="adamw",
                   help="adamw; muon (fs.partition: Muon for the blocks' matrices, AdamW for embeddings, head, norms "
                        "and biases); lion, sgd (momentum 0.9), adafactor (fs.optim / fs.adafactor)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default per --optimizer: adamw 1e-3, 3e-3 --small; muon's AdamW part the "
                        "same and its Muon part 0.02; lion a tenth of adamw's; sgd 0.1; adafactor 0.01)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="cosine: linear warmup over --warmup-steps, then cosine decay to lr/10 at the last step")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--decay-all", action="store_true",
                   help="decay every parameter (default: only matrices, p.ndim >= 2, not biases and norms)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="GPTConfig.tiny() (dim 32, 2 layers, seq 16)")
    size.add_argument("--small", action="store_true", help="GPTConfig.small() (dim 128, 4 layers, seq 128)")
    p.add_argument("--tie-weights", action="store_true", help="tie lm_head.weight to the token embedding")
    p.add_argument("--data", choices=("stdlib", "synthetic"), default="stdlib",
                   help="stdlib: the Python standard library's source, BPE-tokenized (examples/data.py); synthetic: "
                        "affine sequences mod the vocabulary (gpt.synthetic_batches; no files, bitwise reproducible)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (--data stdlib)")
    p.add_argument("--max-train-mb", type=float, default=4.0, help="training split: at most this many MB of files")
    p.add_argument("--run-dir", default=os.path.join(_RUNS, "gpt"),
                   help="checkpoints, metrics.jsonl, tb/, loss.png, sample.txt (default: runs/gpt in the checkout)")
    p.add_argument("--cache-dir", default=os.path.join(_RUNS, "cache"), help="the trained tokenizer and tokens")
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (and at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank (0: all)")
    p.add_argument("--sample-tokens", type=int, default=120, help="tokens generated at the end (0: none)")
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
    p.add_argument("--log-every", type=int, default=50, help="a summary line every N steps (0: never)")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="record every step's timeline and draw the last step's as a PNG here (fs.timeline)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="default: RUN_DIR/ckpt. Resume from "
                   "fs.latest(DIR) at start, and save there every --save-every steps and at the end")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
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
    if args.nvme_dir and args.optimizer in ("muon", "adafactor"):
        p.error(f"--optimizer {args.optimizer} updates whole matrices, which fs.offload_state cannot stream: "
                "drop --nvme-dir, or use adamw, lion or sgd")
    if args.lr is None:
        args.lr = _LR[args.optimizer][1 if args.small else 0]
    args.checkpoint_dir = args.checkpoint_dir or os.path.join(args.run_dir, "ckpt")
    return args


def _optimizer(args):
    """The optimizer of --optimizer, its rate a warmup-cosine schedule of --lr (or constant); returns it and the
    schedule of --lr (what the log shows)."""
    def rate(peak):
        if args.schedule != "cosine" or args.steps <= 1:
            return peak
        warmup = min(args.steps - 1, args.warmup_steps if args.warmup_steps is not None else args.steps // 10)
        return fs.schedules.warmup_cosine_decay_schedule(0.0, peak, warmup, args.steps, end_value=peak / 10)

    def matrices(name, p):  # a named function: print(state) shows the mask as "matrices"
        return p.ndim >= 2

    def hidden(name, p):  # Muon's: the blocks' 2-D weights, not the embeddings or the head
        return "muon" if p.ndim == 2 and name.startswith("blocks.") else "adamw"

    lr, wd, mask = rate(args.lr), args.weight_decay, None if args.decay_all else matrices
    adamw = fs.adamw(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, weight_decay_mask=mask)
    opt = {"adamw": lambda: adamw,
           "muon": lambda: fs.partition({"muon": fs.muon(lr=rate(_MUON_LR), weight_decay=wd), "adamw": adamw},
                                        hidden),
           "lion": lambda: fs.optim.lion(lr=lr, weight_decay=wd * 10, weight_decay_mask=mask),
           "sgd": lambda: fs.optim.sgd(lr=lr, momentum=0.9, weight_decay=wd / 100, weight_decay_mask=mask),
           "adafactor": lambda: fs.adafactor(lr=lr, weight_decay=wd / 10)}[args.optimizer]()
    return opt, lr


def _transforms(args, offload):
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
    return transforms


def main(argv=None) -> dict:
    args = parse_args(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))

    mesh = fs.Mesh.from_env()
    rank, world = mesh.rank, mesh.world_size
    out = RunLog(args, rank)  # rank 0 writes: the console (tqdm), metrics.jsonl, TensorBoard
    corpus, vocab = prepare_data(args, rank, out)
    preset = GPTConfig.tiny if args.tiny else GPTConfig.small if args.small else GPTConfig
    cfg = preset(tie_weights=args.tie_weights, **({"vocab": vocab} if vocab else {}))
    out.check_config(cfg)  # a run directory holds one model: refuse another's checkpoints, naming the fix
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = model.num_params()

    opt, lr = _optimizer(args)
    latest = fs.latest(args.checkpoint_dir) if os.path.isdir(args.checkpoint_dir) else None
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

    transforms = _transforms(args, offload)
    done = 0  # steps (batches) already trained: a checkpoint's update and skip counts
    if latest is not None:
        state = fs.load(latest, like=state, offload=offload)  # moments straight into the store, if offloaded
        done = int(state.step) + int(state.skipped)
        out.write(f"resumed from {latest} (step {done})")
    # donate=True: each step updates the state it is given in place (the loop never reuses an old state), so the
    # step holds one state, not the input and the output (design/ARCHITECTURE.md, "What a step costs"). A
    # background save reads the state while training goes on, so that the step must leave it as it is.
    step = fs.compose(loss_fn, *transforms, donate=not args.async_save, timeline=bool(args.timeline))
    tokens_per_step = args.batch_size * world * cfg.seq
    out.write(f"GPT {n_params:,} params (dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab}) | world {world} "
              f"| batch {args.batch_size}/rank x seq {cfg.seq} = {tokens_per_step:,} tokens/step | "
              f"{args.steps} steps | threads/rank {torch.get_num_threads()}")
    out.write(f"transforms: {', '.join(t.name for t in transforms) or 'none (blocking)'}")
    out.write(f"run dir: {args.run_dir}")
    if done == 0:
        out.write(str(state))

    train, val, baseline = batches_for(args, cfg, corpus, rank, world, done)
    saving = None  # the background save in flight (--async-save)

    def save(n: int):
        nonlocal saving
        if saving is not None:
            saving.wait()  # one save at a time; also before the next one rotates the directory
        path = os.path.join(args.checkpoint_dir, f"step-{n:08d}")
        handle = fs.save(path, state, keep_last=args.keep_last, blocking=not args.async_save)
        saving = handle if args.async_save else None

    metrics: dict = {}
    n_run, t_first, t_loop = 0, 0.0, None
    for i in range(done, args.steps):
        batch = next(train)
        if i == done and args.plan:  # what a step will hold and move on this rank, before it runs (no collective)
            out.write(str(step.plan(state, batch)))
        if args.fault_at == i and rank == world - 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)  # as a crashed node would: torchrun restarts the group
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        dt = time.perf_counter() - t0
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} at step {i}")
        n_run += 1
        if i == done:  # the first step builds the native kernels (once per machine) and warms up: timed apart
            t_first, t_loop = dt, time.perf_counter()
            out.write(f"first step (builds native kernels once, then cached): {dt:.1f} s; loss {loss:.4f}")
            out.start_bar(done)  # the bar starts now: its rate and ETA leave this step out
        elapsed = time.perf_counter() - t_loop
        tps = tokens_per_step * (n_run - 1) / elapsed if n_run > 1 and elapsed > 0 else float("nan")
        out.step(i + 1, loss, metrics, dt, tps, float(lr(i) if callable(lr) else lr))
        if args.eval_every and (i + 1) % args.eval_every == 0 and i + 1 < args.steps:
            out.val(i + 1, evaluate(step, state, val))
        if args.log_every and (i + 1) % args.log_every == 0:
            out.summary(i + 1, args.steps, elapsed, n_run - 1)
        if args.save_every and (i + 1) % args.save_every == 0 and i + 1 < args.steps:
            save(i + 1)
    if done < args.steps:
        save(args.steps)
    if saving is not None:
        saving.wait()
    out.close_bar()
    wall = time.perf_counter() - t_loop if t_loop is not None else 0.0
    val_loss = evaluate(step, state, val)
    out.val(args.steps, val_loss)
    step.close()  # ends the offload worker thread; the store stays open until store.close()
    if args.timeline and metrics:  # a collective: every rank passes its metrics of the last step; rank 0 draws
        tl = fs.timeline(metrics, args.timeline, mesh=mesh,
                         title=f"examples/train_gpt.py: GPT {n_params / 1e6:.1f}M params, {world} ranks "
                               f"({mesh.backend}), {' + '.join(t.name for t in transforms) or 'blocking'}, step "
                               f"{args.steps} of {args.steps}")
        out.write(f"timeline of step {args.steps}: {tl.path} ({tl.step_seconds:.3f} s, overlap {tl.overlap:.0%})")

    # a collective: rank 0 gets model.state_dict() of the trained model, unit by unit (the others: empty)
    sd = fs.full_state_dict(state, rank0_only=True) if args.export or (corpus and args.sample_tokens) else {}
    if rank == 0 and args.export:
        torch.save(sd, args.export)
        out.write(f"exported {len(sd)} entries to {args.export}")
    sample = generate_sample(cfg, sd, corpus, args) if rank == 0 and corpus and args.sample_tokens else None
    del sd
    full = fs.full_params(state)  # collective: every rank must call it
    summary = {
        "steps": args.steps, "trained_now": n_run, "skipped_steps": int(state.skipped),
        "first_step_s": t_first, "train_s": wall,
        "tokens_per_s": tokens_per_step * (n_run - 1) / wall if n_run > 1 and wall > 0 else float("nan"),
        "final_loss": float(metrics["loss"]) if metrics else float("nan"),
        "val_loss": val_loss, "unigram_baseline": baseline,
        "param_l2_norm": math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in full.values())),
    }
    out.finish(summary, sample)  # loss.png, sample.txt; the last line: validation loss V (unigram baseline U)
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
