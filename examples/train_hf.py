"""Pre-train (or fine-tune) a Hugging Face causal LM from a transformers config with fshard, then generate.

    python examples/train_hf.py --model llama --steps 30                                     # world size 1
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --model gpt2 --steps 30 \\
        --checkpointing --nvme-dir "$(mktemp -d)"                                            # 2 ranks, gloo on CPU

--model is a transformers model type (gpt2, llama, mistral, qwen2, ...) built from its config with tiny sizes, or a
local directory holding a config.json (--pretrained also loads its weights). Nothing is downloaded. The data
(--data): counting sequences modulo the vocabulary, synthetic and learnable, each rank its own rows of one global
batch; or stdlib, the Python standard library's source under examples/data.py's BPE (the corpus of
examples/train_gpt.py), each rank its slice through a DistributedSampler, ending with the validation loss and its
unigram baseline:

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --model llama --data stdlib --steps 200 \
        --seq-len 64 --batch-size 8
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers as T  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (_HERE, os.path.dirname(_HERE)) if p not in sys.path]
import fshard as fs  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, n_embd=64, n_layer=2, n_head=4, n_positions=64)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama", help="a transformers model type, or a directory with config.json")
    p.add_argument("--pretrained", action="store_true", help="load the weights of the --model directory")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4, help="rows per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every layer")
    p.add_argument("--nvme-dir", default=None, help="keep the AdamW moments in an NVMe store in this directory")
    p.add_argument("--depth", type=int, default=2, help="gather_ahead depth (0: blocking gathers)")
    p.add_argument("--bucket-mb", type=float, default=25, help="bucket_reduce bucket size (0: blocking reduce)")
    p.add_argument("--clip", type=float, default=1.0, help="clip_by_global_norm max norm (0: none)")
    p.add_argument("--save", default=None, help="save_pretrained the trained model here (rank 0)")
    p.add_argument("--seed", type=int, default=0, help="initial weights (the same on every rank: fs.init checks it)")
    p.add_argument("--data", choices=("counting", "stdlib"), default="counting",
                   help="counting: synthetic sequences; stdlib: the standard library's source (examples/data.py)")
    p.add_argument("--vocab", type=int, default=4096, help="--data stdlib: the BPE's vocabulary size")
    p.add_argument("--cache-dir", default=os.path.join(os.path.dirname(_HERE), "runs", "cache"),
                   help="--data stdlib: the trained tokenizer and tokens")
    return p.parse_args(argv)


def corpus_for(args, mesh):
    """examples/data.py's corpus for --data stdlib (rank 0 builds the cache, the others wait), else None."""
    if args.data != "stdlib":
        return None
    import data

    import torch.distributed as dist
    return data.prepare(args.cache_dir, args.vocab, mesh.rank, dist.barrier if dist.is_initialized() else None)


def config(args, corpus=None) -> T.PretrainedConfig:
    if os.path.isdir(args.model):
        return T.AutoConfig.from_pretrained(args.model)
    keys = T.AutoConfig.for_model(args.model).to_dict()
    sizes = {**TINY, **({"vocab_size": corpus.vocab} if corpus is not None else {})}
    return T.AutoConfig.for_model(args.model, **{k: v for k, v in sizes.items() if k in keys})


def batches(cfg, args, rank: int, world_size: int, corpus=None):
    """Each rank's rows: of a deterministic global batch of counting sequences modulo the vocabulary, or with a
    corpus, its DistributedSampler's slice of the training windows (the model shifts the labels itself)."""
    if corpus is not None:
        import itertools

        import data
        dl = data.loader(data.Windows(corpus.train, args.seq_len), args.batch_size, rank, world_size, shuffle=True,
                         seed=args.seed)
        yield from (x for x, _ in itertools.islice(data.train_batches(dl), args.steps))
        return
    g = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        start = torch.randint(0, cfg.vocab_size, (args.batch_size * world_size, 1), generator=g)
        rows = (start + torch.arange(args.seq_len)) % cfg.vocab_size
        yield rows[rank * args.batch_size:(rank + 1) * args.batch_size]


def transforms(args, store):
    out = [fs.gather_ahead(args.depth), fs.bucket_reduce(args.bucket_mb) if args.bucket_mb else None,
           fs.clip_by_global_norm(args.clip) if args.clip else None,
           fs.mixed_precision() if args.precision == "bf16" else None, fs.offload_state(store) if store else None]
    return [t for t in out if t is not None]


def loss_fn(model, batch):
    return model(input_ids=batch, labels=batch).loss


def train(args, mesh, store=None, corpus=None):
    """Model to loop; returns (state, losses, config)."""
    cfg = config(args, corpus)
    with torch.device("meta"):  # built on meta: fs.init materialises one unit at a time, with HF's own init
        model = T.AutoModelForCausalLM.from_config(cfg)
    if args.pretrained:
        model = T.AutoModelForCausalLM.from_pretrained(args.model)
    if args.checkpointing:  # the name from transformers 5.2x on; gradient_checkpointing_enable before
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    state = fs.init(model, mesh, fs.adamw(lr=args.lr, weight_decay=0.1), init_fn=model._init_weights,
                    seed=args.seed)
    losses = []
    with fs.compose(loss_fn, *transforms(args, store)) as step:
        for batch in batches(cfg, args, mesh.rank, mesh.world_size, corpus):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
            if mesh.rank == 0 and (len(losses) % 10 == 0 or len(losses) == 1):
                print(f"step {len(losses):4d}  loss {metrics['loss']:.4f}  {metrics['time/step'] * 1e3:.0f} ms",
                      flush=True)
    return state, losses, cfg


def hand_off(state, cfg):
    """The trained weights in a fresh transformers model (a collective: every rank calls it)."""
    sd = fs.full_state_dict(state)
    model = T.AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(sd)  # strict; the constructor made the ties and the non-persistent buffers
    return model.eval()


@torch.no_grad()
def report_text(model, corpus, args, windows: int = 64) -> None:
    """A sample from the trained model, then the validation loss on the first held-out windows against the
    unigram baseline of the tokens it is measured on (the last line)."""
    import data

    prompt = torch.tensor([corpus.tok.encode("def ").ids])
    out = model.generate(prompt, max_new_tokens=40, do_sample=True, top_k=10, pad_token_id=0)
    print("sample:", repr(corpus.tok.decode(out[0].tolist())))
    val = data.Windows(corpus.val, args.seq_len)
    xs = torch.stack([val[i][0] for i in range(min(windows, len(val)))])
    loss = float(model(input_ids=xs, labels=xs).loss)
    print(f"validation loss {loss:.3f} (unigram baseline {data.unigram_entropy(xs[:, 1:], corpus.vocab):.3f})")


def main(argv=None) -> None:
    args = parse_args(argv)
    mesh = fs.Mesh.from_env()
    store = fs.NVMeStore(os.path.join(args.nvme_dir, f"r{mesh.rank}")) if args.nvme_dir else None
    corpus = corpus_for(args, mesh)
    state, losses, cfg = train(args, mesh, store, corpus)
    model = hand_off(state, cfg)
    if mesh.rank == 0 and corpus is not None:
        report_text(model, corpus, args)
    elif mesh.rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
        prompt = torch.arange(5, 10).unsqueeze(0)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        print("prompt", prompt[0].tolist(), "-> generated", out[0, prompt.shape[1]:].tolist())
        if args.save:
            model.save_pretrained(args.save)
    del state
    if store is not None:
        store.close()


if __name__ == "__main__":
    main()
