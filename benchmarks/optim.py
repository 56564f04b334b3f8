"""Optimizer updates (issue #40's speed clause): fshard's update of each unit's flat shard against torch's fastest
implementation of the same optimizer over the same parameters, in ONE process, alternating, medians of N repeats.

Run it under the shared benchmark lock (other engineers time things on the same cores)::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/optim.py                  # every optimizer, 27.4M GPT
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/optim.py --only adamw,lion --repeats 15
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/optim.py --muon           # Muon step, world size 2
    .venv/bin/python benchmarks/optim.py --quick                                       # smoke run, tiny GPT
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/optim.py --overhead --repeats 41  # Python around it

**Updates** (the default). The parameters are those of ``examples/gpt.py``'s ``GPTConfig()`` (27.4M, fp32; the model
of benchmarks/step.py and examples/train_gpt.py), one seeded model, its random gradients (N(0, 1e-2), seeded) the
same on both sides:

- fshard: ``fs.init(model, fs.Mesh.local(), opt)``, then per update what the step's update policy
  (``DeviceUpdate``, fshard/protocol/_transform.py) calls: ``opt.update_all(0, units, donate=True)`` over every
  unit where the optimizer has it (the elementwise ones: every unit's plan, then the optimizer's pass over each run
  of the flat shards back to back; a run is a unit's parameters with one step count and weight decay: usually the
  whole unit), else ``opt.update(layout, 0, shard, grad, state, active, donate=True)`` a unit at a time.
  ``donate=True``: in place, as a step composed with ``donate=True`` updates (without it the update first copies
  the state, by design).
- torch: ``torch.optim.X`` over the model's parameters as a list of tensors (their ``.grad`` set), ``fused=True``
  where torch has a fused CPU kernel (AdamW, Adam, SGD, Adagrad), else ``foreach=True`` (RMSprop, NAdam,
  Adafactor). Lion has no torch twin: its peer is the Lion paper's formula written here with ``torch._foreach_*``
  ops (``ForeachLion``), as a foreach torch optimizer would be.

Each optimizer runs in a process of its own, forked from this one (an earlier pair's freed memory, fshard's state in
huge pages among it, would otherwise serve a later pair's torch tensors). fshard asks the kernel for huge pages for
its state (fshard/_pages.py, ``state_empty``); torch's parameters and moments are where torch's allocator puts them
(4 KiB pages unless torch's ``THP_MEM_ALLOC_ENABLE=1``).
Each repeat times one whole-model update of each side, in turn (the order alternates between repeats), after
``--warmup`` untimed updates; threads are ``torch.set_num_threads(--threads)`` for both. Printed per optimizer: the
median ms, elements/s (trainable elements per second), the speed ratio ``torch ms / fshard ms`` (>= 1.0: fshard's
update is at least as fast, issue #40's bar) of the medians and its range over the repeats (the noise), the median
of the per-repeat ratios, in how many repeats fshard's update was the faster one with the one-sided sign test's p
(benchmarks/paired.py's: where both sides run one kernel at the memory roof, the medians' ratio moves by more than
its distance from 1 between runs), and, as a check that both ran the same optimizer on the same tensors, the
largest parameter difference after the same number of updates (Lion's peer rounds differently; sign flips of
near-zero momenta move an element by 2 lr).

**Muon** (``--muon``): world size 2 on gloo, spawned as benchmarks/step.py does (its harness: fresh processes per
round and config, a step's time the slowest rank's, medians), the GPT with its blocks' 2-D matrices on Muon and the
rest (embeddings, head, norms, biases) on AdamW: ``fs.partition({"muon": fs.muon, "adamw": fs.adamw})`` with
gather_ahead(2) + bucket_reduce(25) (step.py's best config, ``fshard+ahead+buckets``) and ``donate=True`` (the
update in place, as DDP's torch optimizers update their parameters) against DDP + ``torch.optim.Muon`` +
``torch.optim.AdamW(fused=True)`` on the same parameter split. Issue #40's bar: fshard's step <= 0.7x the DDP one.
step.py's table lists each rank's ``comm/update_bytes`` (Muon's all-to-alls) beside ``comm/reduce_bytes``. With
``--muon`` every other argument but ``--quick`` goes to step.py (``--rounds 3``, ``--steps 10``, ``--tiny``,
``--threads``, ``--json``, ...).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import fshard as fs  # noqa: E402
from fshard.state._flat import flatten  # noqa: E402  (a unit's flat buffer, as the step's gradient is laid out)
from gpt import GPT, GPTConfig  # noqa: E402

O = torch.optim


class ForeachLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2, with decoupled weight decay as optax.lion), written with torch's foreach
    ops as torch writes its foreach optimizers: c = b1 m + (1 - b1) g; p <- p (1 - lr wd) - lr sign(c);
    m <- b2 m + (1 - b2) g. The benchmark's peer for fs.optim.lion, which torch lacks."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            ps = [p for p in group["params"] if p.grad is not None]
            gs = [p.grad for p in ps]
            ms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in ps]
            c = torch._foreach_mul(ms, b1)
            torch._foreach_add_(c, gs, alpha=1 - b1)
            torch._foreach_sign_(c)
            if wd != 0:
                torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_add_(ps, c, alpha=-lr)
            torch._foreach_mul_(ms, b2)
            torch._foreach_add_(ms, gs, alpha=1 - b2)


# name -> (fshard optimizer, torch peer class, the peer's arguments (the same hyperparameters), how the peer runs).
# The plain names are the defaults ("auto": adam, sgd and adagrad run torch's fused kernel on the CPU); the impl=
# rows the other one-pass choice (fshard.ops' bitwise single-tensor kernels).
CASES = {
    "adamw": (lambda: fs.adamw(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1), O.AdamW,
              dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True), "fused"),
    "adam": (lambda: fs.optim.adam(lr=1e-3, weight_decay=0.1), O.Adam, dict(lr=1e-3, weight_decay=0.1, fused=True),
             "fused"),
    "adam(impl=native)": (lambda: fs.optim.adam(lr=1e-3, weight_decay=0.1, impl="native"), O.Adam,
                          dict(lr=1e-3, weight_decay=0.1, fused=True), "fused"),
    "sgd(momentum)": (lambda: fs.optim.sgd(lr=0.05, momentum=0.9, weight_decay=0.01), O.SGD,
                      dict(lr=0.05, momentum=0.9, weight_decay=0.01, fused=True), "fused"),
    "sgd(nesterov)": (lambda: fs.optim.sgd(lr=0.05, momentum=0.9, nesterov=True), O.SGD,
                      dict(lr=0.05, momentum=0.9, nesterov=True, fused=True), "fused"),
    "sgd(momentum, impl=native)": (lambda: fs.optim.sgd(lr=0.05, momentum=0.9, weight_decay=0.01, impl="native"),
                                   O.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01, fused=True), "fused"),
    "adagrad": (lambda: fs.optim.adagrad(lr=0.05, weight_decay=0.01), O.Adagrad,
                dict(lr=0.05, weight_decay=0.01, fused=True), "fused"),
    "adagrad(impl=native)": (lambda: fs.optim.adagrad(lr=0.05, weight_decay=0.01, impl="native"), O.Adagrad,
                             dict(lr=0.05, weight_decay=0.01, fused=True), "fused"),
    "adam(impl=torch)": (lambda: fs.optim.adam(lr=1e-3, weight_decay=0.1, impl="torch"), O.Adam,
                         dict(lr=1e-3, weight_decay=0.1, fused=True), "fused"),
    "rmsprop": (lambda: fs.optim.rmsprop(lr=1e-3, weight_decay=0.01), O.RMSprop,
                dict(lr=1e-3, weight_decay=0.01, foreach=True), "foreach"),
    "lion": (lambda: fs.optim.lion(lr=1e-4, weight_decay=0.1), ForeachLion, dict(lr=1e-4, weight_decay=0.1),
             "foreach, the paper's formula written here (torch has no Lion)"),
    "adafactor": (lambda: fs.adafactor(lr=1e-2), O.Adafactor, dict(lr=1e-2, foreach=True), "foreach"),
    "from_torch(NAdam)": (lambda: fs.optim.from_torch(O.NAdam, lr=2e-3, weight_decay=0.01), O.NAdam,
                          dict(lr=2e-3, weight_decay=0.01, foreach=True), "foreach"),
    "from_torch(NAdam)[foreach=True]": (
        lambda: fs.optim.from_torch(O.NAdam, lr=2e-3, weight_decay=0.01, foreach=True), O.NAdam,
        dict(lr=2e-3, weight_decay=0.01, foreach=True), "foreach"),
}


class Pair:
    """One optimizer on both sides: fshard's state of the model's units and torch's optimizer over a copy of the
    same parameters, both with the same gradients; ``fshard()`` and ``torch()`` each take one whole-model update."""

    def __init__(self, name: str, cfg: GPTConfig, seed: int):
        make, cls, kw, self.how = CASES[name]
        torch.manual_seed(seed)
        model = GPT(cfg)
        gen = torch.Generator().manual_seed(seed + 1)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        grads = {n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in named}
        self.numel = sum(p.numel() for _, p in named)
        self.names = [n for n, _ in named]
        self.tparams = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
        for p, n in zip(self.tparams, self.names):
            p.grad = grads[n].clone()
        self.topt = cls(self.tparams, **kw)
        self.state = fs.init(model, fs.Mesh.local(), make())
        self.opt = self.state.spec.optimizer  # bound (fs.init binds it to the model), as the step's policy has it
        self.layouts = [u for u in self.state.spec.units if u.name in self.state.opt_state]
        self.grads = {u.name: flatten(u, {s.name: grads[s.name] for s in u.slots}) for u in self.layouts}
        self.active = {u.name: [True] * len(u.trainable) for u in self.layouts}
        self.params, self.opt_state = dict(self.state.params), dict(self.state.opt_state)
        self.updates = 0

    def fshard(self) -> None:
        many = getattr(self.opt, "update_all", None)
        if many is not None:  # DeviceUpdate's call: every unit at once (the elementwise optimizers)
            done = many(0, [(u, self.params[u.name], self.grads[u.name], self.opt_state[u.name],
                             self.active[u.name], None) for u in self.layouts], True, updates=self.updates)
            for u, (p, s, _) in zip(self.layouts, done):
                self.params[u.name], self.opt_state[u.name] = p, s
        else:
            for u in self.layouts:  # DeviceUpdate's loop (comm=None: one rank)
                self.params[u.name], self.opt_state[u.name], _ = self.opt.update(
                    u, 0, self.params[u.name], self.grads[u.name], self.opt_state[u.name], self.active[u.name], True,
                    updates=self.updates)
        self.updates += 1

    def torch(self) -> None:
        self.topt.step()

    def max_diff(self) -> float:
        """The largest |fshard - torch| over the parameters (both after the same number of updates)."""
        full = fs.full_params(self.state.replace(params=self.params, opt_state=self.opt_state))
        return max((full[n] - p.detach()).abs().max().item() for n, p in zip(self.names, self.tparams))


def time_pair(pair: Pair, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Each side's seconds per update, repeat by repeat (the sides in turn, the first one alternating)."""
    for _ in range(warmup):
        pair.fshard()
        pair.torch()
    times = {"fshard": [], "torch": []}
    for i in range(repeats):
        for side in (("fshard", "torch") if i % 2 == 0 else ("torch", "fshard")):
            fn = pair.fshard if side == "fshard" else pair.torch
            t0 = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - t0)
    return times


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime unavailable"


