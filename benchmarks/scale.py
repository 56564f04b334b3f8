"""The largest GPT each system trains on this machine: DDP, FSDP2 and fshard, 3 steps at world size 2 (issue #22).

Each trial is a fresh `torchrun --nproc-per-node 2` of this file with `--trial SYSTEM --layers L`: a GPT of L
layers (dim 2048, 16 heads, vocab 8192, seq 64; 50.3M parameters a layer, 1B at 20 layers), batch 1 per rank,
3 AdamW steps on one batch. The parent watches the memory of the whole process tree (the sum of every process's
RSS, every 20 ms) and kills the trial once it passes the budget (``--budget-gib``, default the machine's MemAvailable at
start less 1.5 GiB): a trial fits when it finishes its 3 steps under the budget. ``--bisect SYSTEM`` searches the
largest L that fits (doubling, then bisection); each trial's outcome, s/step, peak RSS per rank, the tree's peak,
disk bytes and I/O, and the loss of each step go to ``--out`` (JSON lines) and a table.

  ddp     the model built on the CPU in fp32, DistributedDataParallel, torch.optim.AdamW(fused=True)
  fsdp2   built on meta, fully_shard per block and the root with MixedPrecisionPolicy(bf16, fp32), to_empty, then
          each block's GPT-2 init; AdamW(fused=True) (the way FSDP2 documents large models)
  fshard  built on meta, fs.init materialises one unit at a time with the moments in an NVMeStore
          (fs.init(..., offload=)); gather_ahead(1) + bucket_reduce + mixed_precision + offload_state(NVMeStore,
          overlap_backward=False), donate=True
  fshard-params  the same, but the parameters' fp32 master shards live in the NVMeStore too
          (offload_state(params=True)): each gather reads its unit's shard, and each unit's update streams master
          and moments during backward (overlap_backward, in place with donate) and frees its gradient shard;
          gather_ahead(2) (reads two units ahead) + bucket_reduce(per_unit=True) (each unit's gradient shard a
          tensor of its own, so that it can be freed) + mixed_precision
  fshard-auto  the same transforms, the state in three tiers (device, CPUStore, NVMeStore) with the fractions
          step.plan chooses for this rank's share of the budget (plan.fractions): a plan of the state with every
          unit on NVMe, then the state made again with as much on the device as the plan says fits

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/scale.py --bisect ddp --out /tmp/scale.jsonl
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/scale.py --bisect fsdp2 --out /tmp/scale.jsonl
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/scale.py --bisect fshard --out /tmp/scale.jsonl
    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/scale.py --bisect fshard-params --layers 96 --lr 1e-5 \
        --mmap-threshold 1048576 --out /tmp/scale.jsonl   (one trial: with --layers, --bisect runs that one)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]
GIB = 1 << 30
DIM, HEADS, VOCAB, SEQ = 2048, 16, 8192, 64
LR = [3e-4]  # --lr (the trials of 2026-11 before fshard-params ran at 3e-4)
MMAP = [0]  # --mmap-threshold
SYSTEMS = ["ddp", "fsdp2", "fshard", "fshard-params", "fshard-auto"]
BOUND = {"ddp": "RAM", "fsdp2": "RAM", "fshard": "RAM", "fshard-params": "disk space; time: disk bandwidth",
         "fshard-auto": "RAM, then disk"}


# ---- the parent: trials under a memory watchdog, and the search --------------------------------------------------

def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def tree_rss(root: int) -> int:
    """The summed RSS of ``root`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_trial(system: str, layers: int, budget: int, timeout_s: float, workdir: str) -> dict:
    out = Path(workdir) / f"trial-{system}-{layers}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(29500 + (os.getpid() + layers) % 1000), __file__, "--trial", system, "--layers", str(layers),
           "--result", str(out), "--workdir", workdir, "--lr", str(LR[0]), "--mmap-threshold", str(MMAP[0]),
           "--rank-budget",
           str(int((budget - 2 * tree_rss(os.getpid())) / 2))]  # (the launcher is about this process's size)
    t0, peak, why, free = time.monotonic(), 0, None, shutil.disk_usage(workdir).free
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        if peak > budget:
            why = f"over the budget: {peak / GIB:.2f} GiB of the tree > {budget / GIB:.2f} GiB"
        elif time.monotonic() - t0 > timeout_s:
            why = f"timed out after {timeout_s:.0f} s"
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    log = proc.communicate()[0]
    (Path(workdir) / f"trial-{system}-{layers}.log").write_text(log)  # (what each rank printed)
    res = json.loads(out.read_text()) if out.exists() and why is None and proc.returncode == 0 else {}
    if "refused" in res:  # step.plan said it cannot fit: the trial stopped before its first step
        why, res = f"refused by step.plan: {res['refused']}", {}
    res.update(system=system, layers=layers, params=params_of(layers), tree_peak_gib=peak / GIB,
               disk_free_gib=free / GIB,
               budget_gib=budget / GIB,
               wall_s=time.monotonic() - t0, fits=bool(res) and why is None,
               why=why or (None if res else f"exit {proc.returncode}: {log.strip().splitlines()[-1:]}"))
    return res


def bisect(system: str, args) -> list[dict]:
    trials, lo, hi, layers = [], 0, None, args.start
    while hi is None or hi - lo > 1:
        r = run_trial(system, layers, args.budget, args.timeout, args.workdir)
        trials.append(r)
        report(r, args.out)
        if r["fits"]:
            lo = layers
        else:
            hi = layers
        layers = layers * 2 if hi is None else (lo + hi) // 2
        if lo == 0 and hi is not None and hi <= 1:
            break
    print(f"[scale] {system}: largest that fits: {lo} layers, {params_of(lo) / 1e9:.2f}B parameters "
          f"(budget {args.budget / GIB:.1f} GiB)", flush=True)
    return trials


def report(r: dict, out: str | None) -> None:
    steps = " ".join(f"{x:.3f}" for x in r.get("losses", []))
    print(f"[scale] {r['system']:7s} {r['layers']:3d} layers {r['params'] / 1e9:5.2f}B: "
          f"{'fits' if r['fits'] else 'does not fit'}; tree peak {r['tree_peak_gib']:.2f} GiB"
          + (f", {r['s_per_step']:.1f} s/step, rank peaks {r['rank_peak_gib']} GiB"
             + (f" (plan: rank 0 {r['predicted_rss_gib']:.2f})" if "predicted_rss_gib" in r else "")
             + f", losses {steps}" if r['fits']
             else f" ({r['why']})"), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\n")


def params_of(layers: int) -> int:
    return layers * (12 * DIM * DIM + 13 * DIM) + 2 * VOCAB * DIM + SEQ * DIM + 2 * DIM


# ---- a trial: one rank ----------------------------------------------------------------------------------------------

def trial(args) -> None:
    import torch
    import torch.distributed as dist

    from _memory import reset_peak, status  # (tests/_memory.py: VmHWM and its reset)
    from gpt import GPT, GPTConfig, init_weights, loss_fn, synthetic_batches
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=VOCAB, dim=DIM, n_layers=args.layers, n_heads=HEADS, seq=SEQ)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if args.mmap_threshold:  # glibc gives freed blocks this large back at once (fshard/_malloc.py), any system
        from fshard import set_mmap_threshold
        set_mmap_threshold(args.mmap_threshold)
    # one batch, 3 times: a loss that falls then shows that every part of the step trains (3 new batches of one
    # sequence each are too noisy to fall); the same for every system
    batches = list(synthetic_batches(cfg, 1, 1, seed=0, rank=rank, world_size=n)) * 3
    store_dir, extra, t_init = None, {}, time.perf_counter()
    if args.trial == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(GPT(cfg))
        step = torch_step(model, loss_fn)
    elif args.trial == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (n,))
        model = GPT(cfg, device="meta")
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.apply(init_weights)
        step = torch_step(model, loss_fn)
    else:
        import fshard as fs
        store_dir = Path(args.workdir) / f"store{rank}"
        store = fs.NVMeStore(str(store_dir))
        # overlap_backward=False: an update begun during backward writes a clone of the unit's shard and copy (the
        # input must survive a failure before the commit), 6 bytes a parameter more at the peak (measured: 1.25 GiB
        # of 3.65 at 8 layers); the largest model wants the least memory
        # fshard-params: reads two units ahead (fshard/run/_read_ahead.py); one bucket per unit, so each gradient shard
        # is a tensor of its own that the unit's update during backward frees
        params_ts = lambda off: (fs.gather_ahead(2), fs.bucket_reduce(per_unit=True), fs.mixed_precision(), off)
        make = lambda off: fs.init(GPT(cfg, device="meta"), fs.Mesh.from_env(),  # noqa: E731
                                   fs.adamw(lr=args.lr, weight_decay=0.1), init_fn=init_weights, seed=0, offload=off)
        if args.trial == "fshard":
            off = fs.offload_state(store, overlap_backward=False)
            ts = (fs.gather_ahead(1), fs.bucket_reduce(25), fs.mixed_precision(), off)
        elif args.trial == "fshard-params":
            off = fs.offload_state(store, params=True)
            ts = params_ts(off)
        else:  # fshard-auto: device, CPU memory and NVMe tiers, the fractions chosen by step.plan from the budget:
            # the state first all on NVMe (never the whole model in memory), then made again with the fractions its
            # plan says fit (units back to the device), and once more if that plan is still over the budget
            tiers, fractions, state, tried = (fs.CPUStore(), store), (0.0, 1.0), None, []
            for _ in range(3):
                off = fs.offload_state(tiers, fraction=fractions, params=True)
                state = make(off)
                with fs.compose(loss_fn, *params_ts(off), donate=True) as probe:
                    p = probe.plan(state, batches[0])
                tried.append((fractions, p.predicted_rss / GIB))
                if rank == 0:
                    print(f"[fshard-auto] fractions {fractions}: predicted {p.predicted_rss / GIB:.2f} GiB per rank, "
                          f"budget {args.rank_budget / GIB:.2f}", flush=True)
                new = p.fractions(args.rank_budget)
                if new is None or new == fractions or (p.predicted_rss <= args.rank_budget and len(tried) > 1):
                    break
                fractions, state = new, None
                gc.collect()  # (the last state's items go at the store's next operation)
            extra["fractions"], extra["fractions_tried"] = fractions, tried
            ts = params_ts(off)
        state = state if args.trial == "fshard-auto" else make(off)
        extra["init_s"] = time.perf_counter() - t_init
        fstep = fs.compose(loss_fn, *ts, donate=True)
        holder = [state]
        # step.plan's prediction of this rank's peak RSS (plan.predicted_rss: the RSS now less what the state and
        # the store's buffers hold, plus the plan's peak of fshard-owned memory and the store's stream buffers;
        # activations are left out: batch 1 x 64 tokens, a few MiB), checked against this rank's share of the budget
        try:
            plan = fstep.plan(state, batches[0], max_memory=args.rank_budget)
        except fs.errors.MemoryBudgetError as e:
            if rank == 0:
                Path(args.result).write_text(json.dumps({"refused": str(e)}))
            dist.barrier()
            fstep.close()
            store.close()
            return
        extra["plan_peak_gib"] = plan["mem/peak_bytes"] / GIB
        extra["predicted_rss_gib"] = plan.predicted_rss / GIB
        extra["plan"] = {k: v for k, v in {**plan.figures, **plan.bounds}.items() if k.startswith(("mem/", "store/"))}
        extra["plan"]["baseline_rss"] = plan.baseline_rss

        def step(batch):
            holder[0], m = fstep(holder[0], batch)
            extra["measured"] = {k: v for k, v in m.items() if k.startswith(("mem/", "store/"))}
            if "predicted_rss_after_first_gib" not in extra:  # with the gather order and activations it observed
                extra["predicted_rss_after_first_gib"] = fstep.plan(holder[0], batch).predicted_rss / GIB
            extra.setdefault("io_gb", 0.0)
            extra["io_gb"] += (m.get("io/read_bytes", 0) + m.get("io/write_bytes", 0)) / 1e9
            return m["loss"]
    losses, times = [], []
    init_peak = status("VmHWM:")  # fs.init's peak (one unit at a time), then the steps' own from here on
    reset_peak()
    for b in batches:
        t = time.perf_counter()
        losses.append(step(b))
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks, steps_peaks, init_peaks = [None] * n, [None] * n, [None] * n
    dist.all_gather_object(peaks, peak)
    dist.all_gather_object(steps_peaks, status("VmHWM:"))
    dist.all_gather_object(init_peaks, init_peak)
    disk = sum(f.stat().st_size for f in store_dir.rglob("*") if f.is_file()) if store_dir else 0
    disks = [None] * n
    dist.all_gather_object(disks, disk)
    if rank == 0:
        Path(args.result).write_text(json.dumps(dict(
            losses=losses, lr=args.lr, mmap_threshold=args.mmap_threshold, s_per_step=sorted(times)[1], step_s=times,
            rank_peak_gib=[round(p / GIB, 2) for p in peaks],
            rank_steps_peak_gib=[round(p / GIB, 3) for p in steps_peaks],
            rank_init_peak_gib=[round(p / GIB, 3) for p in init_peaks],
            disk_gib=sum(disks) / GIB, io_gbps=extra.get("io_gb", 0.0) / max(sum(times), 1e-9), **extra)))
        # (extra is rank 0's: its plan and its prediction, against rank_peak_gib[0])
    dist.barrier()
    if store_dir is not None:  # close the store (its engines) before its directory goes
        fstep.close()
        store.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def torch_step(model, loss_fn):
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=LR[0], weight_decay=0.1, fused=True)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        mean = loss.detach().double()
        torch.distributed.all_reduce(mean)
        return mean.item() / torch.distributed.get_world_size()
    return step


def plot(jsonl: str, png: str) -> None:
    """s/step, the tree's peak RSS and the store on disk against model size, one line per system (dashed: an
    earlier session's, "(session N)" in its name); trials that did not fit as crosses at the memory they had reached
    when stopped. One legend under the panels, with the bound that limits each system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(jsonl) if line.strip()]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 5.6))
    for system in sorted({r["system"] for r in rows}):
        ok = sorted(((r["params"] / 1e9, r) for r in rows if r["system"] == system and r["fits"]), key=lambda x: x[0])
        bad = [(r["params"] / 1e9, r["tree_peak_gib"]) for r in rows if r["system"] == system and not r["fits"]]
        style = "o--" if "session" in system else "o-"
        label = f"{system} (bound: {BOUND[system.split()[0]]})"
        if ok:
            line = a.plot([x for x, _ in ok], [r["s_per_step"] for _, r in ok], style, label=label)[0]
            b.plot([x for x, _ in ok], [r["tree_peak_gib"] for _, r in ok], style, color=line.get_color())
            c.plot([x for x, _ in ok], [r.get("disk_gib", 0) for _, r in ok], style, color=line.get_color())
            if bad:
                b.plot(*zip(*bad), "x", color=line.get_color(), label=f"{system}: stopped over the budget")
    budget = max((r.get("budget_gib", 0) for r in rows), default=0)
    if budget:
        b.axhline(budget, color="gray", ls=":", lw=1, label=f"memory budget {budget:.1f} GiB")
    free = max((r.get("disk_free_gib", 0) for r in rows), default=0)
    if free:
        c.axhline(free, color="gray", ls="-.", lw=1, label=f"free disk {free:.0f} GiB")
    a.set(xlabel="parameters (B)", ylabel="s / step (median of 3)", title="time, world size 2, batch 1")
    b.set(xlabel="parameters (B)", ylabel="peak RSS of both ranks (GiB)", title="memory")
    c.set(xlabel="parameters (B)", ylabel="store on disk, both ranks (GiB)", title="disk")
    handles, labels = [], []
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bisect", choices=SYSTEMS)
    ap.add_argument("--trial", choices=SYSTEMS)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--mmap-threshold", type=int, default=0, help="fs.set_mmap_threshold in each rank (0: glibc's)")
    ap.add_argument("--rank-budget", type=int, default=None, help="(a trial's) step.plan(..., max_memory=)")
    ap.add_argument("--layers", type=int, default=None, help="one trial of this many layers (with --bisect: none)")
    ap.add_argument("--start", type=int, default=4, help="the search's first trial, in layers")
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--workdir", default=None, help="trial results and fshard's store (default: a temporary dir)")
    ap.add_argument("--result", default=None)
    ap.add_argument("--out", default=None, help="append every trial as a JSON line")
    ap.add_argument("--plot", nargs=2, metavar=("JSONL", "PNG"), help="draw the trials of JSONL into PNG")
    args = ap.parse_args()
    LR[0], MMAP[0] = args.lr, args.mmap_threshold
    if args.plot:
        plot(*args.plot)
        return 0
    if args.trial:
        trial(args)
        return 0
    args.budget = int((args.budget_gib * GIB) if args.budget_gib else mem_available() - 1.5 * GIB)
    with tempfile.TemporaryDirectory(prefix="fshard-scale-", dir=args.workdir) as wd:
        args.workdir = wd
        if args.layers:
            report(run_trial(args.bisect, args.layers, args.budget, args.timeout, wd), args.out)
        else:
            bisect(args.bisect, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
