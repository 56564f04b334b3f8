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
