"""fshard vs the oracle: DDP + torch.optim.AdamW on the same global batch, at world sizes 1, 2 and 3."""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_ranks

STEPS = 10
# The key third of an attention qkv bias has an exactly zero gradient (softmax is shift-invariant), so what
# backward computes for it is rounding noise, and Adam turns noise into steps of up to lr. At world size 3 the
# noise depends on the order in which ranks' gradients are summed: DDP against DDP itself with a different
# bucket_cap_mb (25 vs 0.001) differs by 9.0e-6 there after these 10 steps, while every other parameter agrees
# to 6e-8. No implementation can match DDP to 1e-6 on those elements, so they get this bound instead (every other
# element, the query and value biases included, is held to 1e-6).
KEY_BIAS_BOUND = 1e-4
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _build(name):
    torch.manual_seed(0)
    if name == "gpt":
        from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
        cfg = GPTConfig.tiny()
        return GPT(cfg), loss_fn, lambda r, n: synthetic_batches(cfg, 2, STEPS, seed=3, rank=r, world_size=n)
    from models import Awkward, awkward_batches, awkward_loss
    return Awkward(), awkward_loss, lambda r, n: awkward_batches(2, STEPS, rank=r, world_size=n)


def _compare(name: str, impl: str):
    """On one rank: train fshard and DDP side by side; return per-step losses and final param differences."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _build(name)
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, fs.adamw(**HP, impl=impl))
    step = fs.compose(loss_fn)
    ddp = DDP(ref, find_unused_parameters=True) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HP, fused=impl != "torch")
    ours, theirs = [], []
    for batch in batches(mesh.rank, mesh.world_size):
        state, metrics = step(state, batch)
        ours.append(metrics["loss"])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp, batch)
        loss.backward()
        opt.step()
        mean = loss.detach().double()  # fshard averages the ranks' fp32 losses in fp64
        if mesh.world_size > 1:
            dist.all_reduce(mean)
        theirs.append(mean.item() / mesh.world_size)
    full = fs.full_params(state)
    diffs = {}
    for n, p in ref.named_parameters():
        d = (full[n] - p.detach()).abs()
        if n.endswith("attn.qkv.bias"):  # split off the key bias (see KEY_BIAS_BOUND)
            dim = d.numel() // 3
            diffs[n + "[key]"] = d[dim:2 * dim].max().item()
            d = torch.cat([d[:dim], d[2 * dim:]])
        diffs[n] = d.max().item() if d.numel() else 0.0
    bitwise = all(torch.equal(full[n], p.detach()) for n, p in ref.named_parameters()) and ours == theirs
    return ours, theirs, diffs, bitwise


def _all_cases():
    return {(name, impl): _compare(name, impl) for name in ("gpt", "awkward") for impl in ("torch", "fused", "native")}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_matches_ddp_adamw(world_size):
    results = run_ranks(_all_cases, world_size) if world_size > 1 else [_all_cases()]
    for rank_result in results:
        for (name, impl), (ours, theirs, diffs, bitwise) in rank_result.items():
            assert len(ours) == STEPS
            for s, (a, b) in enumerate(zip(ours, theirs)):
                assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), f"{name}/{impl} step {s}: loss {a} vs DDP {b}"
            for n, d in diffs.items():
                bound = KEY_BIAS_BOUND if n.endswith("[key]") else 1e-6
                assert d <= bound, f"{name}/{impl} at world size {world_size}: {n} differs by {d:.3g} > {bound}"
            if world_size in (1, 2) and impl == "torch":
                # Bitwise: impl="torch" replays torch.optim.AdamW's per-tensor kernels, and a 2-rank sum is
                # order-independent. Not asserted for "fused": torch's fused CPU kernel rounds an element
                # differently in its scalar tail than in its vector body (about 1 run in 130 of a 37-element
                # tensor, measured), so a parameter's result depends on where the shard's segment starts.
                assert bitwise, f"{name}/{impl} at world size {world_size} is within 1e-6 but not bitwise"
    # the loss must actually go down, or this test would pass on a model that does not train
    ours = results[0][("gpt", "torch")][0]
    assert ours[-1] < ours[0]
