"""Training-step benchmark: DDP vs FSDP2 vs fshard on the example GPT, measured in ONE run.

Run it under the shared benchmark lock (other engineers time things on the same 2 cores)::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/step.py
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/step.py --configs ddp,fsdp2 --rounds 3
    flock /tmp/fshard-bench.lock .venv/bin/torchrun --nproc-per-node 2 benchmarks/step.py   # same, via torchrun

The step-memory table of issue #18 (the 117M GPT, fshard from the meta device, DDP / FSDP2 / fshard with and
without transforms and donation; peak RSS against FSDP2's and against DDP's minus 0.8 x the ZeRO-3 savings)::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/step.py --memory --rounds 3

Defaults (the setting of /work/shared/ANCHORS.md): world size 2 on gloo, 1 thread per rank, batch 4 per rank,
``GPTConfig()`` (27.4M params), fp32, AdamW(fused=True) / ``fs.adamw`` with betas (0.9, 0.95), weight decay 0.1.

Every config starts from the same weights (``torch.manual_seed(seed); GPT(cfg)``) and sees the same batches, so
their losses are printed side by side as a sanity check. Configs are run round-robin for ``--rounds`` rounds
(each round: build, ``--warmup`` untimed steps, ``--steps`` timed steps, tear down) so that machine noise hits
all of them. A step's time is the slowest rank's; the figure quoted is the median over all timed steps.

Configs are pluggable: ``CONFIGS`` maps a name to a builder ``builder(ctx) -> Runner``. To add one::

    @register("fshard+gather_ahead(1)")
    def _(ctx):
        return fshard_runner(ctx, fs.gather_ahead(1))   # transforms go to fs.compose(loss_fn, *transforms)

and pass ``--configs ddp,fsdp2,fshard,fshard+gather_ahead(1)``. Ratios are printed for every config against
``fsdp2`` and ``ddp``; per-phase profiles for every config whose metrics carry ``time/*`` keys (fshard's).

By default every (round, config) pair runs in freshly spawned processes, so that no config inherits another's
heap (glibc keeps freed memory, which skews both the next config's peak RSS and its page-fault cost). Under
torchrun, or with --in-process, everything runs in one set of processes (freed memory is handed back with
malloc_trim between configs, but RSS figures are then only indicative).

Peak RSS per rank is the VmHWM of each config's training steps alone (reset through /proc/self/clear_refs after
the build), the max over rounds; the build's own peak and the RSS before the build are printed beside it.

Against an earlier commit (same-run A/B of fshard itself): ``--baseline DIR`` names a source tree of fshard, e.g. a
git worktree of the commit to compare against, and a config listed as ``base:X`` (X any fshard config) runs X's
builder from THIS file with the package ``fshard`` (fshard.ops, fshard.store, ... and the native sources
``DIR/ops`` the JIT build compiles) imported from DIR instead of this checkout; the model (examples/gpt.py) and
everything else stay this checkout's, so only fshard differs::

    git worktree add --detach /tmp/fshard_base HEAD      # before the change; leave it in place
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/step.py --baseline /tmp/fshard_base --rounds 5 \
        --configs "fshard,base:fshard,fshard+ahead+buckets,base:fshard+ahead+buckets"

Each ``base:X`` process puts DIR first on sys.path before anything imports fshard (so it wins over this checkout
and over the editable install), sets ``FSHARD_OPS_SRC=DIR/ops``, and checks that every loaded ``fshard*`` module
(and the ops sources) come from DIR; with --baseline, the plain configs are checked to come from this checkout the
same way. The log line of every round names where fshard came from. The summary adds ``X / base:X`` (ratio of the
medians, and per round: the round-robin makes each round's pair see the same machine state, so the spread of the
per-round ratios is the noise to judge the median ratio by) and the largest loss difference of each pair; --json
carries them as ``ratio_vs_base``/``round_ratios_vs_base`` and under ``baseline``. base: configs need fresh
processes per config (the default), not --in-process or torchrun: a process can import only one fshard.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpt import GPT, GPTConfig, loss_fn, synthetic_batches  # noqa: E402

BASE = "base:"  # prefix of a config run with fshard from --baseline DIR


# ---------------------------------------------------------------------------------------------------------------
# Config registry.


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    cfg: GPTConfig
    rank: int
    world_size: int

    def fresh_model(self) -> torch.nn.Module:
        """The same initial weights for every config."""
        torch.manual_seed(self.args.seed)
        return GPT(self.cfg)

    def fshard_model(self) -> tuple[torch.nn.Module, dict]:
        """The model fshard's configs build and fs.init's extra arguments: with --meta (implied by --memory) the
        model is built on the meta device and each unit is materialised by fs.init (GPT-2 init, seeded), as a user
        would build a model that does not fit one rank; otherwise the peers' CPU model."""
        if not self.args.meta:
            return self.fresh_model(), {}
        from gpt import init_weights

        return GPT(self.cfg, device="meta"), dict(init_fn=init_weights, seed=self.args.seed)


