"""``fs.Plan``: what one step will hold and move on this rank (``step.plan(state, batch)``, made by step/_dry_run.py),
its prediction of the process's peak RSS, the check against a memory budget and the offload fractions that fit it.

Every figure is a metric name: after a step, ``metrics`` carries the same names, measured (tests/test_plan.py
checks they agree within 5%).
"""
from __future__ import annotations

import dataclasses
import math

import optree
import torch

from ..errors import MemoryBudgetError
from ..state._train_state import NAMESPACE

# (metric, what it is): the rows of print(plan), in order
MEMORY = (
    ("mem/params_bytes", "parameter shards"),
    ("mem/copies_bytes", "their low-precision copies (param_copies)"),
    ("mem/opt_state_bytes", "optimizer state in memory"),
    ("mem/buffers_bytes", "buffers (replicated)"),
    ("mem/new_state_bytes", "new state the update writes (0 with donate)"),
    ("mem/peak_gathered_bytes", "gathered units, at most at once"),
    ("mem/unit_grad_bytes", "one unit's gradient before reduction, largest"),
    ("mem/reduce_buffer_bytes", "one reduction's buffer, largest"),
    ("mem/grad_shard_bytes", "gradient shards (held until the update)"),
    ("mem/grad_shard_peak_bytes", "of those, held at once (an update during backward frees them)"),
    ("mem/accum_bytes", "gradients summed over micro-batches"),
    ("mem/param_read_bytes", "parameter shards read from a store for gathers, at once"),
)
TRAFFIC = (
    ("comm/gather_bytes", "all-gathers (gathered bytes)"),
    ("comm/reduce_bytes", "reductions (bytes reduced)"),
    ("comm/replica_bytes", "replica all-reduces (2-D meshes: between shard groups)"),
    ("comm/control_bytes", "control all-reduces"),
    ("comm/update_bytes", "the optimizer's own exchanges (fs.muon's all-to-alls)"),
    ("io/read_bytes", "store reads"),
    ("io/write_bytes", "store writes"),
)
FIGURES = tuple(k for k, _ in MEMORY + TRAFFIC) + ("mem/store_bytes", "mem/state_bytes", "mem/peak_bytes")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one step will hold and move on this rank (``step.plan(state, batch)``); ``print(plan)`` is a table.

    Attributes:
      figures: metric name -> bytes. ``mem/peak_bytes`` is the peak of fshard-owned memory: the state, plus the
        sum of the peaks of what the step adds (new state, gathered units, gradients and reduction buffers); the
        model's activations and the framework's own memory come on top.
      rank, world_size, micro_batches, donate, params: the setting it was made for (params: parameters in the
        model, for the DDP comparison line).
      unknown: stages whose policy says nothing of its cost (their figures count as 0).
      tiers: the step's offload_state stores, nearest first, as ``(location, in_memory, fraction)``; empty without
        offload_state. device: the mesh's device type ("cpu", "cuda").
      bounds: figures a step does not measure, name -> bytes: ``offload/movable_bytes`` (what the units
        offload_state places hold on the device, all of them: moments, and with ``params=True`` the shard, its
        copy and its gradient shard, which an update during backward frees where the unit is in a store) and
        ``offload/device_bytes`` (the part of it on the device now); ``store/peak_bytes``, the most the optimizer's
        store (fs.offload_state) holds on this rank during the step (on disk for an NVMeStore;
        tests/test_reliability.py samples it; with several stores, their sum); ``store/memory_peak_bytes``, the
        part of it in stores that live in memory (CPUStore: host RAM); ``store/buffer_bytes``, the store's pool
        buffers its streams use at most (host memory); ``mem/activation_bytes``, the storages forward saves for
        backward (activations): measured by the last step (``metrics["mem/activation_bytes"]``), or before a step
        function's first step estimated by a forward on the meta device (``activations()``; absent where the model
        cannot run there).
    """

    figures: dict
    rank: int
    world_size: int
    micro_batches: int
    donate: bool
    params: int
    unknown: tuple = ()
    bounds: dict = dataclasses.field(default_factory=dict)
    baseline_rss: int = 0
    tiers: tuple = ()
    device: str = "cpu"

    def __getitem__(self, key: str) -> int:
        return self.figures[key]

    @property
    def predicted_rss(self) -> int:
        """This process's peak RSS during the step, predicted: ``baseline_rss`` (its RSS when planned, less what the
        state and the stores held in memory then: the interpreter, torch, the model's template), plus the peak of
        fshard-owned memory, plus the stores' stream buffers, plus what in-memory stores hold at their peak, plus
        the activations (``bounds["mem/activation_bytes"]``). Allocator slack is not in it (benchmarks/RESULTS.md,
        "Parameter offload", measures how close it comes)."""
        return (self.baseline_rss + self.figures["mem/peak_bytes"] + self.bounds.get("store/buffer_bytes", 0)
                + self.bounds.get("store/memory_peak_bytes", 0)
                + self.bounds.get("mem/activation_bytes", 0))

    def check(self, max_memory: int | None) -> "Plan":
        """Raise ``MemoryBudgetError`` if ``predicted_rss`` is over ``max_memory`` bytes, naming the budget, the
        largest parts of the prediction and what would lower them; else (or with no budget: None) return the plan."""
        if max_memory is None or self.predicted_rss <= max_memory:
            return self
        f, parts = self.figures, [("process baseline", self.baseline_rss)]
        parts += [(what, f[k]) for k, what in MEMORY if f[k] and k != "mem/grad_shard_bytes"]  # (its peak counts)
        parts.append(("store buffers", self.bounds.get("store/buffer_bytes", 0)))
        top = ", ".join(f"{w} {_size(b).strip()}" for w, b in sorted(parts, key=lambda x: -x[1])[:4])
        over = self.predicted_rss - max_memory
        fixes, big = [], lambda b: b >= 0.1 * over  # a fix worth naming recovers a tenth of the excess or more
        if big(f["mem/opt_state_bytes"]):
            fixes.append(f"keep the optimizer moments ({_size(f['mem/opt_state_bytes']).strip()}) in a store: "
                         "fs.offload_state(fs.NVMeStore(dir)) in the step, and fs.init(..., offload=) the same")
        if big(f["mem/params_bytes"] + f["mem/copies_bytes"]):
            fixes.append(f"keep the parameter shards ({_size(f['mem/params_bytes'] + f['mem/copies_bytes']).strip()}"
                         ") there too: fs.offload_state(store, params=True), without param_copies")
        if big(f["mem/grad_shard_peak_bytes"]) and f["mem/grad_shard_peak_bytes"] == f["mem/grad_shard_bytes"]:
            fixes.append("free gradient shards during backward: params=True with donate=True, no bucket_reduce")
        if not self.donate and big(f["mem/new_state_bytes"]):
            fixes.append(f"compose with donate=True (the update writes {_size(f['mem/new_state_bytes']).strip()} "
                         "of new state otherwise)")
        fractions = self.fractions(max_memory)
        if fractions is not None:
            fixes.insert(0, f"offload more: fs.offload_state(({', '.join(t[0] for t in self.tiers)}), "
                            f"fraction={fractions}) (Plan.fractions), here and in fs.init(..., offload=)")
        raise MemoryBudgetError(
            f"step.plan: this step needs about {_size(self.predicted_rss).strip()} on rank {self.rank} at its peak, "
            f"over max_memory={_size(max_memory).strip()}. Largest parts: {top}. To fit: "
            + ("; or ".join(fixes) if fixes else "a smaller model or batch, or more ranks") + ". Nothing ran.")

    def fractions(self, max_memory: int) -> tuple | None:
        """Fractions for the step's offload_state tiers (``fs.offload_state(stores, fraction=...)``, one per store)
        that fit this prediction into ``max_memory`` with as much of the state on the device as it allows. The
        bytes over the budget (and a tenth more) move, as a share of ``offload/movable_bytes``, off the device to
        the nearest tier that takes them out of the budget: a store on disk on a CPU mesh, whose in-memory stores
        count against the same RAM (their units go there too, if the device's are not enough), any store on CUDA.
        Under the budget, nine tenths of the room left bring units back from that tier to the device. None without
        offload_state, or when no placement of the state fits (the rest of the step is over the budget). An
        estimate (an offloaded unit's transients differ: reads instead of a resident shard): plan again with them,
        and make the state with them (``fs.init(..., offload=)``: units already in a store stay there)."""
        if not self.tiers:
            return None
        fr = [t[2] for t in self.tiers]
        over = self.predicted_rss - max_memory
        relief = [i for i, t in enumerate(self.tiers) if not t[1] or self.device != "cpu"]
        movable = self.bounds.get("offload/movable_bytes", 0)
        if not relief or movable <= 0:
            return None if over > 0 else tuple(fr)
        to = relief[0]
        if over <= 0:  # room: units of that tier back to the device (its fraction rounded up: whole hundredths)
            fr[to] = math.ceil(100 * max(0.0, fr[to] + 0.9 * over / movable)) / 100
            return tuple(fr)
        need = 1.1 * over / movable
        for j in [None] + [j for j in range(len(fr)) if j not in relief]:  # the device first, then RAM tiers
            have = 1.0 - sum(fr) if j is None else fr[j]
            take = min(need, have)
            fr[to] += take
            if j is not None:
                fr[j] -= take
            need -= take
        if need > 1e-9:
            return None
        return tuple(min(1.0 - sum(fr[:i]) - sum(fr[i + 1:]), math.ceil(x * 100) / 100) if i == to else x
                     for i, x in enumerate(fr))

    def __str__(self) -> str:
        """A table: a header line, then two sections of (what, size) rows in one aligned column, then the DDP
        comparison. Every size is bytes in binary units (``_size``)."""
        f = self.figures
        mem = [(what, f[k]) for k, what in MEMORY] + [("optimizer state in a store", f["mem/store_bytes"])]
        if "store/peak_bytes" in self.bounds:
            mem.append(("the store at its peak (disk for NVMe), at most", self.bounds["store/peak_bytes"]))
        mem += [("peak of fshard-owned memory", f["mem/peak_bytes"]),
                ("peak RSS of this process, predicted", self.predicted_rss)]
        moved = [(what, f[k]) for k, what in TRAFFIC  # (none on a 1-D mesh; none without fs.muon)
                 if k not in ("comm/replica_bytes", "comm/update_bytes") or f[k]]
        w = max(len(what) for what, _ in mem + moved) + 2
        row = lambda what, b: f"  {what:<{w}}{_size(b)}"  # noqa: E731
        lines = [f"fshard step plan: rank {self.rank} of {self.world_size}, {self.micro_batches} micro-batch(es), "
                 f"donate={self.donate}", "memory on this rank"]
        lines += [row(what, b) + ("  (+ activations)" if what == "peak of fshard-owned memory" else "")
                  for what, b in mem]
        lines += ["moved per step by this rank"] + [row(what, b) for what, b in moved]
        ddp = 16 * self.params  # fp32 param + grad + two moments, replicated
        lines.append(f"DDP with fp32 AdamW would hold {_size(ddp).strip()} of parameters, gradients and moments per "
                     f"rank; this step holds {_size(f['mem/state_bytes'] + f['mem/grad_shard_peak_bytes']).strip()}")
        if self.unknown:
            lines.append(f"(not planned: {', '.join(self.unknown)}: its policy has no plan)")
        return "\n".join(line.rstrip() for line in lines)


def _size(b: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:9.1f} {unit}"
    return f"{b:9d} B  "


def state_figures(state) -> dict:
    """Bytes of ``state`` on this rank (``TrainState.nbytes``): parameter shards, their low-precision copies,
    optimizer tensors in memory, buffers, and optimizer state held in a store."""
    nb = state.nbytes()
    f = {"mem/params_bytes": nb["params"], "mem/copies_bytes": nb["copies"], "mem/opt_state_bytes": nb["opt_state"],
         "mem/buffers_bytes": nb["buffers"], "mem/store_bytes": nb["stored"]}
    f["mem/state_bytes"] = nb["params"] + nb["copies"] + nb["opt_state"] + nb["buffers"]
    return f


def new_state_bytes(old, new) -> int:
    """Bytes of tensors in ``new`` (params, their copies and optimizer state) that ``old`` does not hold: what the
    update allocated."""
    def tensors(s):
        leaves = optree.tree_leaves((s.params, s.copies, s.opt_state), namespace=NAMESPACE)
        return [t for t in leaves if isinstance(t, torch.Tensor)]
    have = {t.untyped_storage().data_ptr() for t in tensors(old)}
    return sum(t.nbytes for t in tensors(new) if t.untyped_storage().data_ptr() not in have)


def peak_bytes(f: dict) -> int:
    """The peak of fshard-owned memory, from the figures (planned or measured): state plus the peaks of what a
    step adds, summed (a bound: those peaks need not coincide)."""
    return f["mem/state_bytes"] + sum(f.get(k, 0) for k in (
        "mem/new_state_bytes", "mem/peak_gathered_bytes", "mem/unit_grad_bytes", "mem/reduce_buffer_bytes",
        "mem/grad_shard_peak_bytes", "mem/accum_bytes", "mem/param_read_bytes"))


