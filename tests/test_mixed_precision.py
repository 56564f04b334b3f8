"""fs.mixed_precision against FSDP2's MixedPrecisionPolicy, and with the other transforms.

The oracle: ``fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32))`` on every block and the root, ``torch.optim.AdamW`` (the same single-tensor arithmetic
as ``fs.adamw(impl="torch")``), same weights and batches. The arithmetic is the same (fp32 shards cast to bf16 and
gathered, bf16 forward and backward, the bf16 gradient cast to fp32 and averaged over 2 ranks, fp32 update), so the
losses and the final parameters are bitwise equal over 20 steps.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_ranks
from models import oracle_step

STEPS = 20
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _setup():
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    mesh = fs.Mesh.from_env()
    cfg = GPTConfig.tiny(n_layers=3)
    torch.manual_seed(0)
    model = GPT(cfg)
    return fs, mesh, model, loss_fn, list(synthetic_batches(cfg, 4, STEPS, 0, mesh.rank, mesh.world_size))


def fsdp2_mixed(model, world_size: int, param_dtype: torch.dtype):
    """The oracle: a copy of ``model`` with ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype,
    float32))`` on every block and the root, and its ``torch.optim.AdamW``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ref = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    dm = init_device_mesh("cpu", (world_size,))
    for block in ref.blocks:
        fully_shard(block, mesh=dm, mp_policy=policy)
    fully_shard(ref, mesh=dm, mp_policy=policy)
    return ref, torch.optim.AdamW(ref.parameters(), **HP)


def _against_fsdp2(transforms: str):
    from torch.distributed.tensor import DTensor

    fs, mesh, model, loss_fn, batches = _setup()
    ref, opt = fsdp2_mixed(model, mesh.world_size, torch.bfloat16)
    ts = (fs.gather_ahead(2), fs.bucket_reduce(0.01)) if transforms == "ahead+buckets" else ()
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    step = fs.compose(loss_fn, *ts, fs.mixed_precision())
    ours, theirs = [], []
    for b in batches:
        state, m = step(state, b)
        ours.append(m["loss"])
        theirs.append(oracle_step(ref, opt, loss_fn, b, mesh.world_size))
    full = fs.full_params(state)
    equal = all(torch.equal(full[n], (p.full_tensor() if isinstance(p, DTensor) else p).detach())
                for n, p in ref.named_parameters())
    dtypes = {str(t.dtype) for t in state.params.values()} | {str(s.exp_avg.dtype) for s in state.opt_state.values()}
    return ours, theirs, equal, dtypes


@pytest.mark.parametrize("transforms", ["blocking", "ahead+buckets"])
def test_bf16_is_bitwise_fsdp2_mixed_precision(transforms):
    for ours, theirs, equal, dtypes in run_ranks(_against_fsdp2, 2, transforms):
        assert ours == theirs, (ours, theirs)
        assert equal
        assert dtypes == {"torch.float32"}  # master parameters and moments stay fp32
        assert ours[-1] < ours[0]


def _with_others():
    fs, mesh, model, loss_fn, batches = _setup()
    out = {}
    configs = {
        "fp32": (),
        "bf16": (fs.mixed_precision(),),
        "bf16+ahead+buckets": (fs.gather_ahead(1), fs.bucket_reduce(0.004), fs.mixed_precision()),
        "bf16+offload": (fs.mixed_precision(), fs.offload_state(fs.CPUStore(), chunk_mb=0.01)),
        "bf16+clip+skip": (fs.mixed_precision(), fs.clip_by_global_norm(0.5), fs.skip_nonfinite()),
        "bf16+accumulate": (fs.accumulate(2), fs.mixed_precision()),
        "bf16 reduced in bf16": (fs.mixed_precision(reduce_dtype=None),),
    }
    for name, ts in configs.items():
        state = fs.init(copy.deepcopy(model), mesh, fs.adamw(**HP, impl="torch"))
        with fs.compose(loss_fn, *ts) as step:
            losses = []
            for i, b in enumerate(batches[:6]):
                plan = step.plan(state, [b, b] if "accumulate" in name else b)
                state, m = step(state, [b, b] if "accumulate" in name else b)
                losses.append(m["loss"])
                # (before the first step the plan is of the later steps, which prefetch along the recorded gather order)
                skip = (("mem/peak_gathered_bytes", "comm/gather_bytes", "mem/peak_bytes")
                        if i == 0 and "ahead" in name else ())
                assert all(abs(plan[k] - m[k]) <= 0.05 * max(plan[k], m[k])
                           for k in plan.figures if k not in skip), name
        full = fs.full_params(state)
        out[name] = (losses, {n: (str(t.dtype), t.detach().numpy().tobytes()) for n, t in full.items()},
                     m["comm/gather_bytes"], m["comm/reduce_bytes"], m.get("grad_norm"))
    return out


