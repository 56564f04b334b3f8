"""bucket_reduce, accumulate, clip_by_global_norm and skip_nonfinite against the blocking reduce and against DDP."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from _dist import run_ranks

STEPS = 4
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _bytes(params):
    return {n: p.detach().numpy().tobytes() for n, p in params.items()}


def _model(name):
    torch.manual_seed(0)
    if name == "gpt":
        from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
        cfg = GPTConfig.tiny(n_layers=3)
        return GPT(cfg), loss_fn, lambda r, n, k=STEPS, b=2: list(synthetic_batches(cfg, b, k, seed=9, rank=r,
                                                                                       world_size=n))
    from models import Awkward, awkward_batches, awkward_loss
    return Awkward(), awkward_loss, lambda r, n, k=STEPS, b=2: list(awkward_batches(b, k, r, n))


def _configs():
    import fshard as fs
    return {
        "blocking": (),
        "tiny": (fs.bucket_reduce(bucket_mb=1e-6),),  # smaller than any unit: each unit a bucket of its own
        "mid": (fs.bucket_reduce(bucket_mb=0.1),),  # several units a bucket (the GPT's: two blocks each)
        "whole": (fs.bucket_reduce(bucket_mb=1e4),),  # one bucket for the whole model
        "tiny+ahead": (fs.gather_ahead(2), fs.bucket_reduce(bucket_mb=1e-6)),
        "whole+ahead": (fs.gather_ahead(1), fs.bucket_reduce(bucket_mb=1e4)),
        "per_unit+ahead": (fs.gather_ahead(2), fs.bucket_reduce(per_unit=True)),  # FSDP2's per-module reduce
    }


def _train(name):
    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _model(name)
    out = {}
    for key, ts in _configs().items():
        state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
        step = fs.compose(loss_fn, *ts, trace=True)
        losses, traces = [], []
        for b in batches(mesh.rank, mesh.world_size):
            state, m = step(state, b)
            losses.append(m["loss"])
            traces.append(m["trace/collectives"])
        full = fs.full_params(state)
        out[key] = (losses, _bytes(full), {n: p.detach().numpy().copy() for n, p in full.items()}, traces,
                    m["comm/reduce_bytes"], m["reduce/overlap"])
    return out


def _max_diff(a, b):
    """Max |a - b| over all parameters, except the key third of attention qkv biases: their true gradient is 0,
    so they train on rounding noise that depends on the summation order (see test_ddp_equivalence.KEY_BIAS_BOUND;
    they are held to that bound here)."""
    from test_ddp_equivalence import KEY_BIAS_BOUND
    worst = 0.0
    for n in a:
        d = abs(a[n] - b[n]).reshape(-1)
        if n.endswith("attn.qkv.bias"):
            k = d.size // 3
            assert float(d[k:2 * k].max()) <= KEY_BIAS_BOUND, n
            d[k:2 * k] = 0
        worst = max(worst, float(d.max()) if d.size else 0.0)
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_matches_blocking_at_every_bucket_size(world_size):
    import fshard.testing as ft
    for name in ("gpt", "awkward"):
        ranks = run_ranks(_train, world_size, name)
        for r, res in enumerate(ranks):
            ref_losses, ref_bytes, ref_full = res["blocking"][:3]
            for key, (losses, pbytes, full, traces, reduce_bytes, overlap) in res.items():
                if world_size == 2:  # a sum of two values is the same in any order: bitwise
                    assert losses == ref_losses, f"{name} {key} rank {r}: losses differ"
                    assert pbytes == ref_bytes, f"{name} {key} rank {r}: parameters differ"
                else:  # the order of a 3-way sum may differ between reduce_scatter and reduce
                    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6
                    assert _max_diff(full, ref_full) <= 1e-6, f"{name} {key} rank {r}"
        for key in ranks[0]:
            for s in range(STEPS):
                ft.check_same_collectives([res[key][3][s] for res in ranks])
        reduces = {key: [c for c in ranks[0][key][3][0] if c[0] == "reduce"] for key in ("tiny", "mid", "whole",
                                                                                       "per_unit+ahead")}
        import fshard as fs
        trainable = sum(bool(u.trainable) for u in fs.init(_model(name)[0], fs.Mesh.local(), fs.adamw()).spec.units)
        # units are never split: a budget below every unit's size is one bucket per unit, as per_unit is
        for key in ("tiny", "per_unit+ahead"):
            assert len(reduces[key]) == world_size * len({c[1].split("/")[0] for c in reduces[key]}) \
                == world_size * trainable, key
        assert len(reduces["whole"]) == world_size
        if name == "gpt":  # 3 blocks of 50 KB and the root's 27 KB, in 100 KiB buckets: two blocks, then the rest
            assert len(reduces["mid"]) == 2 * world_size


def _param_diff(full, ref):
    return _max_diff({n: p.detach().numpy() for n, p in full.items()},
                     {n: p.detach().numpy() for n, p in ref.named_parameters()})


def _accumulate(k, with_buckets):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _model("gpt")
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    ts = (fs.bucket_reduce(bucket_mb=0.01), fs.gather_ahead(1)) if with_buckets else ()
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    step = fs.compose(loss_fn, *ts, fs.accumulate(k))
    mbs = batches(mesh.rank, mesh.world_size, k * 3, 1)
    loss_diffs = []
    for s in range(3):
        group = mbs[s * k:(s + 1) * k]
        state, m = step(state, group)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(group):
            if i < k - 1:
                with ddp.no_sync():
                    loss = loss_fn(ddp, mb)
                    (loss / k).backward()
            else:
                loss = loss_fn(ddp, mb)
                (loss / k).backward()
            total += loss.item() / k
        opt.step()
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        loss_diffs.append(abs(m["loss"] - t.item() / mesh.world_size))
    return max(loss_diffs), _param_diff(fs.full_params(state), ref)


@pytest.mark.parametrize("k,with_buckets", [(2, False), (4, True)])
def test_accumulating_k_micro_batches_matches_ddp_no_sync(k, with_buckets):
    for loss_diff, param_diff in run_ranks(_accumulate, 2, k, with_buckets):
        assert loss_diff <= 1e-6 and param_diff <= 1e-6, (loss_diff, param_diff)


def _clip(max_norm, impl):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _model("gpt")
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    opt = torch.optim.AdamW(ref.parameters(), **HP, fused=impl != "torch")
    state = fs.init(model, mesh, fs.adamw(**HP, impl=impl))
    step = fs.compose(loss_fn, fs.bucket_reduce(bucket_mb=0.01), fs.clip_by_global_norm(max_norm))
    norm_diffs, clipped = [], 0
    for b in batches(mesh.rank, mesh.world_size):
        state, m = step(state, b)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp, b).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
        opt.step()
        norm_diffs.append(abs(m["grad_norm"] - norm) / norm)
        clipped += norm > max_norm
    return max(norm_diffs), clipped, _param_diff(fs.full_params(state), ref)


@pytest.mark.parametrize("world_size,impl", [(2, "native"), (2, "torch"), (3, "fused")])
def test_clipping_matches_clip_grad_norm_on_ddp(world_size, impl):
    for norm_diff, clipped, param_diff in run_ranks(_clip, world_size, 0.5, impl):
        assert clipped == STEPS  # max_norm is low enough that every step clips
        assert norm_diff <= 1e-6 and param_diff <= 1e-6, (norm_diff, param_diff)


def _poisoned_loss(loss_fn):
    def loss(module, batch):
        b, poison = batch
        out = loss_fn(module, b)
        return out * math.inf if poison else out
    return loss


def _skip(world_size_unused=None):
    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _model("gpt")
    state = fs.init(model, mesh, fs.adamw(**HP))
    step = fs.compose(_poisoned_loss(loss_fn), fs.gather_ahead(1), fs.bucket_reduce(), fs.clip_by_global_norm(1.0),
                      fs.skip_nonfinite())
    out = []
    for s, b in enumerate(batches(mesh.rank, mesh.world_size)):
        before = _bytes({f"{k}": v for k, v in state.params.items()} |
                        {f"m/{k}": v.exp_avg for k, v in state.opt_state.items()} |
                        {f"v/{k}": v.exp_avg_sq for k, v in state.opt_state.items()}) | {"step": int(state.step)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new, m = step(state, (b, s == 2 and mesh.rank == 1))  # an inf loss on rank 1 only, at step 2
        after = _bytes({f"{k}": v for k, v in new.params.items()} |
                       {f"m/{k}": v.exp_avg for k, v in new.opt_state.items()} |
                       {f"v/{k}": v.exp_avg_sq for k, v in new.opt_state.items()}) | {"step": int(new.step)}
        out.append((m["skipped"], m["skipped_total"], before == after, [str(w.message) for w in caught],
                    int(new.skipped)))
        state = new
    return out


def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank():
    for rank_out in run_ranks(_skip, 2):
        assert [o[0] for o in rank_out] == [0, 0, 1, 0]
        assert [o[1] for o in rank_out] == [0, 0, 1, 1]
        assert [o[2] for o in rank_out] == [False, False, True, False]  # unchanged exactly when skipped
        assert "the step was skipped" in rank_out[2][3][0]
        assert [o[4] for o in rank_out] == [0, 0, 1, 1]  # the count is training state: it lives in the state


def test_misuse_is_named():
    import fshard as fs
    from models import Awkward, awkward_batches, awkward_loss
    state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw())
    b = next(iter(awkward_batches(2, 1)))
    with pytest.raises(TypeError, match="list of 2 micro-batches"):
        fs.compose(awkward_loss, fs.accumulate(2))(state, b)  # a tuple (x, y) is one batch, not micro-batches
    with pytest.raises(ValueError, match="bucket_mb"):
        fs.bucket_reduce(bucket_mb=0)
    with pytest.raises(ValueError, match="op"):
        fs.bucket_reduce(op="mean")
    with pytest.raises(ValueError, match="max_norm"):
        fs.clip_by_global_norm(-1)
    with pytest.raises(ValueError, match="k must be"):
        fs.accumulate(0)


def _bf16_reduce(reduce_dtype):
    """Reduced bf16 gradient shards vs the fp32 sum of every rank's bf16 gradient, rounded once to bf16."""
    import torch.distributed as dist

    import fshard as fs
    from fshard.state._flat import flatten
    from models import Block

    class Capture(fs.Transform):
        name = "capture"

        def __init__(self):
            self.shards = {}

        def grads_link(self):
            shards = self.shards

            class Policy(fs.protocol.GradsPolicy):
                changes_grads = False

                def __call__(self, comm, g):
                    shards.update({k: v.clone() for k, v in g.shards.items()})
                    return g
            return Policy()

    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(24) for _ in range(3)]).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    cap = Capture()
    state = fs.init(model, mesh, fs.adamw())
    x = torch.randn(5, 7, 24, generator=torch.Generator().manual_seed(mesh.rank)).to(torch.bfloat16)
    loss_fn = lambda m, b: (m(b).float() ** 2).mean()  # noqa: E731
    fs.compose(loss_fn, fs.bucket_reduce(bucket_mb=1e-3, reduce_dtype=reduce_dtype), cap)(state, x)
    loss_fn(ref, x).backward()
    worst = 0
    for u in state.spec.units:
        local = flatten(u, {s.name: dict(ref.named_parameters())[s.name].grad for s in u.slots})
        total = local.float() * (1.0 / mesh.world_size)
        dist.all_reduce(total)  # the reference: the bf16 gradients scaled and summed in fp32, rounded once
        lo, hi = u.shard_range(mesh.rank)
        want = total[lo:hi]
        got = cap.shards[u.name]
        assert got.dtype == torch.bfloat16
        # error in units of bf16's spacing (2^-7 relative) at each element
        ulps = (got.float() - want).abs() / (want.abs().clamp_min(1e-30) * 2.0**-7)
        worst = max(worst, ulps.max().item())
    return worst