def run_updates(args) -> dict:
    torch.set_num_threads(args.threads)
    from fshard.optim import _elementwise
    if args.piece is not None:
        if args.piece < 0:
            raise SystemExit(f"--piece {args.piece}: a piece is a number of elements >= 0 (0: whole runs)")
        _elementwise.PIECE = args.piece
    cfg = GPTConfig.tiny() if args.quick else GPTConfig()
    names = list(CASES) if not args.only else [n.strip() for n in re.split(r",(?![^()]*\))", args.only)]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown optimizers {unknown}; known: {list(CASES)}")
    from fshard import ops
    from paired import sign_test  # (the paired step timing's: the same test over repeats)
    from step import _git_head
    print(f"[optim.py] git {_git_head()} torch {torch.__version__}, {torch.get_num_threads()} threads, cfg={cfg}, "
          f"repeats={args.repeats}, warmup={args.warmup}; fshard.ops: "
          f"{ {k: v for k, v in ops.backend_info().items() if k in ('backend', 'cpu_isa')} }, pieces of "
          f"{_elementwise.PIECE} elements\n[optim.py] {_uptime()}",
          flush=True)
    out = {}
    print("\nspeed = torch ms / fshard ms, of the medians (>= 1.0: fshard at least as fast); per repeat: the same "
          "ratio in each repeat, min-max (the noise), and its median; fshard faster: in how many repeats, with the "
          "one-sided sign test's p (the chance of as many or more if each side were as likely to be faster)")
    print("\n| optimizer | fshard impl | torch peer | elements | fshard ms | torch ms | fshard Gelem/s | "
          "torch Gelem/s | speed | per repeat | paired median | fshard faster | max abs param diff |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    # What every case would import or build at its first use, once here rather than in each forked child: torch
    # imports dynamo when an optimizer is made (2-3 s), fshard.ops builds or loads its library at its first kernel.
    importlib.import_module("torch._dynamo")  # (an import statement here would make ``torch`` a local name)
    ops.native_available()  # (builds or loads the library, where it can)
    for name in names:
        out[name] = _forked(lambda name=name: _one_case(name, cfg, args, sign_test))
    print(f"\n[optim.py] {_uptime()}")
    return out


def _one_case(name: str, cfg, args, sign_test) -> dict:
    """Time one optimizer's pair and print its row."""
    pair = Pair(name, cfg, args.seed)
    times = time_pair(pair, args.repeats, args.warmup)
    diff = pair.max_diff()
    n, f, t = pair.numel, statistics.median(times["fshard"]), statistics.median(times["torch"])
    paired = [b / a for a, b in zip(times["fshard"], times["torch"])]
    wins = sum(r > 1 for r in paired)
    p = sign_test(wins, len(paired))
    impl = pair.opt.resolved_impl(torch.device("cpu"))
    print(f"| {name} | {impl} | {CASES[name][1].__name__} ({pair.how}) | {n:,} | {f * 1e3:.2f} | {t * 1e3:.2f} | "
          f"{n / f / 1e9:.3f} | {n / t / 1e9:.3f} | {t / f:.3f}x | {min(paired):.2f}-{max(paired):.2f} | "
          f"{statistics.median(paired):.3f}x | {wins}/{len(paired)} (p={p:.2g}) | "
          f"{diff:.3g} |",
          flush=True)
    return dict(fshard_ms=f * 1e3, torch_ms=t * 1e3, elements=n, speed_ratio=t / f, per_repeat=paired,
                paired_median=statistics.median(paired), fshard_faster=wins, sign_test_p=p, max_abs_diff=diff,
                fshard_impl=impl, peer=f"{CASES[name][1].__name__} ({pair.how})")


def _forked(fn) -> dict:
    """``fn()`` in a child process forked from this one (its result back as JSON). Each optimizer's pair gets a heap
    of its own: in one process, an earlier pair's freed memory (fshard's state in huge pages, fshard/_pages.py) would
    serve a later pair's torch tensors, and which side got which pages would depend on the order of the cases."""
    # (Safe while this process has run no parallel torch op: a libgomp pool forked in use would hang the child.)
    sys.stdout.flush()  # (what is buffered now would be written again by the child)
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its result down the pipe, then out without the parent's exit handlers
        code = 1
        try:
            os.close(r)
            with os.fdopen(w, "w") as f:
                json.dump(fn(), f)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"[optim.py] a case's process failed (wait status {status})")
    return json.loads(text)


