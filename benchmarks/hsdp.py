"""HSDP benchmark (issue #41): bytes moved between simulated nodes, step time and peak RSS, on 4 ranks as 2 x 2.

Run it under the shared benchmark lock (timings need a quiet machine; the byte figures do not)::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/hsdp.py
    .venv/bin/python benchmarks/hsdp.py --quick          # tiny model, 2 steps: the byte figures in seconds

Four ranks on gloo, spawned as benchmarks/step.py does (``--quick``: forked, so that they inherit the parent's
imports of torch and fshard instead of making them again, four at once on a small machine), with the environment torchrun gives two nodes of two ranks
(``LOCAL_WORLD_SIZE=2``, ``LOCAL_RANK = rank % 2``, ``GROUP_RANK = rank // 2``): ranks {0, 1} are node 0 and
{2, 3} node 1. On the 27.4M GPT of benchmarks/step.py (same weights and batches for every config):

- ``fshard-1d``: ZeRO-3 over the 4 ranks (``fs.Mesh.from_env(shard_size=4)``);
- ``fshard-hsdp``: ``fs.Mesh.from_env()``, whose default is then one shard group a node (shard_size 2);
- ``ddp``: DistributedDataParallel (its all-reduces counted by a comm hook before the default all-reduce hook);
- ``fsdp2-hsdp``: ``fully_shard`` per block and on the model over ``init_device_mesh("cpu", (2, 2),
  mesh_dim_names=("replicate", "shard"))``;
- ``fsdp2-1d``: ``fully_shard`` over the 4 ranks, for reference.

fshard's configs run with ``fs.gather_ahead(2)`` and ``fs.bucket_reduce(25)`` (benchmarks/step.py's
``fshard+ahead+buckets``), the peers with torch.optim.AdamW(fused=True); the same hyper-parameters everywhere.

Bytes are MEASURED: torch.distributed's collectives (all_reduce, broadcast, reduce, all_gather,
all_gather_single/into_tensor, reduce_scatter_single/tensor, reduce_scatter, gather, scatter, all_to_all_single,
all_reduce_coalesced) are wrapped, in ``torch.distributed`` and in ``distributed_c10d`` (where the deprecated
names forward), and each call adds its size to the ranks of its group: the size of the collective, i.e. the buffer
every rank ends up with or contributes in full (all_reduce, broadcast, reduce: the tensor; all-gathers: the
output; reduce-scatters and all-to-alls: the input, what a rank sends; gather/scatter: a rank's tensor times the
group size), counted once per call (a wrapped function called inside another is not counted again). DDP's reducer calls its process group from C++,
so a comm hook counts each bucket and then runs torch's default ``allreduce_hook``. A group whose ranks lie on
both nodes is inter-node (the world group and, on 2 x 2, the replica groups {0, 2} and {1, 3}); a group within a
node is intra-node. Figures are rank 0's, per step, over the timed steps only (not the build, warm-up or
``step.plan``); every rank of these symmetric configs moves the same.

Step time: each step's slowest rank, median over the timed steps. Peak RSS: each rank's VmHWM during the steps
(reset after the build); all configs run one after another in the same four processes (freed memory handed back
with malloc_trim between them), or with ``--fresh`` each config in four new processes (slower to start, each
config's peak its own).

Printed: the table, each config's bytes by group, and the ratios fshard-hsdp inter-node bytes / ddp's (target
<= 1/k = 0.5) and fshard-hsdp step / fsdp2-hsdp step (target <= 1.0). ``--json PATH`` writes every figure.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpt import GPT, GPTConfig, loss_fn, synthetic_batches  # noqa: E402
from step import _free_port, _peak_rss_bytes, _release_free_memory, _reset_peak_rss  # noqa: E402

WORLD, NODE = 4, 2  # two simulated nodes of two ranks
CONFIGS = ("fshard-1d", "fshard-hsdp", "ddp", "fsdp2-hsdp", "fsdp2-1d")
HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# --- measuring the bytes -------------------------------------------------------------------------------------------

def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


# name -> the collective's size from its bound arguments (module docstring) and its group's size
_SIZE = {
    "all_reduce": lambda a, n: _nbytes(a["tensor"]),
    "broadcast": lambda a, n: _nbytes(a["tensor"]),
    "reduce": lambda a, n: _nbytes(a["tensor"]),
    "all_reduce_coalesced": lambda a, n: _nbytes(a["tensors"]),
    "all_gather": lambda a, n: _nbytes(a["tensor_list"]),
    "all_gather_single": lambda a, n: _nbytes(a["output_tensor"]),
    "all_gather_into_tensor": lambda a, n: _nbytes(a["output_tensor"]),
    "_all_gather_base": lambda a, n: _nbytes(a["output_tensor"]),
    "reduce_scatter_single": lambda a, n: _nbytes(a["input"]),
    "reduce_scatter_tensor": lambda a, n: _nbytes(a["input"]),
    "_reduce_scatter_base": lambda a, n: _nbytes(a["input"]),
    "reduce_scatter": lambda a, n: _nbytes(a["input_list"]),
    "all_to_all_single": lambda a, n: _nbytes(a["input"]),
    "gather": lambda a, n: _nbytes(a["tensor"]) * n,
    "scatter": lambda a, n: _nbytes(a["tensor"]) * n,
}


class Recorder:
    """Bytes per group (a tuple of global ranks) of the collectives called while ``on``; owned by the rank's main
    thread, added to from any thread (fshard's and DDP's) under a lock."""

    def __init__(self):
        self.on = False
        self.by_group: dict[tuple, int] = {}
        self.calls: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._inside = threading.local()  # a wrapped collective calling another is counted once
        self._ranks: dict[int, tuple] = {}

    def ranks(self, group) -> tuple:
        group = group if group is not None else dist.group.WORLD
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(group))
        return self._ranks[key]

    def add(self, name: str, group, nbytes: int) -> None:
        if not self.on:
            return
        ranks = self.ranks(group)
        with self._lock:
            self.by_group[ranks] = self.by_group.get(ranks, 0) + nbytes
            self.calls[(name, ranks)] = self.calls.get((name, ranks), 0) + 1

    @contextlib.contextmanager
    def inside(self):
        depth = getattr(self._inside, "depth", 0)
        self._inside.depth = depth + 1
        try:
            yield depth == 0
        finally:
            self._inside.depth = depth

    def wrap(self, name: str, fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            with self.inside() as outermost:
                if outermost and self.on:
                    bound = sig.bind(*args, **kwargs).arguments
                    group = bound.get("group")
                    self.add(name, group, _SIZE[name](bound, len(self.ranks(group))))
                return fn(*args, **kwargs)
        return counted

    def install(self) -> None:
        for name in _SIZE:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            counted = self.wrap(name, fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    setattr(module, name, counted)

    def reset(self) -> None:
        self.by_group.clear()
        self.calls.clear()


def split(by_group: dict) -> tuple[int, int]:
    """(inter-node, intra-node) bytes: a group with ranks on both nodes is inter-node."""
    inter = sum(b for ranks, b in by_group.items() if len({r // NODE for r in ranks}) > 1)
    return inter, sum(by_group.values()) - inter


# --- the configs ---------------------------------------------------------------------------------------------------

def _torch_step(model):
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HP)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss.item(), {}
    return step


def build(name: str, cfg: GPTConfig, seed: int, rec: Recorder):
    """``(step, plan, close)``: ``step(batch) -> (loss, metrics)``; ``plan(batch)`` the figures of fshard's
    ``step.plan`` (else None); ``close()`` ends the step's threads."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    if name.startswith("fshard"):
        import fshard as fs
        mesh = fs.Mesh.from_env(shard_size=WORLD) if name == "fshard-1d" else fs.Mesh.from_env()
        want = WORLD if name == "fshard-1d" else NODE
        if mesh.shard_size != want:
            raise RuntimeError(f"{name}: the mesh is {mesh}, expected shard groups of {want} ranks")
        state = {"s": fs.init(model, mesh, fs.adamw(**HP))}
        step_fn = fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(25))

        def step(batch):
            state["s"], m = step_fn(state["s"], batch)
            return float(m["loss"]), m
        return step, lambda batch: step_fn.plan(state["s"], batch).figures, step_fn.close
    if name == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)

        def hook(state, bucket):  # counted here, then torch's default: its dist.all_reduce is not counted again
            with rec.inside():
                rec.add("ddp_allreduce_hook", None, _nbytes(bucket.buffer()))
                return allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, hook)
        return _torch_step(ddp), None, lambda: None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = (init_device_mesh("cpu", (WORLD // NODE, NODE), mesh_dim_names=("replicate", "shard"))
            if name == "fsdp2-hsdp" else init_device_mesh("cpu", (WORLD,)))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _torch_step(model), None, lambda: None


# --- one rank ------------------------------------------------------------------------------------------------------

def worker(rank: int, args, port: int, names: list[str], out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % NODE), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(NODE), GROUP_RANK=str(rank // NODE), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    rec = Recorder()
    rec.install()
    dist.init_process_group("gloo")
    cfg = _config(args)
    batches = list(synthetic_batches(cfg, args.batch_size, args.warmup + args.steps, args.seed, rank, WORLD))
    results = {}
    for name in names:
        _release_free_memory()
        step, plan, close = build(name, cfg, args.seed, rec)
        planned = {k: v for k, v in plan(batches[0]).items() if k.startswith("comm/")} if plan else {}
        _reset_peak_rss()
        times, losses, metrics = [], [], {}
        for i, batch in enumerate(batches):
            if i == args.warmup:
                dist.barrier()
                rec.reset()
                rec.on = True
            t0 = time.perf_counter()
            loss, metrics = step(batch)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
        rec.on = False
        results[name] = dict(
            by_group={",".join(map(str, g)): b / args.steps for g, b in rec.by_group.items()},
            calls={f"{n}@{','.join(map(str, g))}": c / args.steps for (n, g), c in rec.calls.items()},
            times=times[args.warmup:], losses=losses, peak_rss=_peak_rss_bytes(),
            metrics={k: v for k, v in metrics.items() if k.startswith("comm/") and isinstance(v, (int, float))},
            planned=planned, params=sum(p.numel() for p in GPT(cfg, device="meta").parameters()))
        close()
        del step, plan, close
        dist.barrier()
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(everyone, f)
    dist.destroy_process_group()


# --- the report ----------------------------------------------------------------------------------------------------

def summarize(everyone: list[dict], names: list[str]) -> dict:
    summary = {}
    for name in names:
        r0 = everyone[0][name]
        by_group = {tuple(int(x) for x in g.split(",")): b for g, b in r0["by_group"].items()}
        inter, intra = split(by_group)
        steps = [max(r[name]["times"][i] for r in everyone) for i in range(len(r0["times"]))]
        summary[name] = dict(inter_bytes=inter, intra_bytes=intra, by_group=r0["by_group"], calls=r0["calls"],
                             step_s=statistics.median(steps), peak_rss=[r[name]["peak_rss"] for r in everyone],
                             losses=[statistics.fmean(r[name]["losses"][i] for r in everyone)  # fshard's: the
                                     for i in range(len(r0["losses"]))],  # mean already; the peers' per rank
                             metrics=r0["metrics"], planned=r0["planned"], params=r0["params"],
                             same_on_every_rank=all(split({tuple(int(x) for x in g.split(",")): b
                                                           for g, b in r[name]["by_group"].items()}) == (inter, intra)
                                                    for r in everyone))
    return summary


def report(summary: dict, args, cfg) -> None:
    mb = 2 ** 20
    print(f"HSDP benchmark: GPT {next(iter(summary.values()))['params'] / 1e6:.1f}M params "
          f"(dim {cfg.dim}, {cfg.n_layers} layers, seq {cfg.seq}), world {WORLD} = 2 nodes x {NODE} (gloo), batch "
          f"{args.batch_size}/rank, {args.warmup} warm-up + {args.steps} timed steps, {args.threads} thread(s)/rank")
    print(f"{'config':<12} {'inter-node B/step':>18} {'intra-node B/step':>18} {'inter MiB':>10} {'intra MiB':>10} "
          f"{'step s':>8} {'peak RSS MiB (max rank)':>24}  last loss (mean over ranks)")
    for name, s in summary.items():
        print(f"{name:<12} {s['inter_bytes']:>18.0f} {s['intra_bytes']:>18.0f} {s['inter_bytes'] / mb:>10.2f} "
              f"{s['intra_bytes'] / mb:>10.2f} {s['step_s']:>8.3f} {max(s['peak_rss']) / mb:>24.0f}  "
              f"{s['losses'][-1]:.4f}")
    print("bytes per step by group (rank 0's groups; ranks {0,1} node 0, {2,3} node 1):")
    for name, s in summary.items():
        groups = ", ".join(f"{{{g}}}: {b:.0f}" for g, b in sorted(s["by_group"].items()))
        print(f"  {name:<12} {groups}")
        if s["metrics"]:
            print(f"  {'':<12} fshard's own count (metrics): " + ", ".join(
                f"{k}={v:.0f}" for k, v in sorted(s["metrics"].items())))
    if "fshard-hsdp" in summary and "ddp" in summary and summary["ddp"]["inter_bytes"]:
        ratio = summary["fshard-hsdp"]["inter_bytes"] / summary["ddp"]["inter_bytes"]
        print(f"ratio fshard-hsdp inter-node bytes / ddp's: {ratio:.5f} (target <= 1/{NODE} = {1 / NODE:.2f}; "
              "the replica all-reduces plus the world's control all-reduces)")
    if "fshard-hsdp" in summary and "fsdp2-hsdp" in summary:
        ratio = summary["fshard-hsdp"]["step_s"] / summary["fsdp2-hsdp"]["step_s"]
        print(f"ratio fshard-hsdp step / fsdp2-hsdp step: {ratio:.3f} (target <= 1.0; a quiet machine only)")


def _config(args) -> GPTConfig:
    return GPTConfig.tiny() if args.quick else GPTConfig()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny GPT, 1 warm-up + 2 timed steps, batch 2")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --quick 1)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 4; --quick 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="each config in four new processes")
    p.add_argument("--start-method", choices=("spawn", "fork"), default=None,
                   help="how the ranks start (default spawn, as benchmarks/step.py; --quick: fork)")
    p.add_argument("--json", default=None, help="write every figure to this file")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.batch_size = args.batch_size or (2 if args.quick else 4)
    args.start_method = args.start_method or ("fork" if args.quick else "spawn")
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}: pick from {', '.join(CONFIGS)}")
    return args


def main(argv=None) -> dict:
    import torch.multiprocessing as mp
    args = parse_args(argv)
    if args.start_method == "fork":  # the ranks inherit the imports instead of making them again, four at once
        import fshard  # noqa: F401
    everyone = [{} for _ in range(WORLD)]
    with tempfile.TemporaryDirectory(prefix="fshard-hsdp-") as tmp:
        for names in ([[n] for n in args.configs] if args.fresh else [args.configs]):
            out = os.path.join(tmp, "out.pkl")
            mp.start_processes(worker, args=(args, _free_port(), names, out), nprocs=WORLD, join=True,
                               start_method=args.start_method)
            with open(out, "rb") as f:
                for mine, part in zip(everyone, pickle.load(f)):
                    mine.update(part)
    summary = summarize(everyone, args.configs)
    report(summary, args, _config(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
