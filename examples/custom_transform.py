"""A transform with public names only: each unit's global gradient norm (before clipping) as a metric.
Run: python examples/custom_transform.py, or torchrun --standalone --nproc-per-node 2 examples/custom_transform.py"""
import torch

import fshard as fs


class unit_grad_norms(fs.Transform):  # metrics["grad_norm/<unit>"]; grads(): a link of the grads chain
    changes_grads = False  # reads the shards and adds metrics, so offload_state may still update during backward

    def grads(self, comm, grads):
        names = sorted(grads.shards)  # the units that got a gradient: the same on every rank (the step checked)
        if not names:
            return grads
        sq = torch.stack([torch.linalg.vector_norm(grads.shards[n], dtype=torch.float64) ** 2 for n in names])
        comm.all_reduce(sq, "unit_grad_norms")  # the ranks' shards tile each unit: the sum is its norm squared
        return grads.with_metrics(**{f"grad_norm/{n}": v ** 0.5 / grads.loss_scale  # (fp16: unscaled)
                                     for n, v in zip(names, sq.tolist())})


if __name__ == "__main__":
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    mesh, cfg = fs.Mesh.from_env(), GPTConfig.tiny()
    torch.manual_seed(0)  # the same model on every rank
    state = fs.init(GPT(cfg), mesh, fs.adamw(lr=3e-3))
    with fs.compose(loss_fn, fs.clip_by_global_norm(1.0), unit_grad_norms()) as step:
        for batch in synthetic_batches(cfg, 4, 3, rank=mesh.rank, world_size=mesh.world_size):
            state, metrics = step(state, batch)
            print(mesh.rank, {k: round(v, 4) for k, v in metrics.items() if k.startswith("grad_norm")})
