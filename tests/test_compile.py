"""torch.compile inside the step (issue #42): ``fs.compose(compile=...)`` compiles each unit's forward, as torchtitan
compiles each block under FSDP2, and ``torch.compile(loss_fn)`` compiles the glue between units (the units opaque
to it). Held against the same model with each block compiled the same way (``block.compile()``) without fshard (DDP
at two ranks), with activation checkpointing inside and around units, with gather_ahead + bucket_reduce: losses and
parameters bitwise. The units of one class share one compiled graph (no recompile per unit or per step)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import fshard as fs
from _dist import run_ranks
from models import oracle_step, param_diffs
from test_checkpointing import HP, Net, _batches, _call


def _train(mode: str, policies: str, options: dict, glue: bool = False):
    """fshard with compiled units (and a compiled loss function with ``glue``) and the same model with each block
    compiled, without fshard (DDP at 2 ranks), on the same batches. Returns (losses equal, parameters bitwise,
    compiled frames, graphs)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch._dynamo.reset()
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = Net(mode)
    ref = copy.deepcopy(model)
    for blk in ref.blocks:
        blk.compile(**options)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    transforms = (fs.gather_ahead(2), fs.bucket_reduce(bucket_mb=0.001)) if policies == "ahead" else ()
    oracle = DDP(ref) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    loss_fn = torch.compile(_call, **options) if glue else _call
    same_loss = True
    with fs.compose(loss_fn, *transforms, compile=options) as step:
        for batch in _batches(mesh.rank, mesh.world_size):
            state, m = step(state, batch)
            same_loss &= m["loss"] == oracle_step(oracle, opt, _call, batch, mesh.world_size)
    _, bitwise = param_diffs(fs.full_params(state), ref)
    return same_loss, bitwise, dict(counters["stats"]), dict(counters["frames"])


@pytest.mark.parametrize("mode", ["plain", "inner", "around"])
def test_compiled_units_are_bitwise_the_compiled_model(mode):
    same_loss, same_params, stats, _ = _train(mode, "default", {"backend": "aot_eager"})
    assert same_loss and same_params, f"{mode}: compiled units differ from the same model compiled without fshard"
    assert stats["unique_graphs"] >= 1


def test_compiled_units_at_two_ranks_with_inductor_and_gather_ahead():
    for same_loss, same_params, _, _ in run_ranks(_train, 2, "plain", "ahead", {"backend": "inductor"}):
        assert same_loss and same_params, "inductor-compiled units differ from DDP with the same compiled blocks"


def test_a_compiled_loss_function_leaves_units_to_the_step():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same_loss, same_params, stats, frames = _train("plain", "default", {"backend": "aot_eager"}, glue=True)
    assert same_loss and same_params
    # dynamo tracing into the step's machinery warns of what it cannot trace (time.perf_counter, zlib.crc32, ...)
    assert not [w for w in caught if "does not know how to trace" in str(w.message)], [str(w.message) for w in caught]
    # the loss function's graphs around the units, and the units' own graph
    assert stats["unique_graphs"] >= 2, stats


def _losses(model, loss_fn, batches, transforms, compile):
    state = fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(**HP, impl="torch"))
    losses = []
    with fs.compose(loss_fn, *transforms, compile=compile) as step:
        for batch in batches:
            state, m = step(state, batch)
            losses.append(m["loss"])
        evaluated = step.eval(state, batch)[0]
    return losses, evaluated, {n: t.clone() for n, t in fs.full_params(state).items()}


@pytest.mark.parametrize("which", ["net", "gpt bf16"])
def test_units_of_one_class_share_one_graph(which):
    """Four blocks (one used twice; the GPT's three) over three steps and an eval pass: one graph for the blocks'
    forward in training and one without grad; the compiled step is bitwise the uncompiled one (aot_eager: the same
    kernels), also under fs.mixed_precision (bf16 parameters and inputs)."""
    torch.manual_seed(0)
    if which == "net":
        model, loss_fn, batches, ts = Net("plain"), _call, list(_batches(0, 1)), ()
    else:
        from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
        cfg = GPTConfig.tiny(n_layers=3)
        model, batches, ts = GPT(cfg), list(synthetic_batches(cfg, 2, 3, seed=3)), (fs.mixed_precision(),)
    plain = _losses(model, loss_fn, batches, ts, False)
    torch._dynamo.reset()
    counters.clear()
    compiled = _losses(model, loss_fn, batches, ts, {"backend": "aot_eager"})
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # training, and eval (no grad)
    assert plain[:2] == compiled[:2] and all(torch.equal(plain[2][n], compiled[2][n]) for n in plain[2]), which


def test_a_bad_compile_argument_names_the_fix():
    with pytest.raises(fs.errors.ArgumentTypeError, match=r"pass True \(torch.compile"):
        fs.compose(_call, compile="max-autotune")
