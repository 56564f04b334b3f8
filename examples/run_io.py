"""What examples/train_gpt.py reads and writes around its loop: the batches (examples/data.py or synthetic), the
validation loss, the console (one tqdm bar on a terminal, summary lines through ``tqdm.write`` so they never run
into it; no bar when stdout is not a terminal), ``metrics.jsonl``, TensorBoard, the loss curve and a text sample.

Only rank 0 writes; every rank runs the same collectives (``evaluate`` calls ``step.eval``).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import Subset

import data as corpus_data
from gpt import GPT, synthetic_batches

SAMPLE_PROMPT = "def "
TOP_K = 10


def prepare_data(args, rank: int, out) -> tuple:
    """(corpus, vocab): the tokenized stdlib corpus (rank 0 builds the cache, the others wait), or (None, None)
    for ``--data synthetic``."""
    if args.data == "synthetic":
        out.write("data: synthetic affine sequences (gpt.synthetic_batches), not text")
        return None, None
    t0 = time.perf_counter()
    barrier = dist.barrier if dist.is_available() and dist.is_initialized() else None
    corpus = corpus_data.prepare(args.cache_dir, args.vocab, rank, barrier,
                                 max_train_bytes=int(args.max_train_mb * 1e6))
    out.write(corpus.describe())
    out.write(f"tokenizer and tokens ready in {time.perf_counter() - t0:.1f} s (cached in {args.cache_dir})")
    return corpus, corpus.vocab


def batches_for(args, cfg, corpus, rank: int, world: int, done: int):
    """(training batches from step ``done`` on, the validation batches of this rank, the unigram baseline of every
    rank's validation targets together)."""
    if corpus is None:
        train = itertools.islice(synthetic_batches(cfg, args.batch_size, args.steps, args.seed, rank, world), done,
                                 None)
        val = list(synthetic_batches(cfg, args.batch_size, 4, args.seed + 1000, rank, world))
        glob = torch.cat([y for _, y in synthetic_batches(cfg, args.batch_size * world, 4, args.seed + 1000)])
        return train, val, corpus_data.unigram_entropy(glob, cfg.vocab)
    dl = corpus_data.loader(corpus_data.Windows(corpus.train, cfg.seq), args.batch_size, rank, world, shuffle=True,
                            seed=args.seed)
    val_ds = corpus_data.Windows(corpus.val, cfg.seq)
    n = len(val_ds) if not args.eval_batches else min(len(val_ds), args.eval_batches * args.batch_size * world)
    n -= n % world  # every rank the same number of windows (the sampler would pad with repeats otherwise)
    val_ds = Subset(val_ds, range(n))
    val = list(corpus_data.loader(val_ds, args.batch_size, rank, world, shuffle=False))
    targets = torch.cat([val_ds[i][1] for i in range(n)])  # what the loss is measured on, all ranks' windows
    return corpus_data.train_batches(dl, done), val, corpus_data.unigram_entropy(targets, cfg.vocab)


def evaluate(step, state, val) -> float:
    """Mean validation loss per token over every rank's batches (``step.eval`` averages a batch over ranks)."""
    total = rows = 0
    for x, y in val:
        loss, _ = step.eval(state, (x, y))
        total, rows = total + float(loss) * x.shape[0], rows + x.shape[0]
    return total / rows


@torch.no_grad()
def generate_sample(cfg, sd: dict, corpus, args) -> str:
    """Text from the trained weights (``fs.full_state_dict`` on rank 0) in a plain ``GPT``: top-k sampling."""
    model = GPT(cfg)
    model.load_state_dict(sd)
    model.eval()
    idx = torch.tensor([corpus.tok.encode(SAMPLE_PROMPT).ids])
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.sample_tokens):
        logits = model(idx[:, -cfg.seq:])[0, -1].float()
        top = torch.topk(logits, TOP_K)
        nxt = top.indices[torch.multinomial(torch.softmax(top.values / 0.8, -1), 1, generator=g)]
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return corpus.tok.decode(idx[0].tolist())


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class RunLog:
    """Rank 0's outputs of a run; on the other ranks every method does nothing."""

    def __init__(self, args, rank: int):
        self.args, self.on, self.bar, self.tb, self.jsonl = args, rank == 0, None, None, None
        self.losses: list[float] = []
        self.last_val = None
        if self.on:
            os.makedirs(args.run_dir, exist_ok=True)
            self.jsonl = open(os.path.join(args.run_dir, "metrics.jsonl"), "a", buffering=1)

    def write(self, line: str) -> None:
        if self.on:
            from tqdm.auto import tqdm

            tqdm.write(line, file=sys.stdout)  # above the bar, never into it
            sys.stdout.flush()

    def check_config(self, cfg) -> None:
        """Refuse a run directory whose checkpoints are of another model (every rank raises the same way)."""
        import fshard as fs

        path = os.path.join(self.args.run_dir, "config.json")
        mine = {"model": dataclasses.asdict(cfg), "data": self.args.data}
        have = None
        if os.path.exists(path):
            with open(path) as fh:
                have = json.load(fh)
        ckpt = self.args.checkpoint_dir
        if have is not None and have != mine and os.path.isdir(ckpt) and fs.latest(ckpt) is not None:
            raise SystemExit(f"{self.args.run_dir} holds checkpoints of another run ({have}), not of this one "
                             f"({mine}): pass --run-dir DIR for a new run, or delete {self.args.run_dir} to start "
                             "this one there afresh.")
        if self.on and have != mine:
            with open(path + ".tmp", "w") as fh:
                json.dump(mine, fh)
            os.replace(path + ".tmp", path)

    def start_bar(self, initial: int) -> None:
        """The bar starts after the first step (at ``initial`` steps done), so its rate and ETA leave the kernel
        build out; the first step's own update then moves it to ``initial + 1``."""
        if self.on and sys.stdout.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.args.steps, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stdout, smoothing=0.05)

    def _tb(self):
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(self.args.run_dir, "tb"))
        return self.tb

    def step(self, n: int, loss: float, metrics: dict, dt: float, tps: float, lr: float) -> None:
        if not self.on:
            return
        self.losses.append(loss)
        rec = {"step": n, "loss": loss, "lr": lr, "step_s": dt, "tokens_per_s": tps}
        if "grad_norm" in metrics:
            rec["grad_norm"] = float(metrics["grad_norm"])
        self.jsonl.write(json.dumps(rec) + "\n")
        tb = self._tb()
        for k, v in rec.items():
            if k != "step" and v == v:  # NaN (no rate yet) is left out
                tb.add_scalar(f"train/{k}", v, n)
        if self.bar is not None:
            post = {"loss": f"{loss:.3f}"} | ({"tok_s": f"{tps:,.0f}"} if tps == tps else {})  # (none on step 1)
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def val(self, n: int, loss: float) -> None:
        if self.on:
            self.last_val = loss
            self.jsonl.write(json.dumps({"step": n, "val_loss": loss}) + "\n")
            self._tb().add_scalar("val/loss", loss, n)
            self.write(f"step {n:5d}  validation loss {loss:.4f}")

    def summary(self, n: int, total: int, elapsed: float, timed: int) -> None:
        """A line every --log-every steps: what a log file (no bar) shows of the run."""
        if not self.on:
            return
        recent = self.losses[-self.args.log_every:]
        rate = elapsed / timed if timed else float("nan")
        eta = _clock((total - n) * rate) if timed else "?"
        self.write(f"step {n:5d}/{total}  loss {sum(recent) / len(recent):.4f} (mean of last {len(recent)})  "
                   f"{rate:.2f} s/step  elapsed {_clock(elapsed)}  ETA {eta}")

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, summary: dict, sample: str | None) -> None:
        if not self.on:
            return
        d = self.args.run_dir
        png = plot_losses(os.path.join(d, "metrics.jsonl"), os.path.join(d, "loss.png"), summary["unigram_baseline"])
        if summary["trained_now"] > 1:
            self.write(f"trained {summary['trained_now']} steps: the first in {summary['first_step_s']:.1f} s, the "
                       f"other {summary['trained_now'] - 1} in {_clock(summary['train_s'])} "
                       f"({summary['tokens_per_s']:,.0f} tokens/s, validation and checkpoints included)")
        elif summary["trained_now"] == 0:
            self.write(f"nothing to train: {d} is at step {summary['steps']} already (--steps N to go on, or "
                       f"delete {d} to start afresh)")
        if sample is not None:
            with open(os.path.join(d, "sample.txt"), "w") as fh:
                fh.write(sample)
            self.write(f"sample (top-{TOP_K}, from {SAMPLE_PROMPT!r}):\n" + "\n".join(
                "  | " + line for line in sample.splitlines()))
        self.write(f"wrote {d}: ckpt/, metrics.jsonl, tb/ (tensorboard --logdir {os.path.join(d, 'tb')})"
                   + (", loss.png" if png else "") + (", sample.txt" if sample is not None else ""))
        if self.tb is not None:
            self.tb.close()
        self.jsonl.close()
        self.write(f"validation loss {summary['val_loss']:.3f} (unigram baseline {summary['unigram_baseline']:.3f})")


def plot_losses(jsonl: str, png: str, baseline: float | None = None) -> bool:
    """Training loss (each step and a running mean) and validation loss from ``metrics.jsonl`` (a resumed run's
    records appended; a step logged twice, before and after a restart, counts once: the later record)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = {}, {}
    with open(jsonl) as fh:
        for line in fh:
            rec = json.loads(line)
            (val if "val_loss" in rec else train)[rec["step"]] = rec.get("val_loss", rec.get("loss"))
    if not train:
        return False
    steps = sorted(train)
    ys = [train[s] for s in steps]
    k = max(1, len(ys) // 20)
    mean = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, ys, color="tab:blue", alpha=0.25, lw=0.8, label="train loss (per step)")
    ax.plot(steps, mean, color="tab:blue", lw=1.6, label=f"train loss (mean of {k} steps)")
    if val:
        vs = sorted(val)
        ax.plot(vs, [val[s] for s in vs], "o-", color="tab:orange", lw=1.6, label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"unigram baseline {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("examples/train_gpt.py")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