def test_reduce_dtype_sums_bf16_gradients_in_fp32():
    exact = run_ranks(_bf16_reduce, 3, torch.float32)
    plain = run_ranks(_bf16_reduce, 3, None)
    assert max(exact) <= 1.0  # summed in fp32 and rounded to bf16 once: within one bf16 step of the reference
    assert max(plain) > 1.0  # summed in bf16: rounded at every step of the sum, it drifts further


def _reduce_calls():
    """One bucketed step's transport calls for the buckets: how many gloo reduces, section all-reduces and
    exchanges (the loss's and the agreement's all-reduces are small: counted by size)."""
    import torch.distributed as dist
    import fshard as fs
    calls = {"reduce": 0, "all_reduce": 0, "all_to_all_single": 0}
    real = {k: getattr(dist, k) for k in calls}
    for k in calls:
        def spy(t, *a, _k=k, **kw):
            calls[_k] += t.numel() > 64  # (a bucket section; not a check)
            return real[_k](t, *a, **kw)
        setattr(dist, k, spy)
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _model("gpt")
    state = fs.init(model, mesh, fs.adamw(**HP))
    with fs.compose(loss_fn, fs.bucket_reduce(bucket_mb=0.05)) as step:
        step(state, batches(mesh.rank, mesh.world_size)[0])
    return calls


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bucket_is_exchanged_on_gloo_at_two_ranks_and_reduced_to_each_owner_otherwise(world_size):
    """Comm.reduce_each's measured choice (benchmarks/RESULTS.md, "Session 34", "Session 39"): at two ranks each
    rank sends the other its section and receives the other's part of its own, one all-to-all a bucket (half the
    bytes of an all-reduce of each section, which in turn took 0.75x the time of gloo's two reduces); at three the
    reduces are faster. The values are the same either way (test_bucketed_matches_blocking_at_every_bucket_size:
    bitwise at two ranks)."""
    for calls in run_ranks(_reduce_calls, world_size):
        if world_size == 2:
            assert calls["reduce"] == calls["all_reduce"] == 0 and calls["all_to_all_single"] >= 3, calls
        else:
            assert calls["all_reduce"] == calls["all_to_all_single"] == 0 and calls["reduce"] >= 3 * 3, calls


