"""fs.clip_by_global_norm against torch.nn.utils.clip_grad_norm_ (fshard/_clip.py): the global norm bitwise at
world size 1 and the parameters after AdamW (impl="torch") too; at world sizes 2 and 3 against DDP within 3e-7
relative, i.e. two fp32 ulps (measured: 1.1e-7 and 2.5e-7; one ulp is 6e-8 to 1.2e-7 relative, so the issue's 1e-7
is below the format's resolution for some values): each rank holds only part of a parameter, so each parameter's
norm is the correctly rounded one, where torch's fp32 reduction of the whole gradient rounds as it sums. On the
example GPT and on a model with tied, frozen and unused parameters (an unused parameter has no gradient, which
torch leaves out of its norms: so does fshard)."""
from __future__ import annotations

import copy

import pytest
import torch

import fshard as fs
from _dist import run_ranks
from models import oracle_model, param_diffs

STEPS, HP = 3, dict(lr=1e-2, weight_decay=0.01)


def _clip(name: str, max_norm: float, with_transforms: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = oracle_model(name, STEPS)
    ref = copy.deepcopy(model)
    oracle = DDP(ref, find_unused_parameters=name == "awkward") if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HP)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    extra = (fs.gather_ahead(1), fs.bucket_reduce(bucket_mb=0.01), fs.skip_nonfinite()) if with_transforms else ()
    norm_diffs, clipped = [], 0
    with fs.compose(loss_fn, *extra, fs.clip_by_global_norm(max_norm)) as step:
        for b in batches(mesh.rank, mesh.world_size):
            state, m = step(state, b)
            opt.zero_grad(set_to_none=True)
            loss_fn(oracle, b).backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
            opt.step()
            norm_diffs.append(abs(m["grad_norm"] - norm) / norm)
            clipped += norm > max_norm
    diffs, bitwise = param_diffs(fs.full_params(state), ref)
    return max(norm_diffs), clipped, max(diffs.values()), bitwise


@pytest.mark.parametrize("name", ["gpt", "awkward"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_global_norm_is_clip_grad_norms(name, world_size):
    for norm_diff, clipped, param_diff, bitwise in run_ranks(_clip, world_size, name, 0.05, world_size == 2):
        assert clipped == STEPS  # max_norm is low enough that every step clips
        if world_size == 1:
            assert norm_diff == 0.0 and bitwise, (norm_diff, param_diff)
        else:
            assert norm_diff <= 3e-7 and param_diff <= 1e-5, (norm_diff, param_diff)
