"""An optimizer of your own on fshard's protocol, with public names only: Signum (signSGD with momentum, Bernstein
et al. 2018), ``p <- p * (1 - lr * wd) - lr * sign(m)`` with ``m <- momentum * m + (1 - momentum) * g``.

``fs.optim.Elementwise`` does the plan, the update over runs of the flat shards, the learning-rate schedule, the
weight-decay mask, the checkpoint's param groups and the ranks' check; an elementwise optimizer declares its
per-parameter ``rows`` (here one, saved in a checkpoint as ``momentum_buffer``) and writes ``update_run``, one step
in place on one run of a shard (a parameter, part of one, or neighbours), and ``group_fields``.
Run: python examples/custom_optimizer.py, or torchrun --standalone --nproc-per-node 2 examples/custom_optimizer.py"""
import dataclasses
from collections.abc import Callable

import torch

import fshard as fs


@dataclasses.dataclass(frozen=True)
class Signum(fs.optim.Elementwise):
    lr: float | Callable[[int], float] = 1e-3  # a float or a schedule (fs.schedules)
    momentum: float = 0.9
    weight_decay: float = 0.0
    weight_decay_mask: Callable | None = None  # mask(name, param) -> bool: the parameters that decay
    decay: frozenset | None = dataclasses.field(default=None, repr=False)  # (fs.init evaluates the mask into it)
    label = "Signum"  # its name in error messages
    count_key = None  # no per-parameter step count in a checkpoint (Signum reads none)

    @property
    def rows(self):
        return (fs.optim.Row("momentum_buffer"),)

    def group_fields(self):  # a checkpoint's param_groups (lr and params are added)
        return {"momentum": self.momentum, "weight_decay": None}

    def update_run(self, p, g, rows, step, lr, wd):
        (m,) = rows
        m.mul_(self.momentum).add_(g, alpha=1 - self.momentum)
        p.mul_(1 - lr * wd).add_(torch.sign(m), alpha=-lr)


def train(steps: int = 8):
    """A small MLP trained with Signum; returns the losses and the full parameters."""
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state = fs.init(model, mesh, Signum(lr=5e-2, weight_decay=0.1, weight_decay_mask=lambda name, p: p.ndim >= 2))

    def loss_fn(module, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(module(x), y)

    losses = []
    with fs.compose(loss_fn) as step:
        for s in range(steps):
            g = torch.Generator().manual_seed(s)
            x = torch.randn(4 * mesh.world_size, 8, generator=g)
            batch = x[4 * mesh.rank:4 * (mesh.rank + 1)], x[4 * mesh.rank:4 * (mesh.rank + 1)].sum(1, keepdim=True)
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
    return losses, fs.full_params(state)


if __name__ == "__main__":
    losses, _ = train()
    print([round(x, 4) for x in losses])
