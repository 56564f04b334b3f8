"""Routed units (fs.init(routed=...), fshard/run/_routed_groups.py): experts as units while each rank's tokens pick
different experts. Switch Transformers with one unit per expert trains at world size 2 bitwise equal to DDP with
find_unused_parameters (plain, with gather_ahead + bucket_reduce, with activation checkpointing), with routing that
demonstrably differs between the ranks; Mixtral (whose experts transformers 5 keeps in one module of 3-D
parameters) with each experts module as a unit likewise. A small MoE covers an expert no rank uses (no update, as
torch skips a parameter without a gradient), a container called twice, micro-batches, and misuse. A tiny Qwen3-MoE
(fused experts, issue #37): routed= on its experts modules is an ArgumentError naming fused experts and the fix, and
it trains without routed= (in its layers' units, or each experts module a unit) bitwise like torch."""
from __future__ import annotations

import copy
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn as nn

import fshard as fs
from _dist import run_ranks
from models import HF_VOCAB, enable_checkpointing, hf_model, moe_units, oracle_step, param_diffs

STEPS, HP = 3, dict(lr=1e-2, weight_decay=0.01)


def _hf_loss(module, batch):
    return module(input_ids=batch, labels=batch).loss


def _hf_batches(rank, world_size):
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        rows = torch.randint(3, HF_VOCAB, (world_size, 6), generator=g)  # few tokens: ranks use other experts
        yield rows[rank:rank + 1]


def _experts_called(model: nn.Module, log: list):
    """Record the name of each expert the oracle model calls, in call order."""
    for name, m in model.named_modules():
        if re.search(r"\.experts\.expert_\d+$", name):
            m.register_forward_pre_hook(lambda mod, args, name=name: log.append(name))


def _train_hf(name: str, config: str):
    """fshard and DDP (find_unused_parameters=True) side by side. Returns (losses equal, parameters equal, the
    experts this rank's tokens reached)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = hf_model(name)
    if config == "checkpointing":
        enable_checkpointing(model)
    ref = copy.deepcopy(model)
    called: list[str] = []
    _experts_called(ref, called)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"), **moe_units(name, model))
    transforms = (fs.gather_ahead(2), fs.bucket_reduce(bucket_mb=0.001)) if config == "ahead" else ()
    oracle = DDP(ref, find_unused_parameters=True) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    same_loss = True
    with fs.compose(_hf_loss, *transforms) as step:
        for batch in _hf_batches(mesh.rank, mesh.world_size):
            state, m = step(state, batch)
            same_loss &= m["loss"] == oracle_step(oracle, opt, _hf_loss, batch, mesh.world_size)
    _, bitwise = param_diffs(fs.full_params(state), ref)
    return same_loss, bitwise, called


@pytest.mark.parametrize("config", ["plain", "ahead", "checkpointing"])
def test_switch_with_one_unit_per_expert_trains_equal_to_ddp(config):
    results = run_ranks(_train_hf, 2, "switch", config)
    for same_loss, same_params, _ in results:
        assert same_loss and same_params, f"{config}: fshard differs from DDP"
    assert results[0][2] != results[1][2], "the ranks' tokens reached the same experts: the test shows nothing"


def test_switch_routed_at_world_size_1():
    assert _train_hf("switch", "ahead")[:2] == (True, True)


def test_mixtral_with_its_experts_modules_as_units_trains_equal_to_ddp():
    for same_loss, same_params, _ in run_ranks(_train_hf, 2, "mixtral", "ahead"):
        assert same_loss and same_params


# --- a small MoE: an unused expert, a container called twice, micro-batches, misuse ----------------------------

class Experts(nn.Module):
    """Calls the expert each token is routed to, only for the experts some token picked."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e in route.unique().tolist():
            rows = route == e
            out[rows] = self.experts[e](x[rows])
        return out


class MoE(nn.Module):
    def __init__(self, d: int = 8, n: int = 4):
        super().__init__()
        self.inp, self.router, self.moe, self.out = nn.Linear(d, d), nn.Linear(d, n - 1), Experts(d, n), nn.Linear(d, 3)

    def forward(self, batch):
        x, y = batch
        h = self.inp(x)
        for _ in range(2):  # the container twice; expert n-1 is never routed to
            h = h + self.moe(h, self.router(h).argmax(-1))
        return nn.functional.cross_entropy(self.out(h), y)


def _moe_batches(rank, world_size, k=1):
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        x, y = torch.randn(6 * world_size * k, 8, generator=g), torch.randint(0, 3, (6 * world_size * k,), generator=g)
        mine = x.view(world_size, k, 6, 8)[rank], y.view(world_size, k, 6)[rank]
        yield [(mine[0][i], mine[1][i]) for i in range(k)] if k > 1 else (mine[0][0], mine[1][0])


def _call(model, batch):
    return model(batch)


def _train_moe(k: int):
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = MoE()
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"), routed=["moe"])
    oracle = DDP(ref, find_unused_parameters=True) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    transforms = (fs.accumulate(k),) if k > 1 else (fs.gather_ahead(1), fs.bucket_reduce(bucket_mb=0.0001))
    same_loss, before = True, ref.moe.experts[3].weight.detach().clone()
    with fs.compose(_call, *transforms) as step:
        for batch in _moe_batches(mesh.rank, mesh.world_size, k):
            state, m = step(state, batch)
            if k == 1:
                same_loss &= m["loss"] == oracle_step(oracle, opt, _call, batch, mesh.world_size)
            else:  # the oracle's accumulation: each micro-batch's loss / k, one optimizer step
                opt.zero_grad(set_to_none=True)
                losses = [_call(ref, mb) for mb in batch]
                for loss in losses:
                    (loss / k).backward()
                opt.step()
                same_loss &= m["loss"] == sum(x.item() / k for x in losses)
    full = fs.full_params(state)
    _, bitwise = param_diffs(full, ref)
    return same_loss, bitwise, torch.equal(full["moe.experts.3.weight"], before)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_small_moe_with_an_unused_expert_and_a_container_called_twice(world_size):
    for same_loss, same_params, unused_kept in run_ranks(_train_moe, world_size, 1):
        assert same_loss and same_params and unused_kept


