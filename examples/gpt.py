"""A small GPT decoder in plain PyTorch, used by fshard's examples, tests and benchmarks.

Shape with the defaults (``GPTConfig()``): 6 pre-LN blocks, dim 512, 8 heads, vocab 8192, seq 128, an untied
``lm_head`` without bias: 27,369,472 parameters (the figure in /work/shared/ANCHORS.md).

Initialisation is GPT-2's: every Linear/Embedding weight ~ N(0, 0.02), the two residual projections of each block
(``attn.proj`` and ``mlp.proj``) ~ N(0, 0.02 / sqrt(2 * n_layers)), biases zero, LayerNorm weight one and bias zero.

It is written so that a model built on the meta device can be materialised *module by module*:

* the std of every weight is decided at construction time and stored on the module (``module.init_std``), so
  initialising one module needs nothing from its parents;
* every leaf module with parameters has a ``reset_parameters()`` that produces the GPT-2 init of its *own*
  parameters (the torch convention for meta-device init, as FSDP uses it): ``Linear``/``Embedding`` below are thin
  subclasses of ``nn.Linear``/``nn.Embedding`` whose ``reset_parameters`` is GPT-2's, LayerNorm's stock one is
  already right, and the container modules (``GPT``, ``Block``, ...) own no parameters directly;
* :func:`init_weights` (also ``GPT.init_weights``) does the same for one module and is usable as
  ``fs.init(..., init_fn=init_weights)`` or ``model.apply(init_weights)``. It only touches the module's direct
  parameters (``recurse=False``), so calling it on every module initialises each parameter exactly once.

Built on a real device the model is initialised eagerly by the constructors, so ``torch.manual_seed(s); GPT(cfg)``
is reproducible.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "Linear",
    "Embedding",
    "init_weights",
    "loss_fn",
    "synthetic_batches",
]

BASE_STD = 0.02


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    dim: int = 512
    n_layers: int = 6
    n_heads: int = 8
    seq: int = 128
    tie_weights: bool = False

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")

    @classmethod
    def tiny(cls, **overrides) -> "GPTConfig":
        """A preset for fast tests: 97-token vocab, dim 32, 2 layers, 2 heads, seq 16."""
        kw = dict(vocab=97, dim=32, n_layers=2, n_heads=2, seq=16)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def small(cls, **overrides) -> "GPTConfig":
        """The preset `make train` uses on text: vocab 4096, dim 128, 4 layers, 4 heads, seq 128."""
        kw = dict(vocab=4096, dim=128, n_layers=4, n_heads=4, seq=128)
        kw.update(overrides)
        return cls(**kw)

    @property
    def residual_std(self) -> float:
        return BASE_STD / math.sqrt(2 * self.n_layers)


# ---------------------------------------------------------------------------------------------------------------
# Leaf modules whose reset_parameters() is the GPT-2 init of their own parameters.


class Linear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters`` is weight ~ N(0, init_std), bias = 0."""

    def __init__(self, in_features, out_features, bias=True, *, init_std=BASE_STD, device=None, dtype=None):
        self.init_std = float(init_std)  # set before super().__init__, which calls reset_parameters()
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        init_weights(self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init_std={self.init_std:.6g}"


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose ``reset_parameters`` is weight ~ N(0, init_std)."""

    def __init__(self, num_embeddings, embedding_dim, *, init_std=BASE_STD, device=None, dtype=None):
        self.init_std = float(init_std)
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        init_weights(self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init_std={self.init_std:.6g}"


@torch.no_grad()
def init_weights(module: nn.Module) -> None:
    """GPT-2 init of ``module``'s *direct* parameters; usable as ``init_fn`` or with ``model.apply``.

    Linear/Embedding weights ~ N(0, module.init_std) (0.02 unless set, 0.02/sqrt(2*n_layers) for residual
    projections), biases zero, LayerNorm weight one / bias zero. Modules of other types are left alone; container
    modules of this file own no parameters. Works on any device except meta (which holds no values).
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        std = getattr(module, "init_std", BASE_STD)
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# ---------------------------------------------------------------------------------------------------------------
# The model.


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = Linear(cfg.dim, 3 * cfg.dim, device=device)
        self.proj = Linear(cfg.dim, cfg.dim, init_std=cfg.residual_std, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.fc = Linear(cfg.dim, 4 * cfg.dim, device=device)
        self.proj = Linear(4 * cfg.dim, cfg.dim, init_std=cfg.residual_std, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim, device=device)
        self.attn = CausalSelfAttention(cfg, device=device)
        self.ln2 = nn.LayerNorm(cfg.dim, device=device)
        self.mlp = MLP(cfg, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embedding (both in the root), ``blocks``, final LayerNorm, ``lm_head``."""

    init_weights = staticmethod(init_weights)

    def __init__(self, cfg: GPTConfig | None = None, device=None):
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.tok_emb = Embedding(cfg.vocab, cfg.dim, device=device)
        self.pos_emb = Embedding(cfg.seq, cfg.dim, device=device)
        self.blocks = nn.ModuleList([Block(cfg, device=device) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.dim, device=device)
        self.lm_head = Linear(cfg.dim, cfg.vocab, bias=False, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``tok_emb.weight`` when ``cfg.tie_weights`` (no-op otherwise).

        Call it again after ``model.to_empty(...)``: torch replaces each module's parameters separately there, which
        silently unties shared weights.
        """
        if self.cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: [B, T] token ids (T <= cfg.seq) -> logits [B, T, vocab]."""
        T = idx.shape[1]
        if T > self.cfg.seq:
            raise ValueError(f"sequence length {T} exceeds cfg.seq={self.cfg.seq}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        """Distinct parameters (a tied weight counts once), as ``model.named_parameters()`` lists them."""
        return sum(p.numel() for p in self.parameters())


def loss_fn(module: nn.Module, batch) -> torch.Tensor:
    """Mean next-token cross-entropy. batch = (idx, targets), long tensors [B, T]."""
    idx, targets = batch
    logits = module(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------------------------
# Deterministic synthetic data.


def synthetic_batches(
    cfg: GPTConfig,
    batch_size: int,
    n_steps: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``n_steps`` per-rank batches ``(idx, targets)``, long tensors [batch_size, cfg.seq] on the CPU.

    Step ``s`` draws one *global* batch of ``batch_size * world_size`` rows from a generator seeded by
    ``(seed, s)`` and hands rank ``r`` rows ``[r * batch_size, (r + 1) * batch_size)``. So concatenating the
    ranks' batches in rank order gives exactly the batch that world size 1 with ``batch_size * world_size`` gets,
    which is what DDP-equivalence tests need. ``targets`` is ``idx`` shifted left by one.

    The sequences are learnable: each token follows its predecessor by a fixed affine map mod ``vocab``, except
    that about one token in eight is replaced by a uniformly random one, so the loss falls well below ln(vocab).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    V, T = cfg.vocab, cfg.seq
    rows = batch_size * world_size
    lo, hi = rank * batch_size, (rank + 1) * batch_size
    for step in range(n_steps):
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + step)
        start = torch.randint(0, V, (rows, 1), generator=g)
        noise = torch.randint(0, V, (rows, T + 1), generator=g)
        keep = torch.rand((rows, T + 1), generator=g) >= 0.125
        seq = torch.empty((rows, T + 1), dtype=torch.long)
        seq[:, 0] = start[:, 0]
        for t in range(1, T + 1):
            nxt = (seq[:, t - 1] * 5 + 3) % V
            seq[:, t] = torch.where(keep[:, t], nxt, noise[:, t])
        seq = seq[lo:hi]
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


if __name__ == "__main__":  # quick self-check: python examples/gpt.py
    m = GPT()
    print(f"GPT default: {m.num_params():,} params")
    assert m.num_params() == 27_369_472, m.num_params()