def test_bf16_composes_with_the_other_transforms():
    for out in run_ranks(_with_others, 2):
        base_losses, base_params, _, _, _ = out["bf16"]
        # scheduling and where the moments live never change a result
        for name in ("bf16+ahead+buckets", "bf16+offload"):
            assert out[name][0] == base_losses, name
            assert out[name][1] == base_params, name
        # half the gathered bytes of fp32; gradients reduced in fp32 (the same bytes), or in bf16 (half)
        assert out["bf16"][2] <= 0.55 * out["fp32"][2]
        assert out["bf16"][3] == out["fp32"][3] and out["bf16 reduced in bf16"][3] <= 0.55 * out["fp32"][3]
        assert out["bf16+clip+skip"][4] is not None
        for name, (losses, params, *_) in out.items():
            assert all(l == l for l in losses) and losses[-1] < losses[0], name  # finite and training
            assert all(dtype == "torch.float32" for dtype, _ in params.values()), name


def test_mixed_precision_wraps_so_it_comes_after_the_setters():
    import fshard as fs
    from gpt import loss_fn
    with pytest.raises(fs.errors.TransformConflictError):
        fs.compose(loss_fn, fs.mixed_precision(), fs.gather_ahead(2))
    with pytest.raises(fs.ArgumentTypeError, match="param_dtype"):
        fs.mixed_precision(param_dtype=torch.int8)



def _accumulate_against_fsdp2(param_dtype):
    """fs.accumulate(2) with mixed precision against FSDP2 with ``set_requires_gradient_sync(False)`` on the first
    micro-batch: FSDP2 sums the micro-batches' unsharded gradients in its reduce_dtype (fp32), each low-precision
    gradient upcast into the sum; fshard sums in the reduce policy's ``reduce_dtype`` the same way, so the run is
    bitwise FSDP2's. (Summed in fp16 itself, the gradients would round at every micro-batch, and could overflow.)"""
    from torch.distributed.tensor import DTensor

    fs, mesh, model, loss_fn, batches = _setup()
    ref, opt = fsdp2_mixed(model, mesh.world_size, param_dtype)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    step = fs.compose(loss_fn, fs.accumulate(2), fs.mixed_precision(param_dtype, loss_scale=None))
    ours, theirs = [], []
    for i in range(0, 12, 2):
        state, m = step(state, batches[i:i + 2])
        ours.append(m["loss"])
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j, b in enumerate(batches[i:i + 2]):
            ref.set_requires_gradient_sync(j == 1)
            loss = loss_fn(ref, b)
            (loss / 2).backward()
            total += loss.detach().double() / 2
        opt.step()
        torch.distributed.all_reduce(total)
        theirs.append(total.item() / mesh.world_size)
    full = fs.full_params(state)
    equal = all(torch.equal(full[n], (p.full_tensor() if isinstance(p, DTensor) else p).detach())
                for n, p in ref.named_parameters())
    return ours, theirs, equal


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_accumulated_micro_batches_sum_in_the_reduce_dtype_as_fsdp2(param_dtype):
    for ours, theirs, equal in run_ranks(_accumulate_against_fsdp2, 2, param_dtype):
        assert ours == theirs, (ours, theirs)
        assert equal


def _autocast_against_ddp(transforms: str):
    """bf16 the DDP way: fp32 state, ``torch.autocast`` inside ``loss_fn`` (each op cast as autocast casts it, norms,
    softmax and the loss in fp32), against DDP (or the plain model at one rank) with the same loss_fn and
    ``torch.optim.AdamW``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    fs, mesh, model, loss_fn, batches = _setup()

    def autocast_loss(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(m, b)

    ref = copy.deepcopy(model)
    ddp = DDP(ref) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    ts = (fs.gather_ahead(2), fs.bucket_reduce(0.01)) if transforms == "ahead+buckets" else ()
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    ours, theirs = [], []
    with fs.compose(autocast_loss, *ts, donate=True) as step:
        for b in batches[:8]:
            state, m = step(state, b)
            ours.append(m["loss"])
            theirs.append(oracle_step(ddp, opt, autocast_loss, b, mesh.world_size))
    full = fs.full_params(state)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    equal = all(torch.equal(full[n], p.detach()) for n, p in ref.named_parameters())
    return ours, theirs, diff, equal, m["comm/gather_bytes"]


@pytest.mark.parametrize("world_size,transforms", [(1, "blocking"), (2, "blocking"), (2, "ahead+buckets")])
def test_autocast_inside_loss_fn_equals_ddp_with_autocast(world_size, transforms):
    """A user's ``torch.autocast`` in ``loss_fn`` works inside the step (gathers, hooks, backward, gradients
    averaged over ranks in fp32): losses and parameters bitwise DDP's (the plain model's at one rank) with the same
    loss_fn. The gathers move fp32 (autocast casts after them): ``fs.mixed_precision`` is the way to halve them."""
    out = run_ranks(_autocast_against_ddp, 2, transforms) if world_size == 2 else [_autocast_against_ddp(transforms)]
    for ours, theirs, diff, equal, gathered in out:
        assert ours == theirs, (ours, theirs)
        assert equal, diff
        assert ours[-1] < ours[0]