@dataclasses.dataclass
class Runner:
    step: Callable[[Any], tuple[float, dict]]  # batch -> (loss on this rank or mean over ranks, metrics dict)
    close: Callable[[], None] = lambda: None
    loss_is_global: bool = False  # True when step() already returns the mean over ranks


CONFIGS: dict[str, Callable[[Ctx], Runner]] = {}


def register(name: str):
    def deco(fn):
        CONFIGS[name] = fn
        return fn

    return deco


def _adamw_kwargs(args) -> dict:
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _torch_runner(ctx: Ctx, model: torch.nn.Module, scaler=None, autocast: torch.dtype | None = None) -> Runner:
    """The peers' step: the wrapped model and torch.optim.AdamW(fused=True); with ``scaler`` (a GradScaler),
    fp16's scale, unscale_, step and update; with ``autocast``, forward under ``torch.autocast`` in that dtype."""
    opt = torch.optim.AdamW(model.parameters(), fused=True, **_adamw_kwargs(ctx.args))
    cast = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast is not None else contextlib.nullcontext

    def step(batch):
        opt.zero_grad(set_to_none=True)
        with cast():
            loss = loss_fn(model, batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.item(), {}

    return Runner(step)


@register("ddp")
def ddp_runner(ctx: Ctx) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _torch_runner(ctx, DDP(ctx.fresh_model()))


# the plain loop, no wrapper (world size 1: what a one-rank step should cost, issue #42), and bf16 autocast peers
register("torch")(lambda ctx: _torch_runner(ctx, ctx.fresh_model()))
register("torch+bf16")(lambda ctx: _torch_runner(ctx, ctx.fresh_model(), autocast=torch.bfloat16))


@register("ddp+bf16")
def _ddp_bf16(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _torch_runner(ctx, DDP(ctx.fresh_model()), autocast=torch.bfloat16)


@register("fsdp2")
def fsdp2_runner(ctx: Ctx, prefetch: int = 0, scaler=None, compile_blocks: bool = False,
                 **fully_shard_kwargs) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = ctx.fresh_model()
    if compile_blocks:
        _compiled_blocks(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    if prefetch:  # FSDP2's explicit prefetch: the next `prefetch` blocks in forward, the previous ones in backward
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])
    return _torch_runner(ctx, model, scaler)


register("fsdp2+prefetch(2)")(lambda ctx: fsdp2_runner(ctx, prefetch=2))


def _compiled_blocks(model):
    """Each block compiled in place (``module.compile()``), as torchtitan does before ``fully_shard``."""
    for block in model.blocks:
        block.compile()
    return model


register("fsdp2+compile")(lambda ctx: fsdp2_runner(ctx, compile_blocks=True))  # torchtitan: compiled, then sharded


@register("ddp+compile")
def _ddp_compile(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _torch_runner(ctx, DDP(_compiled_blocks(ctx.fresh_model())))


def _fsdp2_bf16(ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return fsdp2_runner(ctx, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


register("fsdp2+bf16")(_fsdp2_bf16)  # FSDP2's mixed precision: bf16 gathers and compute, fp32 reduce


@register("fsdp2+fp16")
def _fsdp2_fp16(ctx):  # fp16 gathers and compute, fp32 reduce, and ShardedGradScaler (GradScaler for shards)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return fsdp2_runner(ctx, scaler=ShardedGradScaler(device="cpu"),
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))


def autocast_loss_fn(module, batch):
    """``loss_fn`` under ``torch.autocast("cpu", bfloat16)``, as the torch peers' bf16 step runs it: DDP's way of
    mixed precision (fp32 parameters, each op cast by autocast) inside an fshard step."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return loss_fn(module, batch)


def fshard_runner(ctx: Ctx, *transforms, init_kwargs: dict | None = None, opt_kwargs: dict | None = None,
                  env: dict | None = None, optimizer: Callable | None = None, loss: Callable | None = None,
                  **compose_kwargs) -> Runner:
    """fshard: ``fs.init`` + ``fs.compose(loss_fn, *transforms, **compose_kwargs)`` (e.g. ``donate=True``);
    ``loss`` replaces ``loss_fn`` (``autocast_loss_fn``);
    ``opt_kwargs`` go to ``fs.adamw`` on top of the shared hyper-parameters (e.g. ``impl="fused"``), or
    ``optimizer(ctx)`` makes another optimizer (benchmarks/optim.py's Muon); ``env`` is set while the config runs
    (e.g. ``FSHARD_GATHER``)."""
    import fshard as fs

    saved_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})

    for name in ("Mesh", "adamw", "init", "compose"):
        if not hasattr(fs, name):
            raise RuntimeError(f"fshard has no {name!r} yet (core API not landed)")
    mesh = fs.Mesh.from_env()  # reuses the process group this script initialised
    opt = optimizer(ctx) if optimizer is not None else fs.adamw(**{**_adamw_kwargs(ctx.args), **(opt_kwargs or {})})
    if ctx.rank == 0 and hasattr(opt, "resolved_impl"):
        print(f"[step.py] fs.adamw implementation: {opt.resolved_impl(mesh.device)}", flush=True)
    model, meta_kwargs = ctx.fshard_model()
    state = fs.init(model, mesh, opt, **{**meta_kwargs, **(init_kwargs or {})})
    del model
    step_fn = fs.compose(loss or loss_fn, *transforms, **compose_kwargs)
    holder = {"state": state}

    def step(batch):
        holder["state"], metrics = step_fn(holder["state"], batch)
        return float(metrics["loss"]), metrics

    def close():
        holder.clear()
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    return Runner(step, close, loss_is_global=True)


register("fshard")(lambda ctx: fshard_runner(ctx))
register("fshard+donate")(lambda ctx: fshard_runner(ctx, donate=True))  # update in place, no state copy
register("fshard+torch_fused_adamw")(lambda ctx: fshard_runner(ctx, opt_kwargs=dict(impl="fused")))
# the blocking gather as the core landed it (#2): one all_gather_single per unit, not gloo's faster broadcasts
register("fshard(all_gather)")(lambda ctx: fshard_runner(ctx, env={"FSHARD_GATHER": "all_gather"}))


def _gather_ahead(depth, **kw):
    import fshard as fs
    return fs.gather_ahead(depth, **kw)


register("fshard+gather_ahead(1)")(lambda ctx: fshard_runner(ctx, _gather_ahead(1)))
register("fshard+gather_ahead(2)")(lambda ctx: fshard_runner(ctx, _gather_ahead(2)))
def _ahead_buckets(keep=False, bucket_mb=25):
    import fshard as fs
    return fs.gather_ahead(2, reshard_after_forward=not keep), fs.bucket_reduce(bucket_mb)


register("fshard+ahead+buckets")(lambda ctx: fshard_runner(ctx, *_ahead_buckets()))
# torch.compile of each unit's forward (fs.compose(compile=True)): against fsdp2+compile / ddp+compile
register("fshard+compile")(lambda ctx: fshard_runner(ctx, compile=True))
register("fshard+ahead+buckets+compile")(lambda ctx: fshard_runner(ctx, *_ahead_buckets(), compile=True))
register("fshard+ahead+buckets+donate")(lambda ctx: fshard_runner(ctx, *_ahead_buckets(), donate=True))


def units_of(ctx, parts: tuple = ("",), head: bool = False) -> dict:
    """fs.init's units by block: each block's ``parts`` (``""``: the block itself; ``("attn", "mlp")``: its attention
    and its MLP, the block's norms then in the root), and with ``head`` the output layer (``lm_head``) a unit of its
    own, as torchtitan shards it apart from the root (an untied head only: a tied one is in the root whatever the
    units). Finer units make gradients ready sooner: a head's is backward's first, reduced while the blocks run
    instead of with the embeddings' at the end; a block's MLP's while its attention's backward runs."""
    units = [f"blocks.{i}" + (f".{p}" if p else "") for i in range(ctx.cfg.n_layers) for p in parts]
    return dict(units=units + (["lm_head"] if head else []))


register("fshard+ahead+buckets+head+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), donate=True, init_kwargs=units_of(ctx, head=True)))
register("fshard+ahead+buckets+halves+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), donate=True, init_kwargs=units_of(ctx, ("attn", "mlp"))))
# check_collectives=False: no collective checked across ranks before it is issued (the default checks every step on
# CPU meshes; fshard/dist/_agreement.py). (Measured until issue #39 with False meaning "the first step only".)
register("fshard+unchecked")(lambda ctx: fshard_runner(ctx, check_collectives=False))
register("fshard+ahead+buckets+unchecked")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), check_collectives=False))
register("fshard+ahead+buckets+unchecked+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), check_collectives=False, donate=True))
def _bf16(copies=False):  # copies: persistent bf16 copies written by the update, instead of a cast per gather
    import fshard as fs
    return fs.mixed_precision(torch.bfloat16, torch.float32, param_copies=copies)


def _fp16(copies=False):
    import fshard as fs
    return fs.mixed_precision(torch.float16, torch.float32, param_copies=copies)


def _clip():
    import fshard as fs
    return fs.clip_by_global_norm(1.0)


register("fshard+bf16")(lambda ctx: fshard_runner(ctx, _bf16()))
# bf16 the DDP way: fp32 state and gathers, torch.autocast inside loss_fn (against torch+bf16 / ddp+bf16)
register("fshard+autocast+donate")(lambda ctx: fshard_runner(ctx, donate=True, loss=autocast_loss_fn))
register("fshard+ahead+buckets+autocast+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), donate=True, loss=autocast_loss_fn))
register("fshard+bf16+donate")(lambda ctx: fshard_runner(ctx, _bf16(), donate=True))
register("fshard+ahead+buckets+bf16")(lambda ctx: fshard_runner(ctx, *_ahead_buckets(), _bf16()))
register("fshard+ahead+buckets+bf16+donate")(lambda ctx: fshard_runner(ctx, *_ahead_buckets(), _bf16(), donate=True))
register("fshard+ahead+buckets+bf16+copies+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), _bf16(copies=True), donate=True))
register("fshard+ahead+buckets+fp16+copies+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), _fp16(copies=True), donate=True))
register("fshard+ahead+buckets+fp16+donate")(  # dynamic loss scaling, the scale in the state
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), _fp16(), donate=True))
register("fshard+ahead+buckets+bf16+clip+donate")(  # the global norm: fshard.ops.sq_norm and one all-reduce
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(), _bf16(), _clip(), donate=True))
register("fshard+ahead+buckets+keep")(lambda ctx: fshard_runner(ctx, *_ahead_buckets(keep=True)))
register("fshard+ahead+buckets+keep+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(keep=True), donate=True))
register("fshard+ahead+buckets+keep+unchecked+donate")(
    lambda ctx: fshard_runner(ctx, *_ahead_buckets(keep=True), check_collectives=False, donate=True))
def _split_units(ctx):
    """Blocks, and the embedding and the head as units of their own: the head's gradient is then reduced at
    the start of backward instead of with the embedding's at its end (the root keeps only pos_emb and ln_f)."""
    return dict(units=[f"blocks.{i}" for i in range(ctx.cfg.n_layers)] + ["tok_emb", "lm_head"])


for _mb in (8, 25):
    register(f"fshard+ahead+buckets{_mb}+keep+donate+split")(
        lambda ctx, mb=_mb: fshard_runner(ctx, *_ahead_buckets(keep=True, bucket_mb=mb), donate=True,
                                          init_kwargs=_split_units(ctx)))
register("fshard+gather_ahead(2)+split")(
    lambda ctx: fshard_runner(ctx, _gather_ahead(2), init_kwargs=_split_units(ctx)))
register("fshard+gather_ahead(2)+keep")(  # reshard_after_forward=False: one gather per unit per step
    lambda ctx: fshard_runner(ctx, _gather_ahead(2, reshard_after_forward=False)))


# ---------------------------------------------------------------------------------------------------------------
# Measurement helpers.


def _release_free_memory() -> None:
    """Hand memory that earlier configs freed back to the OS (glibc keeps it otherwise), so that each config's
    peak RSS is its own and not the high-water mark of whatever ran before it in this process."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ---------------------------------------------------------------------------------------------------------------
# Baseline (--baseline DIR, configs named base:X): fshard from another source tree.


def _is_base(name: str) -> bool:
    return name.startswith(BASE)


def _builder(name: str) -> Callable[[Ctx], Runner]:
    """The builder of ``name``; ``base:X`` uses X's builder from this file (only the fshard it imports differs)."""
    return CONFIGS[name[len(BASE):] if _is_base(name) else name]


def _under(path: str, root: str) -> bool:
    p, r = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([p, r]) == r


def _enter_baseline(args) -> None:
    """In a process that will run only base: configs, before anything imports fshard: import it from DIR."""
    loaded = sorted(m for m in sys.modules if m == "fshard" or m.startswith("fshard."))
    if loaded:
        raise RuntimeError(f"[step.py] fshard already imported before switching to the baseline: {loaded}")
    sys.path.insert(0, args.baseline)  # ahead of ROOT and of the editable install's finder (on sys.meta_path's end)
    ops = os.path.join(args.baseline, "ops")
    if os.path.isdir(ops):
        os.environ["FSHARD_OPS_SRC"] = ops  # the baseline's native sources, whatever the caller's environment says
    else:
        os.environ.pop("FSHARD_OPS_SRC", None)


def _fshard_source(args, name: str) -> str:
    """Where this process's fshard was imported from (for the log). For ``base:`` configs, and for all configs
    when --baseline is given, raise if any loaded ``fshard*`` module (or the ops sources) is not from the tree
    the config must use: DIR for ``base:X``, this checkout otherwise."""
    mod = sys.modules.get("fshard")
    if mod is None or getattr(mod, "__file__", None) is None:
        return "no fshard"
    want = args.baseline if _is_base(name) else ROOT
    build = sys.modules.get("fshard.ops._build")
    src = getattr(build, "SRC_DIR", None)
    bad = [f"{m}: {getattr(mod_, '__file__', None)}" for m, mod_ in list(sys.modules.items())
           if (m == "fshard" or m.startswith("fshard.")) and getattr(mod_, "__file__", None)
           and (not _under(mod_.__file__, want)
                or (not _is_base(name) and args.baseline and _under(mod_.__file__, args.baseline)
                    and not _under(ROOT, args.baseline)))]  # DIR nested inside this checkout
    if src is not None and _is_base(name) and not _under(str(src), want):
        bad.append(f"fshard.ops._build.SRC_DIR: {src}")
    if bad and (_is_base(name) or args.baseline):
        raise RuntimeError(f"[step.py] {name} must import fshard from {want}, but: " + "; ".join(bad))
    return f"fshard from {os.path.dirname(mod.__file__)}" + (f", ops sources {src}" if src is not None else "")


# ---------------------------------------------------------------------------------------------------------------
# The per-rank benchmark.


def worker(rank: int, world_size: int, args: argparse.Namespace, port: int | None = None,
           names: list[str] | None = None, first_round: int = 0, out: str | None = None) -> None:
    """Run ``names`` (default: all of --configs) for rounds ``first_round ..``; report, or with ``out`` write the
    per-rank results there (a pickle, rank 0) for the parent to merge."""
    if port is not None:  # launched by mp.spawn: give this rank the env torchrun would have given it
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
    names = names or _config_names(args)
    if any(_is_base(n) for n in names):
        if any(n.startswith("fshard") for n in names):
            raise SystemExit("[step.py] base: and current fshard configs cannot share a process (one fshard each)")
        _enter_baseline(args)
    import faulthandler

    faulthandler.enable()  # a native abort (e.g. in gloo) then shows where Python was
    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = _model_config(args)
    ctx = Ctx(args, cfg, rank, world_size)
    n_total = args.warmup + args.steps
    batches = list(synthetic_batches(cfg, args.batch_size, n_total, args.seed, rank, world_size))
    n_rounds = args.rounds - first_round if out is None else 1
    rss_resettable = _reset_peak_rss()

    times: dict[str, list[list[float]]] = {n: [] for n in names}  # per round, per timed step
    losses: dict[str, list[float]] = {}  # round 0, every step (this rank's, or global)
    loss_global: dict[str, bool] = {}
    phases: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    peak: dict[str, int] = {n: 0 for n in names}
    base: dict[str, int] = {n: 0 for n in names}  # RSS right before the build, at the run where peak was taken
    bpeak: dict[str, int] = {n: 0 for n in names}  # peak RSS while building (fs.init, DDP(...), fully_shard)
    failed: dict[str, str] = {}
    origin: dict[str, str] = {}  # where fshard came from, per config
    log = print if rank == 0 else (lambda *a, **k: None)
    if out is None:
        log(_header(args, cfg, world_size, "one process per rank for all configs"), flush=True)

    for rnd in range(first_round, first_round + n_rounds):
        for name in names:
            if name in failed:
                continue
            _release_free_memory()
            _reset_peak_rss()
            base_rss = _current_rss_bytes()
            dist.barrier()
            err = None
            runner = None
            try:
                runner = _builder(name)(ctx)
                _fshard_source(args, name)  # check before timing anything
                build_peak = _peak_rss_bytes()
                _reset_peak_rss()  # from here on: the peak of the training steps alone
                step_losses, step_times = [], []
                for i in range(n_total):
                    if i == args.warmup:
                        dist.barrier()
                    t0 = time.perf_counter()
                    loss, metrics = runner.step(batches[i])
                    dt = time.perf_counter() - t0
                    step_losses.append(loss)
                    if i >= args.warmup:
                        step_times.append(dt)
                        for k, v in metrics.items():
                            if k.startswith(("time/", "mem/", "comm/", "gather/")) and isinstance(v, (int, float)):
                                phases[name].setdefault(k, []).append(float(v))
                times[name].append(step_times)
                origin[name] = _fshard_source(args, name)  # again: lazily imported modules are loaded by now
                if rnd == 0:
                    losses[name], loss_global[name] = step_losses, runner.loss_is_global
            except Exception as e:  # noqa: BLE001 -- report and go on with the other configs
                import traceback

                err = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            finally:
                if runner is not None:
                    runner.close()
                del runner
                gc.collect()
            # every rank learns whether any rank failed, so nobody waits forever in a collective
            errs: list = [None] * world_size
            dist.all_gather_object(errs, err)
            if any(errs):
                failed[name] = next(e for e in errs if e)
                log(f"[step.py] {name}: FAILED, skipped from now on:\n{failed[name]}", flush=True)
                continue
            p = _peak_rss_bytes()
            if p > peak[name]:
                peak[name], base[name] = p, base_rss
            bpeak[name] = max(bpeak[name], build_peak)
            log(f"[step.py] round {rnd} {name}: median {statistics.median(times[name][-1]):.3f} s/step "
                f"(rank 0), last loss {step_losses[-1]:.4f} (rank 0's); {origin[name]}", flush=True)

    # ---- gather everything to rank 0 and report -------------------------------------------------------------
    mine = dict(times=times, losses=losses, loss_global=loss_global, phases=phases, peak=peak, base=base, bpeak=bpeak,
                origin=origin)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        if out is None:
            report(args, cfg, world_size, names, failed, everyone, rss_resettable)
        else:
            import pickle

            with open(out, "wb") as f:
                pickle.dump(dict(everyone=everyone, failed=failed, rss_resettable=rss_resettable), f)
    dist.barrier()
    dist.destroy_process_group()


def report(args, cfg, world_size, names, failed, everyone, rss_resettable) -> None:
    ok = [n for n in names if n not in failed]
    result: dict[str, Any] = {"world_size": world_size, "batch_per_rank": args.batch_size, "threads": args.threads,
                              "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
                              "git": _git_head(), "configs": {}}
    if args.baseline:
        result["baseline"] = {"dir": args.baseline, "git": _git_head(args.baseline), "ratios": {}}
    w = max([28] + [len(n) for n in names])
    print("\n=== Training step, world size %d, gloo, %d thread(s)/rank, batch %d/rank, %s ==="
          % (world_size, args.threads, args.batch_size, _model_name(args, cfg)))
    print(f"{'config':{w}s} {'median s':>9s} {'min s':>7s} {'max s':>7s}  {'per-round medians':28s} "
          f"{'last loss':>11s}  peak RSS per rank during the steps")
    med: dict[str, float] = {}
    rmed: dict[str, list[float]] = {}  # per-round medians
    for n in ok:
        # a step's time is the slowest rank's
        rounds = [[max(r["times"][n][k][i] for r in everyone) for i in range(len(everyone[0]["times"][n][k]))]
                  for k in range(len(everyone[0]["times"][n]))]
        flat = [t for rd in rounds for t in rd]
        med[n] = statistics.median(flat)
        rmed[n] = [statistics.median(rd) for rd in rounds]
        per_round = ", ".join(f"{statistics.median(rd):.3f}" for rd in rounds)
        if everyone[0]["loss_global"][n]:
            loss_curve = everyone[0]["losses"][n]
        else:
            loss_curve = [sum(r["losses"][n][i] for r in everyone) / world_size
                          for i in range(len(everyone[0]["losses"][n]))]
        peaks = [r["peak"][n] for r in everyone]
        bases = [r["base"][n] for r in everyone]
        bpeaks = [r["bpeak"][n] for r in everyone]
        print(f"{n:{w}s} {med[n]:9.3f} {min(flat):7.3f} {max(flat):7.3f}  {per_round:28s} {loss_curve[-1]:11.6f}  "
              + " / ".join(_fmt_bytes(p) for p in peaks)
              + "  (build: " + " / ".join(_fmt_bytes(b) for b in bpeaks)
              + "; before build: " + " / ".join(_fmt_bytes(b) for b in bases) + ")")
        result["configs"][n] = {"median_s": med[n], "min_s": min(flat), "max_s": max(flat),
                                "round_medians_s": [statistics.median(rd) for rd in rounds], "step_s": rounds,
                                "loss_curve": loss_curve, "peak_rss_bytes": peaks,
                                "rss_before_build_bytes": bases, "peak_rss_build_bytes": bpeaks}
        if everyone[0].get("origin", {}).get(n):
            result["configs"][n]["fshard_source"] = everyone[0]["origin"][n]
    if not rss_resettable:
        print("(peak RSS: /proc/self/clear_refs unavailable, figures are process-wide maxima)")
    for n, e in failed.items():
        print(f"{n:{w}s} FAILED: {e.splitlines()[0]}")
        result["configs"][n] = {"error": e}

    if args.memory:
        _memory_table(args, cfg, world_size, ok, result)

    base_losses = {n: result["configs"][n]["loss_curve"] for n in ok}
    if "ddp" in base_losses:
        print("\nmax |loss - ddp loss| over the first round's steps:")
        for n in ok:
            if n != "ddp":
                d = max(abs(a - b) for a, b in zip(base_losses[n], base_losses["ddp"]))
                print(f"  {n:26s} {d:.3g}")
                result["configs"][n]["max_abs_loss_diff_vs_ddp"] = d

    print("\nratios (median step time):")
    for n in ok:
        for base in ("fsdp2", "ddp"):
            if base in med and n != base and not (n == "ddp" and base == "fsdp2"):
                print(f"  {n} / {base} = {med[n] / med[base]:.3f}")
                result["configs"][n][f"ratio_vs_{base}"] = med[n] / med[base]

    pairs = [(n, BASE + n) for n in ok if BASE + n in med]
    if pairs:
        print(f"\nagainst the baseline {args.baseline} (git {result['baseline']['git']}): current / baseline, "
              "median step time; per-round ratios (the noise); max |loss difference| over the first round:")
        for n, b in pairs:
            r = med[n] / med[b]
            per_round = [c / p for c, p in zip(rmed[n], rmed[b])]
            dloss = max(abs(x - y) for x, y in zip(base_losses[n], base_losses[b]))
            print(f"  {n} / {b} = {r:.3f}   per round: " + ", ".join(f"{x:.3f}" for x in per_round)
                  + (f" (min {min(per_round):.3f}, max {max(per_round):.3f})" if len(per_round) > 1 else "")
                  + f"   loss diff {dloss:.3g}")
            result["configs"][n].update(ratio_vs_base=r, round_ratios_vs_base=per_round,
                                        max_abs_loss_diff_vs_base=dloss)
            result["baseline"]["ratios"][n] = r
    for n in names:
        if _is_base(n) and n[len(BASE):] not in names:
            print(f"  ({n}: no {n[len(BASE):]} in --configs to compare with)")

    for n in ok:
        order = ["check", "gather", "gather_exposed", "compute", "reduce", "control", "update", "step"]
        keys = sorted({k for r in everyone for k in r["phases"].get(n, {}) if k.startswith("time/")},
                      key=lambda k: (order.index(k[5:]) if k[5:] in order else len(order), k))
        if not keys:
            continue
        print(f"\n{n} per-phase seconds per step (median over timed steps), by rank; share of the step median:")
        prof = {}
        for k in keys:
            vals = [statistics.median(r["phases"][n][k]) if r["phases"][n].get(k) else float("nan") for r in everyone]
            prof[k] = vals
            share = max(vals) / med[n] * 100
            print(f"  {k:34s} " + "  ".join(f"r{i}: {v:7.4f}" for i, v in enumerate(vals)) + f"   ({share:4.1f}%)")
        result["configs"][n]["phases_s"] = prof
        other = sorted({k for r in everyone for k in r["phases"].get(n, {}) if not k.startswith("time/")})
        for k in other:
            vals = [statistics.median(r["phases"][n][k]) if r["phases"][n].get(k) else float("nan") for r in everyone]
            if k.startswith(("mem/", "comm/")):
                print(f"  {k:34s} " + "  ".join(f"r{i}: {v / 2**20:7.1f} MiB" for i, v in enumerate(vals)))
            else:
                print(f"  {k:34s} " + "  ".join(f"r{i}: {v:7.3f}" for i, v in enumerate(vals)))
            result["configs"][n].setdefault("metrics", {})[k] = vals

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")


def _memory_table(args, cfg, world_size, ok, result) -> None:
    """Peak RSS per rank (the larger rank's) against the targets of issue #18."""
    n_params = GPT(cfg, device="meta").num_params()
    saved = 16 * n_params * (1 - 1 / world_size)  # param + grad + 2 moments, fp32: what ZeRO-3 shards away per rank
    peak = {n: max(result["configs"][n]["peak_rss_bytes"]) for n in ok}
    mib = 2**20
    print(f"\nstep memory, {n_params:,} parameters: peak RSS per rank during the steps (max over ranks); ZeRO-3 "
          f"saves {saved / mib:.0f} MiB of state per rank at world size {world_size}")
    target = peak["ddp"] - 0.8 * saved if "ddp" in peak else None
    if target is not None:
        print(f"target: <= fsdp2's peak, and <= ddp - 0.8 x saved = {target / mib:.0f} MiB")
    print(f"  {'config':32s} {'peak MiB':>9s} {'/ fsdp2':>8s} {'ddp - peak':>11s} {'of saved':>9s} {'s/step':>7s}")
    for n in ok:
        vs_f = f"{peak[n] / peak['fsdp2']:8.3f}" if "fsdp2" in peak else f"{'':8s}"
        less = f"{(peak['ddp'] - peak[n]) / mib:11.0f} {(peak['ddp'] - peak[n]) / saved:9.0%}" if "ddp" in peak else ""
        print(f"  {n:32s} {peak[n] / mib:9.0f} {vs_f} {less} {result['configs'][n]['median_s']:7.3f}")
        result["configs"][n]["peak_rss_max_bytes"] = peak[n]
    result["memory"] = {"params": n_params, "zero3_saved_bytes": saved, "target_bytes": target}


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default="ddp,fsdp2,fshard",
                   help=f"comma-separated, from {sorted(CONFIGS)}; base:X for fshard config X from --baseline DIR")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per config per round")
    p.add_argument("--steps", type=int, default=10, help="timed steps per config per round")
    p.add_argument("--rounds", type=int, default=2, help="round-robin repetitions of the whole config list")
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="GPTConfig.tiny() instead of the 27.4M default (smoke test)")
    p.add_argument("--model", choices=sorted(MODELS), default="27m",
                   help="the GPT: 27m (the anchor: vocab 8192, dim 512, 6 layers, 8 heads, seq 128) or 117m (dim "
                        "1024, 8 layers, 16 heads; --memory's); --tiny overrides it")
    p.add_argument("--meta", action="store_true",
                   help="fshard's configs build the model on the meta device and fs.init materialises it unit by unit "
                        "(init_fn=gpt.init_weights, seed=--seed); the peers build it on the CPU")
    p.add_argument("--memory", action="store_true",
                   help="the step-memory table of issue #18: the 117M GPT (dim 1024, 8 layers, 16 heads, vocab "
                        "8192, seq 128), --meta, configs " + MEMORY_CONFIGS + " unless --configs is given, "
                        "2 warmup + 4 timed steps, 1 round; prints peak RSS per rank against FSDP2's and against "
                        "DDP's minus 0.8 x the state bytes ZeRO-3 saves (16 bytes/param x (1 - 1/world size))")
    p.add_argument("--in-process", action="store_true",
                   help="run all rounds and configs in one set of processes, as under torchrun (faster start). The "
                        "default spawns fresh processes per round and config, so that configs share no allocator "
                        "state or peak RSS")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="a source tree of fshard to compare against (e.g. a git worktree of an earlier commit): a "
                        "config listed as base:X runs X with the package fshard imported from DIR (this file's "
                        "builders and model); the summary adds X / base:X")
    given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
    args = p.parse_args(argv)
    if args.memory:
        args.meta = True
        for flag, value in (("--configs", MEMORY_CONFIGS), ("--warmup", 2), ("--steps", 4), ("--rounds", 1)):
            if flag not in given:
                setattr(args, flag[2:], value)
    if args.baseline:
        args.baseline = os.path.realpath(args.baseline)
        if not os.path.isfile(os.path.join(args.baseline, "fshard", "__init__.py")):
            p.error(f"--baseline {args.baseline}: no fshard/__init__.py there")
    return args


MODELS = {"27m": {}, "117m": dict(dim=1024, n_layers=8, n_heads=16)}  # GPTConfig overrides: 27.4M and 117.7M
MEMORY_CONFIGS = "ddp,fsdp2,fshard,fshard+ahead+buckets,fshard+donate,fshard+ahead+buckets+donate"


def _model_config(args) -> GPTConfig:
    if args.tiny:
        return GPTConfig.tiny()
    if args.memory:
        return GPTConfig(**MODELS["117m"])  # 117,680,128 parameters
    return GPTConfig(**MODELS[args.model])


def _model_name(args, cfg) -> str:
    n = GPT(cfg, device="meta").num_params()
    return "tiny GPT" if args.tiny else f"GPT {n / 1e6:.1f}M" + (" (fshard from the meta device)" if args.meta else "")


def _config_names(args) -> list[str]:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if (n[len(BASE):] if _is_base(n) else n) not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {sorted(CONFIGS)} (and base:X for fshard ones)")
    based = [n for n in names if _is_base(n)]
    if based and not args.baseline:
        raise SystemExit(f"configs {based} need --baseline DIR")
    not_fshard = [n for n in based if not n[len(BASE):].startswith("fshard")]
    if not_fshard:
        raise SystemExit(f"base: is for fshard configs only, not {not_fshard}")
    return names


def _git_head(root: str = ROOT) -> str:
    import subprocess

    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _header(args, cfg, world_size, how) -> str:
    return (f"[step.py] git {_git_head()} torch {torch.__version__}\n"
            f"[step.py] world={world_size} threads/rank={args.threads} batch/rank={args.batch_size} cfg={cfg} "
            f"params={GPT(cfg, device='meta').num_params():,} configs={_config_names(args)} rounds={args.rounds} "
            f"warmup={args.warmup} steps={args.steps} ({how})"
            + (f"\n[step.py] baseline (base: configs): fshard from {args.baseline}, git {_git_head(args.baseline)}"
               if args.baseline else ""))


def run_isolated(args) -> None:
    """Each (round, config) in fresh processes: no allocator state or heap high-water mark carries over from one
    config to the next, so timings and peak RSS are each config's own. Results come back through a pickle."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    names = _config_names(args)
    cfg = _model_config(args)
    print(_header(args, cfg, args.world_size, "fresh processes for every round and config"), flush=True)
    merged: list[dict] | None = None
    failed: dict[str, str] = {}
    resettable = True
    with tempfile.TemporaryDirectory(prefix="fshard-step-") as tmp:
        for rnd in range(args.rounds):
            for name in names:
                if name in failed:
                    continue
                out = os.path.join(tmp, f"r{rnd}-{len(os.listdir(tmp))}.pkl")
                try:
                    mp.spawn(worker, args=(args.world_size, args, _free_port(), [name], rnd, out),
                             nprocs=args.world_size, join=True)
                except Exception as e:  # noqa: BLE001
                    if not os.path.exists(out):
                        failed[name] = f"{type(e).__name__}: {e}"
                        print(f"[step.py] round {rnd} {name}: processes failed: {e}", flush=True)
                        continue
                    print(f"[step.py] round {rnd} {name}: results saved, then a rank died at teardown: {e}",
                          flush=True)
                with open(out, "rb") as f:
                    part = pickle.load(f)
                resettable &= part["rss_resettable"]
                failed.update(part["failed"])
                if merged is None:
                    merged = part["everyone"]
                    continue
                for dst, src in zip(merged, part["everyone"]):
                    for key in ("times", "phases"):
                        for n, v in src[key].items():
                            if key == "times":
                                dst[key].setdefault(n, []).extend(v)
                            else:
                                dst[key].setdefault(n, {})
                                for k, vals in v.items():
                                    dst[key].setdefault(n, {}).setdefault(k, []).extend(vals)
                    for key in ("losses", "loss_global"):
                        for n, v in src[key].items():
                            dst[key].setdefault(n, v)
                    for n, v in src.get("origin", {}).items():
                        dst.setdefault("origin", {}).setdefault(n, v)
                    for n, p in src["peak"].items():
                        if p > dst["peak"].get(n, 0):
                            dst["peak"][n], dst["base"][n] = p, src["base"][n]
                        dst["bpeak"][n] = max(dst["bpeak"].get(n, 0), src["bpeak"][n])
    if merged is None:
        raise SystemExit("[step.py] no config produced results")
    report(args, cfg, args.world_size, names, failed, merged, resettable)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if any(_is_base(n) for n in _config_names(args)) and (args.in_process or "RANK" in os.environ):
        raise SystemExit("[step.py] base: configs need fresh processes per config (not --in-process or torchrun): "
                         "a process can import only one fshard")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: one set of processes for everything
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    elif not args.in_process:
        run_isolated(args)
    else:
        import torch.multiprocessing as mp

        mp.spawn(worker, args=(args.world_size, args, _free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