def run_overhead(args) -> dict:
    """``--overhead``: what each side spends beyond the kernel itself, for sgd(momentum), whose kernel both sides
    run (torch's fused SGD). Per repeat, in turn: fshard's update, the kernel called directly on fshard's own flat
    shards (one ``torch._fused_sgd_`` over every unit), and torch.optim.SGD(fused=True).step(); printed, the medians
    and the paired medians of (side - direct): the Python each side adds around the same pass, which the machine's
    noise (the pass itself varies by 10-30% between repeats here) hides in the speed ratio."""
    torch.set_num_threads(args.threads)
    cfg = GPTConfig.tiny() if args.quick else GPTConfig()
    pair = Pair("sgd(momentum)", cfg, args.seed)
    kw = CASES["sgd(momentum)"][2]  # the peer's arguments: the same hyperparameters as fshard's side
    ps = [pair.params[u.name] for u in pair.layouts]
    gs = [pair.grads[u.name] for u in pair.layouts]
    bufs = [pair.opt_state[u.name].rows[0] for u in pair.layouts]

    def direct():
        torch._fused_sgd_(ps, gs, bufs, weight_decay=kw["weight_decay"], momentum=kw["momentum"], lr=kw["lr"],
                          dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
    sides = {"fshard": pair.fshard, "direct": direct, "torch": pair.torch}
    for _ in range(max(args.warmup, 1)):  # (sgd's first update starts the buffers: direct runs after it)
        for fn in sides.values():
            fn()
    times = {k: [] for k in sides}
    for i in range(args.repeats):
        for k in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            t0 = time.perf_counter()
            sides[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    over = {k: statistics.median([a - b for a, b in zip(times[k], times["direct"])]) * 1e3
            for k in ("fshard", "torch")}
    print(f"[optim.py] --overhead, sgd(momentum), {len(pair.layouts)} units, {pair.numel:,} elements, "
          f"{args.repeats} repeats\n[optim.py] {_uptime()}")
    print(f"median ms: fshard {med['fshard']:.2f}, the kernel alone {med['direct']:.2f}, torch {med['torch']:.2f}")
    print(f"beyond the kernel (paired medians, ms): fshard {over['fshard']:.3f}, torch {over['torch']:.3f}")
    return {"median_ms": med, "beyond_kernel_ms": over, "units": len(pair.layouts)}


# --- Muon at world size 2 (benchmarks/step.py's harness and two configs of its registry)

MUON_LR = 0.02  # torch.optim.Muon's and fs.muon's, the same; AdamW's the step.py defaults (_adamw_kwargs)


def muon_label(name: str, p: torch.Tensor) -> str:
    """The hidden matrices (the blocks' 2-D weights) on Muon; the embeddings, the head and every 1-D parameter on
    AdamW, as Muon is meant to be used."""
    return "muon" if p.ndim == 2 and name.startswith("blocks.") else "adamw"


def _register_muon_configs(stepbench) -> None:
    """Add the two configs to step.py's registry. Called at import, so that the ranks step.py spawns (which import
    this file again as their main module before running step.worker) know them too."""
    from step import Runner, loss_fn

    @stepbench.register("ddp+muon")
    def _ddp_muon(ctx):
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = ctx.fresh_model()
        groups = {"muon": [], "adamw": []}
        for n, p in model.named_parameters():
            groups[muon_label(n, p)].append(p)
        ddp = DDP(model)
        opts = [O.Muon(groups["muon"], lr=MUON_LR, weight_decay=0.1),
                O.AdamW(groups["adamw"], fused=True, **stepbench._adamw_kwargs(ctx.args))]

        def step(batch):
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss = loss_fn(ddp, batch)
            loss.backward()
            for o in opts:
                o.step()
            return loss.item(), {}

        return Runner(step)

    @stepbench.register("fshard+ahead+buckets+muon+donate")
    def _fshard_muon(ctx):  # (donate: the update in place, as DDP's optimizers update theirs)
        return stepbench.fshard_runner(ctx, *stepbench._ahead_buckets(), donate=True, optimizer=lambda c: fs.partition(
            {"muon": fs.muon(lr=MUON_LR, weight_decay=0.1), "adamw": fs.adamw(**stepbench._adamw_kwargs(c.args))},
            muon_label))


MUON_CONFIGS = ("ddp+muon", "fshard+ahead+buckets+muon+donate")


def run_muon(quick: bool, rest: list[str]) -> dict:
    """step.py's run of the two Muon configs with the arguments ``rest`` (its own: --rounds, --steps, --warmup,
    --threads, --tiny, --json, ...); ``quick``: one round of 1 + 2 tiny steps in one set of processes."""
    import step as stepbench
    print(f"[optim.py] {_uptime()}", flush=True)
    given = {a.split("=")[0] for a in rest}
    pairs = [("--configs", ",".join(MUON_CONFIGS))]
    if quick:
        pairs += [("--tiny", None), ("--in-process", None), ("--warmup", "1"), ("--steps", "2"), ("--rounds", "1")]
    argv = [x for flag, v in pairs if flag not in given for x in ((flag,) if v is None else (flag, v))]
    with tempfile.TemporaryDirectory(prefix="fshard-optim-") as tmp:
        path = stepbench.parse_args(argv + rest).json
        if path is None:  # step.py's results, read back here for the ratio
            path = os.path.join(tmp, "muon.json")
            rest = rest + ["--json", path]
        stepbench.main(argv + rest)
        with open(path) as f:
            result = json.load(f)
    meds = {n: result["configs"].get(n, {}).get("median_s") for n in MUON_CONFIGS}
    if None in meds.values():
        raise SystemExit(f"[optim.py] a Muon config failed: {meds}")
    ratio = meds[MUON_CONFIGS[1]] / meds[MUON_CONFIGS[0]]
    print(f"\n[optim.py] Muon step, world size {result.get('world_size', 2)}: {MUON_CONFIGS[1]} "
          f"{meds[MUON_CONFIGS[1]] * 1e3:.1f} ms / {MUON_CONFIGS[0]} {meds[MUON_CONFIGS[0]] * 1e3:.1f} ms = "
          f"{ratio:.3f} (issue #40's bar: <= 0.7)\n[optim.py] {_uptime()}")
    return {"median_s": meds, "ratio": ratio}


def _import_step_and_register() -> None:
    import step as stepbench
    if MUON_CONFIGS[0] not in stepbench.CONFIGS:
        _register_muon_configs(stepbench)


_import_step_and_register()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny GPT, 2 repeats, 1 warm-up")
    ap.add_argument("--repeats", type=int, default=9, help="timed updates per side and optimizer")
    ap.add_argument("--warmup", type=int, default=2, help="untimed updates per side first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides; per rank with --muon)")
    ap.add_argument("--only", default="",
                    help=f"comma-separated (a comma inside a name's parentheses stays), from {list(CASES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--piece", type=int, default=None,
                    help="elements an update written as torch ops takes at a time on the CPU (fshard.optim's PIECE; "
                         "0: whole runs), to measure the choice")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--overhead", action="store_true",
                    help="sgd(momentum) only: each side's time beyond the kernel both run (run_overhead)")
    ap.add_argument("--muon", action="store_true", help="the Muon step at world size 2 (with --quick: tiny, one "
                                                        "round; every other argument goes to benchmarks/step.py)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--muon" in argv:  # the rest are step.py's arguments (its --warmup, --threads, --json, ... are its own)
        rest = [a for a in argv if a not in ("--muon", "--quick")]
        run_muon("--quick" in argv, rest)
        return
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
    out = run_overhead(args) if args.overhead else run_updates(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
