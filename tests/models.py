"""Test models with everything that breaks naive sharding."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, PRIME = 13, 8, 37


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.ln(torch.tanh(self.lin(x)))


class Awkward(nn.Module):
    """Tied embedding/head, a frozen param, an unused param, an unused unit, a buffer, a 0-dim param, a param of
    prime size, and a unit (blocks.0) applied twice; sizes do not divide by 2, 3 or 4."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(3)])  # blocks.2 is never called
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.up = nn.Linear(DIM, PRIME, bias=False)
        self.prime = nn.Parameter(torch.randn(PRIME) * 0.1)
        self.down = nn.Linear(PRIME, DIM)
        self.frozen = nn.Parameter(torch.randn(DIM), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(5))
        self.register_buffer("shift", torch.linspace(-1, 1, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x) + self.shift + self.frozen
        h = self.blocks[0](h)
        h = self.blocks[1](h)
        h = self.blocks[0](h)
        h = h + self.down(F.relu(self.up(h) + self.prime)) * self.scale
        return self.head(h)


def awkward_loss(module, batch):
    x, y = batch
    return F.cross_entropy(module(x).flatten(0, 1), y.flatten())


def awkward_batches(batch_size: int, n_steps: int, rank: int = 0, world_size: int = 1, seq: int = 6):
    """Per-rank slices of a deterministic global batch (rank r gets rows r*b:(r+1)*b)."""
    for s in range(n_steps):
        g = torch.Generator().manual_seed(1000 + s)
        x = torch.randint(0, VOCAB, (batch_size * world_size, seq), generator=g)
        y = torch.randint(0, VOCAB, (batch_size * world_size, seq), generator=g)
        lo = rank * batch_size
        yield x[lo:lo + batch_size], y[lo:lo + batch_size]


def oracle_model(name: str, steps: int, seed: int = 3):
    """``(model, loss_fn, batches(rank, world_size))`` of a model the oracle tests train: "gpt" (the tiny example
    GPT) or "awkward" (above); the same weights at every call."""
    torch.manual_seed(0)
    if name == "gpt":
        from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
        cfg = GPTConfig.tiny()
        return GPT(cfg), loss_fn, lambda r, n: synthetic_batches(cfg, 2, steps, seed=seed, rank=r, world_size=n)
    return Awkward(), awkward_loss, lambda r, n: awkward_batches(2, steps, rank=r, world_size=n)


def param_diffs(full: dict, ref: nn.Module | dict) -> tuple[dict, bool]:
    """Largest |fshard - reference| per parameter (an attention qkv bias's key third apart, as ``name[key]``: its
    gradient is exactly zero, so it holds rounding noise; see test_ddp_equivalence.py), and whether all are equal."""
    diffs = {}
    named = ref.items() if isinstance(ref, dict) else ref.named_parameters()
    for n, p in named:
        d = (full[n] - p.detach()).abs()
        if n.endswith("attn.qkv.bias"):
            dim = d.numel() // 3
            diffs[n + "[key]"] = d[dim:2 * dim].max().item()
            d = torch.cat([d[:dim], d[2 * dim:]])
        diffs[n] = d.max().item() if d.numel() else 0.0
    named = ref.items() if isinstance(ref, dict) else ref.named_parameters()
    return diffs, all(torch.equal(full[n], p.detach()) for n, p in named)


KEY_BIAS_BOUND = 1e-4  # what a key bias may differ by at world size 3 (test_ddp_equivalence.py says why)


def check_oracle(label: str, world_size: int, impl: str, ours, theirs, diffs: dict, bitwise: bool) -> None:
    """fshard against its oracle: losses and parameters within 1e-6 (key biases: KEY_BIAS_BOUND), and bitwise with
    impl="torch" at world sizes 1 and 2. (Not for "fused": torch's fused CPU kernel rounds an element differently in
    its scalar tail than in its vector body, about 1 run in 130 of a 37-element tensor, measured, so a result depends
    on where a shard's segment starts; a 2-rank sum is order-independent, a 3-rank one is not.)"""
    for s, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), f"{label} step {s}: loss {a} vs the oracle's {b}"
    for n, d in diffs.items():
        bound = KEY_BIAS_BOUND if n.endswith("[key]") else 1e-6
        assert d <= bound, f"{label} at world size {world_size}: {n} differs by {d:.3g} > {bound}"
    if world_size in (1, 2) and impl == "torch":
        assert bitwise, f"{label} at world size {world_size} is within 1e-6 but not bitwise"


