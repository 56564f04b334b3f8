"""fshard vs the oracle: DDP + torch.optim.AdamW on the same global batch, at world sizes 1, 2 and 3."""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_ranks
from models import KEY_BIAS_BOUND, check_oracle, oracle_model, oracle_step, param_diffs

STEPS = 10
# The key third of an attention qkv bias has an exactly zero gradient (softmax is shift-invariant), so what
# backward computes for it is rounding noise, and Adam turns noise into steps of up to lr. At world size 3 the
# noise depends on the order in which ranks' gradients are summed: DDP against DDP itself with a different
# bucket_cap_mb (25 vs 0.001) differs by 9.0e-6 there after these 10 steps, while every other parameter agrees
# to 6e-8. No implementation can match DDP to 1e-6 on those elements, so they get this bound instead (every other
# element, the query and value biases included, is held to 1e-6): KEY_BIAS_BOUND, in models.py.
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _compare(name: str, impl: str):
    """On one rank: train fshard and DDP side by side; return per-step losses and final param differences."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = oracle_model(name, STEPS)
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, fs.adamw(**HP, impl=impl))
    step = fs.compose(loss_fn)
    ddp = DDP(ref, find_unused_parameters=True) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HP, fused=impl != "torch")
    ours, theirs = [], []
    for batch in batches(mesh.rank, mesh.world_size):
        state, metrics = step(state, batch)
        ours.append(metrics["loss"])
        theirs.append(oracle_step(ddp, opt, loss_fn, batch, mesh.world_size))
    diffs, equal = param_diffs(fs.full_params(state), ref)
    bitwise = equal and ours == theirs
    return ours, theirs, diffs, bitwise


def _all_cases():
    return {(name, impl): _compare(name, impl) for name in ("gpt", "awkward") for impl in ("torch", "fused", "native")}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_matches_ddp_adamw(world_size):
    results = run_ranks(_all_cases, world_size) if world_size > 1 else [_all_cases()]
    for rank_result in results:
        for (name, impl), (ours, theirs, diffs, bitwise) in rank_result.items():
            assert len(ours) == STEPS
            # bitwise with impl="torch" at 1 and 2 ranks: it replays torch.optim.AdamW's per-tensor kernels
            check_oracle(f"{name}/{impl}", world_size, impl, ours, theirs, diffs, bitwise)
    # the loss must actually go down, or this test would pass on a model that does not train
    ours = results[0][("gpt", "torch")][0]
    assert ours[-1] < ours[0]
