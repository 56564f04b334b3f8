"""A user-written transform, with public names only: per-unit gradient norms as metrics.

    python examples/custom_transform.py
    torchrun --standalone --nproc-per-node 2 examples/custom_transform.py

A transform is an ``fs.Transform`` that returns, for each stage it changes, a policy following that stage's
protocol, and declares how in ``stages``. This one wraps the grads stage (``stages = {"grads": "wrap"}``): its
``fs.protocol.GradsPolicy`` calls the policy it was given, then reads the value it returned, an ``fs.protocol.Grads``
whose ``shards`` map each unit that got a gradient to this rank's 1/N slice of the reduced gradient. The slices tile the
unit, so a unit's global squared norm is the sum over ranks of the squares of its slices: one
``fs.protocol.Collectives.all_reduce`` of a float64 vector with one entry per unit gives every norm on every rank; times
``grads.scale``, since the update applies ``shards * scale`` (fp16 loss scaling starts it at 1/scale). ``Grads`` is
frozen; ``with_metrics`` returns a copy whose metrics the step adds to its own.

The policy only reads the gradients, so it says ``changes_grads = False``: composed without clip or skip, the grads
stage still counts as unchanged and ``fs.offload_state`` may begin updates during backward.
"""
from __future__ import annotations

import math

import torch

import fshard as fs


class _UnitGradNorms(fs.protocol.GradsPolicy):
    changes_grads = False  # reads the shards, adds metrics; scale, skip and values are left as they are

    def __init__(self, inner: fs.protocol.GradsPolicy):
        self.inner = inner

    def __call__(self, comm: fs.protocol.Collectives, grads: fs.protocol.Grads) -> fs.protocol.Grads:
        # Read the shards before the policies this one wraps change what the update does with them (a clip before
        # this transform scales them): the norms are those of the gradients backward produced. Every rank must
        # issue the same collective with the same size. It does: before the grads stage runs, the step checks that
        # all ranks issued the same reductions (RankDivergenceError otherwise), so the units in grads.shards, the
        # ones that got a reduced gradient, are the same on every rank; sorting fixes the order.
        names = sorted(grads.shards)
        norms = {}
        if names:
            sq = torch.stack([torch.linalg.vector_norm(grads.shards[n], dtype=torch.float64) ** 2 for n in names])
            comm.all_reduce(sq, "unit_grad_norms")  # in place: sum over ranks
            # the update applies shards * grads.scale: here 1/loss_scale with fp16 loss scaling, else 1
            norms = {f"grad_norm/{n}": math.sqrt(v) * abs(grads.scale) for n, v in zip(names, sq.tolist())}
        return self.inner(comm, grads).with_metrics(**norms)

    def close(self) -> None:
        self.inner.close()


class unit_grad_norms(fs.Transform):
    """Report each unit's global gradient L2 norm (before any clipping) as ``metrics["grad_norm/<unit>"]``. A unit
    no gradient reached has no entry with the blocking reduce, and 0.0 with ``fs.bucket_reduce`` (which hands every
    unit a shard, zeros for those that got none)."""

    name = "unit_grad_norms"
    stages = {"grads": "wrap"}

    def wrap_grads(self, grads: fs.protocol.GradsPolicy) -> fs.protocol.GradsPolicy:
        return _UnitGradNorms(grads)

    def __repr__(self) -> str:
        return "unit_grad_norms()"


if __name__ == "__main__":
    import os

    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    mesh = fs.Mesh.from_env()
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=3e-3))
    transforms = (fs.gather_ahead(2), fs.bucket_reduce(1), fs.clip_by_global_norm(1.0), unit_grad_norms())
    with fs.compose(loss_fn, *transforms) as step:
        for i, batch in enumerate(synthetic_batches(cfg, 4, 5, rank=mesh.rank, world_size=mesh.world_size)):
            state, m = step(state, batch)
            units = {k.removeprefix("grad_norm/"): v for k, v in m.items() if k.startswith("grad_norm/")}
            if mesh.rank == 0:  # the units' norms add up (in squares) to clip's global norm
                print(f"step {i}  world {mesh.world_size}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.4f} "
                      f"(hypot of units {math.hypot(*units.values()):.4f})")
                print("    " + "  ".join(f"{u} {v:.4f}" for u, v in units.items()))
    if mesh.world_size > 1:
        import torch.distributed as dist
        dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
        dist.destroy_process_group()