def test_a_small_moe_with_micro_batches():
    assert _train_moe(2) == (True, True, True)


def test_routed_misuse_is_named():
    mesh = fs.Mesh(0, 1, "local", torch.device("cpu"))
    for bad in ("nope", "moe.experts"):  # not a submodule; a ModuleList, which nobody calls
        with pytest.raises(fs.InitError, match="experts container"):
            fs.init(MoE(), mesh, fs.adamw(), routed=[bad])

    def direct(model, batch):  # an expert called outside its container
        return model.moe.experts[0](batch[0]).sum()
    state = fs.init(MoE(), mesh, fs.adamw(), routed=["moe"])
    assert state.spec.groups == (("moe", tuple(f"moe.experts.{i}" for i in range(4))),)
    with fs.compose(direct) as step, pytest.raises(fs.errors.TemplateCallError, match="through the container"):
        step(state, next(_moe_batches(0, 1)))


def _undeclared(check_collectives):
    """Switch with one unit per expert but no routed=: the ranks' gathers differ in the first step."""
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = hf_model("switch")
    units = [n for n, _ in model.named_modules() if re.search(r"\.experts\.expert_\d+$", n)]
    state = fs.init(model, mesh, fs.adamw(**HP), units=units)
    with fs.compose(_hf_loss, check_collectives=check_collectives) as step:
        try:
            for batch in _hf_batches(mesh.rank, mesh.world_size):
                state, _ = step(state, batch)
        except fs.RankDivergenceError as e:
            return str(e)
    return None


def test_undeclared_routing_is_a_divergence_error_on_every_rank_not_an_abort():
    # (the default checks every step on a CPU mesh; check_collectives=False checks none: gloo would abort)
    for message in run_ranks(_undeclared, 2, None) + run_ranks(_undeclared, 2, True):
        assert message is not None and "routed=" in message


def test_plan_moves_a_routed_group_together():
    """step.plan simulates a group's members gathered and reduced together, as the step runs them."""
    state = fs.init(MoE(), fs.Mesh(0, 1, "local", torch.device("cpu")), fs.adamw(), routed=["moe"])
    batch = next(_moe_batches(0, 1))
    with fs.compose(_call, fs.gather_ahead(1), fs.bucket_reduce(bucket_mb=0.0001)) as step:
        for _ in range(2):
            state, m = step(state, batch)
        plan = step.plan(state, batch)
    for k in ("mem/peak_gathered_bytes", "mem/grad_shard_bytes", "comm/reduce_bytes", "comm/gather_bytes"):
        assert plan[k] == m[k], (k, plan[k], m[k])


# --- fused experts: routed= refused with the reason (issue #37) -------------------------------------------------

def _qwen3_moe():
    """A tiny Qwen3-MoE of transformers 5: each layer's experts in one Qwen3MoeExperts of 3-D parameters."""
    import transformers as T
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=32, decoder_sparse_step=1,
                           mlp_only_layers=[], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return T.Qwen3MoeForCausalLM(cfg)


def test_routed_on_fused_experts_is_refused_with_the_reason_and_the_fix():
    model, mesh = _qwen3_moe(), fs.Mesh.local()
    assert model.model.layers[0].mlp.experts.gate_up_proj.dim() == 3  # the structure this test is about
    experts = [n for n, _ in model.named_modules() if n.endswith("mlp.experts")]
    with pytest.raises(fs.ArgumentError) as e:
        fs.init(model, mesh, fs.adamw(), routed=experts)
    msg = str(e.value)
    assert "'model.layers.0.mlp.experts'" in msg and "Qwen3MoeExperts has no child module with parameters" in msg
    assert re.search(r"experts are fused: 3-D parameters .*gate_up_proj \(4, 32, 32\)", msg)
    assert "gathered whole" in msg and "Drop it from routed= (pass nothing)" in msg
    assert "units=[..., 'model.layers.0.mlp.experts']" in msg
    with pytest.raises(fs.ArgumentError, match="SwitchTransformersExperts"):  # no parameters at all: not fused
        fs.init(model, mesh, fs.adamw(), routed=["model.layers.0.mlp.experts.act_fn"])


@pytest.mark.parametrize("units", [False, True])
def test_fused_experts_train_without_routed(units):
    """Without routed= (in its layer's unit, or a unit of its own) a Qwen3-MoE steps bitwise like torch."""
    model = _qwen3_moe()
    ref = copy.deepcopy(model)
    kw = dict(units=[n for n, _ in model.named_modules() if n.endswith("mlp.experts") or
                     (n.startswith("model.layers.") and n.count(".") == 2)]) if units else {}
    state = fs.init(model, fs.Mesh.local(), fs.adamw(**HP, impl="torch"), **kw)
    assert ("model.layers.0.mlp.experts" in {u.name for u in state.spec.units}) == units
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    batch = next(_hf_batches(0, 1))
    with fs.compose(_hf_loss) as step:
        state, m = step(state, batch)
    assert m["loss"] == oracle_step(ref, opt, _hf_loss, batch, 1)
    diffs, bitwise = param_diffs(fs.full_params(state), ref)
    assert bitwise, {n: d for n, d in diffs.items() if d}