def _blocking_reduce_calls():
    """The blocking reduce's transport calls in one step of the GPT (reduce-scatters and all-to-alls: a check is
    neither), and ``Comm.reduce_scatter`` on its own: into a fresh ``out``, and into ``out`` that is this rank's slice
    of ``full`` itself (as a policy may pass it: ours is read after the other's part is received), and into a
    strided ``out``; then ``out`` of the wrong size, refused on every rank (the error, and what the others raise)."""
    import torch.distributed as dist
    import fshard as fs
    from fshard.dist._collectives import Comm
    calls = {"reduce_scatter_tensor": 0, "all_to_all_single": 0}
    real = {k: getattr(dist, k) for k in calls}
    for k in calls:
        def spy(t, *a, _k=k, **kw):
            calls[_k] += 1
            return real[_k](t, *a, **kw)
        setattr(dist, k, spy)
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _model("gpt")
    state = fs.init(model, mesh, fs.adamw(**HP))
    with fs.compose(loss_fn) as step:
        step(state, batches(mesh.rank, mesh.world_size)[0])
    n, r = mesh.world_size, mesh.rank
    sums = []
    for where in ("own", "inside", "strided")[:3 if n == 2 else 2]:  # (torch's reduce-scatter takes no strided out)
        full = torch.arange(7.0 * n) * (r + 1) + 0.1 * r  # (rank r's: the sum over ranks is known)
        out = {"own": lambda: torch.empty(7), "inside": lambda: full.view(n, 7)[r],
               "strided": lambda: torch.empty(14)[::2]}[where]()
        Comm(mesh, verify=True).reduce_scatter(out, full, "probe").wait()
        sums.append(out.tolist())
    comm = Comm(mesh, verify=True)
    try:
        comm.reduce_scatter(torch.empty(6 if r == 0 else 7), torch.zeros(7 * n), "misused")
        refused = None
    except fs.FshardError as e:
        comm.fail(e)  # (what a step does with its error: the others learn it at their check)
        refused = type(e).__name__
    return calls, sums, refused


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_blocking_reduce_is_an_exchange_on_gloo_at_two_ranks_and_a_reduce_scatter_otherwise(world_size):
    """``Comm.reduce_scatter`` at two ranks on gloo: one all-to-all a unit (2-6x faster than gloo's reduce-scatter,
    design/COLLECTIVES.md), the own slice added at the wait, so the same sum whether ``out`` is a buffer of its own,
    this rank's slice of ``full`` or strided; elsewhere torch's reduce-scatter. Sizes that do not fit are refused
    before the check, so the other ranks raise there. (Bitwise DDP at two ranks: tests/test_ddp_equivalence.py.)"""
    for r, (calls, sums, refused) in enumerate(run_ranks(_blocking_reduce_calls, world_size, timeout_s=60,
                                                         collective_timeout_s=20)):
        assert refused == ("ArgumentError" if r == 0 else "RankFailedError"), (r, refused)
        units = 4  # the GPT's: the root and 3 blocks
        if world_size == 2:
            assert calls["reduce_scatter_tensor"] == 0 and calls["all_to_all_single"] == units + 3, calls
        else:
            assert calls["reduce_scatter_tensor"] == units + 2 and calls["all_to_all_single"] == 0, calls
        fulls = [torch.arange(7.0 * world_size) * (q + 1) + 0.1 * q for q in range(world_size)]
        want = sum(fulls[1:], fulls[0]).view(world_size, 7)[r].tolist()  # (float32, as the ranks sum)
        if world_size == 2:  # a sum of two: exact in either order
            assert sums == [want] * 3, (r, sums, want)
        else:
            assert torch.allclose(torch.tensor(sums), torch.tensor([want] * 2)), (r, sums, want)