def oracle_step(model: nn.Module, opt, loss_fn, batch, world_size: int, scaler=None,
                max_norm: float | None = None) -> float:
    """One step of the torch oracle (DDP or FSDP2 and a torch optimizer): the mean loss over ranks, averaged in
    float64 as fshard averages its ranks' losses. ``scaler``: a ``torch.amp.GradScaler`` (scale, unscale_, step,
    update, in the order its documentation gives); ``max_norm``: ``clip_grad_norm_`` after unscaling."""
    import torch.distributed as dist
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None:
        scaler.unscale_(opt)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    mean = loss.detach().double()
    if world_size > 1:
        dist.all_reduce(mean)
    return mean.item() / world_size


HF_MODELS = ("gpt2", "llama", "bert", "t5")  # tests/test_hf_*.py
MOE_MODELS = ("switch", "mixtral")  # tests/test_routed.py
# the transformers modules hf_model builds from (tests/_dist.py's forkserver imports them ahead of the ranks)
HF_MODULES = ["transformers", "transformers.modeling_utils"] + [
    f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "bert", "t5", "switch_transformers", "mixtral")]
HF_VOCAB = 128


def hf_model(name: str):
    """A tiny Hugging Face transformers model from a config (random weights, nothing from the Hub), built on the
    current default device (``with torch.device("meta"): hf_model(...)`` builds it on meta) and initialised by HF
    there: 2 layers, hidden 32, vocab 128, dropout off (a step is then deterministic), the LM head tied."""
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when transformers is first imported
    import transformers as T
    T.logging.set_verbosity_error()
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "gpt2":
        cfg = T.GPT2Config(vocab_size=HF_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, **ids)
        return T.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = T.LlamaConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                            tie_word_embeddings=True, **ids)
        return T.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = T.BertConfig(vocab_size=HF_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, pad_token_id=0)
        return T.BertForMaskedLM(cfg)
    if name == "t5":
        cfg = T.T5Config(vocab_size=HF_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         dropout_rate=0.0, decoder_start_token_id=0, **ids)
        return T.T5ForConditionalGeneration(cfg)
    if name == "switch":  # four experts per sparse MLP, top-1 routing with room for every token
        cfg = T.SwitchTransformersConfig(vocab_size=HF_VOCAB, d_model=32, d_kv=8, d_ff=64, expert_capacity=64,
                                         num_layers=2, num_sparse_encoder_layers=2, num_decoder_layers=2,
                                         num_sparse_decoder_layers=2, num_heads=2, num_experts=4, dropout_rate=0.0,
                                         router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0,
                                         eos_token_id=2)
        return T.SwitchTransformersForConditionalGeneration(cfg)
    if name == "mixtral":  # transformers 5 keeps a layer's experts in one module of 3-D parameters
        cfg = T.MixtralConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=1,
                              max_position_embeddings=32, router_jitter_noise=0.0, tie_word_embeddings=True, **ids)
        return T.MixtralForCausalLM(cfg)
    raise ValueError(f"hf_model: unknown model {name!r}; one of {HF_MODELS + MOE_MODELS}")


def moe_units(name: str, model) -> dict:
    """fs.init's arguments for experts as units: Switch's experts containers routed (one unit per expert);
    Mixtral's layers and, inside each, its experts module (one module of 3-D parameters in transformers 5)."""
    if name == "switch":
        return dict(routed=[n for n, _ in model.named_modules() if n.endswith("mlp.experts")])
    return dict(units=[n for n, _ in model.named_modules() if n.endswith("mlp.experts") or
                       (n.startswith("model.layers.") and n.count(".") == 2)])


def enable_checkpointing(model, kwargs=None) -> None:
    """transformers' per-layer activation checkpointing: ``activation_checkpointing_enable`` from 5.2x on (the
    bootstrap's 5.23.0), ``gradient_checkpointing_enable`` before (5.17 on the GPU machine), deprecated since."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable() if kwargs is None else enable(kwargs)
