"""fs.muon and fs.partition (issue #40) against their torch twins, on the awkward model (tests/models.py: tied
embedding/head, frozen, unused, 0-dim, prime shapes, a unit applied twice).

- Oracle: DDP + the torch twins on the same global batches, at world sizes 1, 2 and 3, losses and parameters
  within 1e-6 (bitwise at 1 and 2): fs.muon over the awkward model with its non-matrix parameters frozen against
  torch.optim.Muon; fs.partition(muon + adamw) against torch.optim.Muon and torch.optim.AdamW over the same groups;
  fs.partition(adamw + adamw of other hyperparameters) against two torch AdamWs; fs.partition(adafactor + adamw)
  against torch.optim.Adafactor + torch.optim.AdamW (within 1e-6, as Adafactor alone).
- The state: a parameter holds only its own optimizer's rows (no AdamW moments for a Muon matrix).
- fs.adafactor against torch.optim.Adafactor the same way, within 1e-6 (its whole-parameter norms are sums of the
  ranks' partial sums), and its checkpoint entries (row_var, col_var, variance, step) get_optimizer_state_dict's
  keys and shapes; a 3-D parameter cut mid-row by the shard boundary, factored per leading index, at 1 and 2 ranks.
- The Newton-Schulz work: at world size 2 each rank orthogonalises half of the matrices (calls counted).
- fs.save / fs.load: the keys torch's optimizers save (momentum_buffer for Muon's, exp_avg/exp_avg_sq/step for
  AdamW's), a resumed run bitwise an uninterrupted one at world sizes 1 and 2, and a checkpoint resharded through
  1 and 3 ranks continuing bitwise.
- Composed with gather_ahead, bucket_reduce and clipping at world size 2, against DDP + the twins.
- Clipping (the gradient scale reaches Muon's momentum and Adafactor's statistics) against clip_grad_norm_, and
  bf16 parameter copies kept equal to the new parameters.
- Property tests: the Newton-Schulz deal (one rank per matrix, within the greedy bound) and compact rows (a label's
  slots back to back, in order, on every rank).
- fs.offload_state (CPU store with the parameter shards, NVMe store for half the units) at world sizes 1 and 2:
  bitwise the run in memory, whole units read and written back one at a time, and a checkpoint of the offloaded
  state loading into a store and into memory, continuing bitwise; the rows read back alive for one unit at a time.
- Misuse: a non-2-D parameter given to Muon names the parameter and fs.partition; a label that names no optimizer.
- Adafactor's shard read as rows of its matrices: any range a shard holds gives the row and column sums and the
  variance estimate of the per-element formula (a property test).
- Muon's exchange (two all-to-alls a unit) moves exactly each rank's pieces, counted in ``comm/update_bytes``, at
  world sizes 2 and 3, with the same results as DDP + torch.optim.Muon.
- The update's pipeline: ``DeviceUpdate`` runs phased updates in ``pipeline``'s order (a property test), the order
  the exchanges are promised in; the update's exchanges are checked in one check a step; a rank whose Newton-Schulz
  or whose exchange's issue raises mid-update leaves no rank waiting (every rank raises an fshard error) and the
  retried step ends as a clean run.
"""
from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fshard as fs
from _dist import run_ranks
from models import Awkward, awkward_batches, awkward_loss, check_oracle, oracle_step, param_diffs

STEPS = 5
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _matrix(name, p) -> str:
    return "muon" if p.ndim == 2 and not name.startswith("emb") else "adamw"


def _bias(name, p) -> str:  # Adafactor gets matrices (factored) and LayerNorm weights, scale, prime (variance)
    return "adamw" if name.startswith("emb") or name.endswith(".bias") else "factored"


def _decay(name, p) -> str:
    return "fast" if p.ndim >= 2 else "slow"


CASES = {  # name -> (fshard optimizer, label_fn or None, torch optimizers per label)
    "muon": (lambda: fs.muon(**MUON), None, {"all": lambda ps: torch.optim.Muon(ps, **MUON)}),
    "muon+adamw": (lambda: fs.partition({"muon": fs.muon(**MUON), "adamw": fs.adamw(**ADAMW, impl="torch")}, _matrix),
                   _matrix, {"muon": lambda ps: torch.optim.Muon(ps, **MUON),
                             "adamw": lambda ps: torch.optim.AdamW(ps, **ADAMW)}),
    "adamw+adamw": (lambda: fs.partition({"fast": fs.adamw(**ADAMW, impl="torch"),
                                          "slow": fs.adamw(lr=1e-3, weight_decay=0.0, impl="torch")}, _decay),
                    _decay, {"fast": lambda ps: torch.optim.AdamW(ps, **ADAMW),
                             "slow": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)}),
    "adafactor": (lambda: fs.adafactor(lr=1e-2, weight_decay=0.1), None,
                  {"all": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.1)}),
    "adafactor+adamw": (lambda: fs.partition({"factored": fs.adafactor(lr=1e-2, weight_decay=0.1),
                                              "adamw": fs.adamw(**ADAMW, impl="torch")}, _bias),
                        _bias, {"factored": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.1),
                                "adamw": lambda ps: torch.optim.AdamW(ps, **ADAMW)}),
    # a row that starts at a value of its own (Adagrad's initial_accumulator_value) inside a partition
    "adagrad+adamw": (lambda: fs.partition({"fast": fs.optim.adagrad(lr=0.05, initial_accumulator_value=0.1,
                                                                     impl="native"),
                                            "slow": fs.adamw(lr=1e-3, weight_decay=0.0, impl="torch")}, _decay),
                      _decay, {"fast": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
                               "slow": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)}),
}
# Adafactor's whole-parameter norms are sums of the ranks' partial sums in fshard, torch.norm over the tensor in
# torch: equal up to summation order (1e-7), so it is held to 1e-6, not bitwise
BITWISE = {"muon", "muon+adamw", "adamw+adamw", "adagrad+adamw"}


def _model(case: str):
    torch.manual_seed(0)
    model = Awkward()
    if case == "muon":  # Muon alone takes matrices only: the others frozen (still tied, prime, used twice)
        for p in model.parameters():
            p.requires_grad_(p.ndim == 2)
    return model


class _Both:
    """The torch twins of a partition, stepped one after the other (as a training script steps two optimizers)."""

    def __init__(self, opts):
        self.opts = opts

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.opts:
            o.step()


def _twins(case: str, ref):
    _, label_fn, make = CASES[case]
    groups = {label: [] for label in make}
    for n, p in ref.named_parameters():
        if p.requires_grad:
            groups["all" if label_fn is None else label_fn(n, p)].append(p)
    return _Both([make[label](ps) for label, ps in groups.items() if ps])


def _count_ns():
    """Wrap Newton-Schulz to count its calls on this rank (returns the list it appends each matrix shape to)."""
    import fshard.optim._muon as m
    calls, ns = [], m._newton_schulz

    def counted(g, *args):
        calls.append(tuple(g.shape))
        return ns(g, *args)
    m._newton_schulz = counted
    return calls


def _compare(case: str, shard_size: int | None = None):
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env(shard_size=shard_size)
    calls = _count_ns()
    model = _model(case)
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, CASES[case][0]())
    ddp = DDP(ref, find_unused_parameters=True) if mesh.world_size > 1 else ref
    opt = _twins(case, ref)
    ours, theirs = [], []
    with fs.compose(awkward_loss) as step:
        for batch in awkward_batches(2, STEPS, rank=mesh.rank, world_size=mesh.world_size):
            state, metrics = step(state, batch)
            ours.append(metrics["loss"])
            theirs.append(oracle_step(ddp, opt, awkward_loss, batch, mesh.world_size))
    diffs, equal = param_diffs(fs.full_params(state), ref)
    moved = min((ref.get_parameter(n) - p).abs().max().item() for n, p in _model(case).named_parameters()
                if p.requires_grad and n != "unused" and not n.startswith("blocks.2."))  # (no gradient)
    rows = {u: {label: {r: t.numel() for r, t in part.items()} for label, part in s.parts.items()}
            for u, s in state.opt_state.items()} if "+" in case else None
    return ours, theirs, diffs, equal and ours == theirs, len(calls), rows, moved


def _all_cases():
    return {case: _compare(case) for case in CASES}


def _on_2d(cases, shard_size):
    return {case: _compare(case, shard_size) for case in cases}


def test_on_a_2d_mesh_the_collective_updates_run_in_the_shard_group():
    """2 x 2 (HSDP): Muon's matrices dealt over the shard group (each replica group orthogonalises its own, the
    same), Adafactor's partial statistics summed over it (each shard once): still DDP + the torch twins."""
    cases = ("muon+adamw", "adafactor")
    results = run_ranks(_on_2d, 4, cases, 2)
    for rank_result in results:
        for case, (ours, theirs, diffs, bitwise, *_) in rank_result.items():
            check_oracle(case, 4, "sums", ours, theirs, diffs, bitwise)
    calls = [r["muon+adamw"][4] for r in results]  # 4 matrices a step, each once per replica group
    assert sum(calls) == 2 * 4 * STEPS and calls[0] + calls[1] == calls[2] + calls[3] == 4 * STEPS, calls


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_matches_ddp_and_the_torch_twins(world_size):
    results = run_ranks(_all_cases, world_size) if world_size > 1 else [_all_cases()]
    for rank_result in results:
        for case, (ours, theirs, diffs, bitwise, *_) in rank_result.items():
            assert len(ours) == STEPS
            check_oracle(case, world_size, "torch" if case in BITWISE else "sums", ours, theirs, diffs, bitwise)
    for case in CASES:  # every parameter with a gradient moved (equal to the twins, and not by standing still)
        assert results[0][case][6] > 1e-5, case
    # Newton-Schulz: once per step for each matrix with a gradient (blocks.0/1.lin, up, down, and with Muon alone
    # the tied embedding; blocks.2 is never called), each on one rank only. At world size 2 the model-wide deal
    # (by FLOPs: up and down first, one to each rank) gives each rank half of them, or one more for an odd count.
    for case, per_step in (("muon", 5), ("muon+adamw", 4)):
        calls = [r[case][4] for r in results]
        assert sum(calls) == per_step * STEPS, (case, calls)
        if world_size == 2:
            assert sorted(calls) == [per_step // 2 * STEPS, (per_step + 1) // 2 * STEPS], (case, calls)
    assert sum(r[c][4] for r in results for c in ("adamw+adamw", "adafactor", "adafactor+adamw", "adagrad+adamw")) == 0


def test_each_parameter_holds_only_its_own_optimizers_rows():
    rows = _all_cases()["muon+adamw"][5]
    # blocks.0: lin.weight (8x8) is Muon's; lin.bias, ln.weight, ln.bias (8 each, each padded to 16 fp32) AdamW's
    assert rows["blocks.0"] == {"muon": {"momentum_buffer": 64}, "adamw": {"exp_avg": 48, "exp_avg_sq": 48}}
    state = fs.init(_model("muon+adamw"), fs.Mesh.local(), CASES["muon+adamw"][0]())
    # Adafactor in a partition: a variance for its unfactored parameters only (ln.weight, 8 padded to 16), factors
    # for its matrices only, AdamW's moments for the biases (lin.bias, ln.bias: 2 x 16)
    s = fs.init(_model("adafactor+adamw"), fs.Mesh.local(), CASES["adafactor+adamw"][0]()).opt_state["blocks.0"]
    assert {r: t.numel() for r, t in s.parts["factored"].items()} == {"variance": 16}
    assert {n: {k: tuple(t.shape) for k, t in f.items()} for n, f in s.extra["factored"].items()} == {
        "blocks.0.lin.weight": {"row_var": (8, 1), "col_var": (1, 8)}}
    assert {r: t.numel() for r, t in s.parts["adamw"].items()} == {"exp_avg": 32, "exp_avg_sq": 32}
    for u in state.spec.units:  # every element of the optimizer range in one label's rows: Muon's or AdamW's
        parts = state.opt_state[u.name].parts
        m, v = parts["adamw"]["exp_avg"].numel(), parts["adamw"]["exp_avg_sq"].numel()
        assert parts["muon"]["momentum_buffer"].numel() + m == u.opt_numel(0) and m == v, u.name


def _resume(case: str, path: str | None, phase: str):
    """"all": STEPS steps; "first": 2 steps, then save; "second": load, the rest. Returns losses, params, and the
    checkpoint's optimizer entries (key -> shape) after "first"."""
    mesh = fs.Mesh.from_env()
    state = fs.init(_model(case), mesh, CASES[case][0]())
    batches = list(awkward_batches(2, STEPS, rank=mesh.rank, world_size=mesh.world_size))
    batches = {"all": batches, "first": batches[:2], "second": batches[2:]}[phase]
    if phase == "second":
        state = fs.load(path, like=state)
    losses = []
    with fs.compose(awkward_loss) as step:
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
    keys = None
    if phase == "first":
        fs.save(path, state)
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader(path).read_metadata().state_dict_metadata
        keys = {k: tuple(getattr(v, "size", ())) for k, v in md.items() if k.startswith("optim")}
    return losses, {k: v.numpy().copy() for k, v in fs.full_params(state).items()}, keys


def _torch_keys(case: str) -> dict:
    """The optimizer entries (key -> shape) of get_optimizer_state_dict after 2 steps of the torch twin (one rank)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    ref = _model(case)
    opt = _twins(case, ref).opts[0]
    for b in list(awkward_batches(2, 2)):
        oracle_step(ref, opt, awkward_loss, b, 1)
    sd = get_optimizer_state_dict(ref, opt)
    return {f"optim.state.{n}.{k}": tuple(v.shape) for n, e in sd["state"].items() for k, v in e.items()}


def _resumed_bitwise(tmp_path, world_size: int, case: str):
    """Trained whole, and trained, saved and resumed: the same losses and parameters. Returns the saving run's."""
    path = str(tmp_path / "ckpt")
    whole = run_ranks(_resume, world_size, case, None, "all")[0]
    first = run_ranks(_resume, world_size, case, path, "first")[0]
    second = run_ranks(_resume, world_size, case, path, "second")[0]
    assert whole[0] == first[0] + second[0]
    assert all((whole[1][k] == second[1][k]).all() for k in whole[1])
    return first


@pytest.mark.parametrize("world_size", [1, 2])
def test_adafactor_checkpoints_as_torch_and_resumes_bitwise(tmp_path, world_size):
    first = _resumed_bitwise(tmp_path, world_size, "adafactor")
    ours = {k: v for k, v in first[2].items() if k.startswith("optim.state.")}
    assert ours == _torch_keys("adafactor")  # row_var (R, 1), col_var (1, C), variance, step: torch's keys, shapes
    assert ours["optim.state.up.weight.row_var"] == (37, 1) and "optim.state.prime.variance" in ours


@pytest.mark.parametrize("world_size", [1, 2])
def test_save_load_keeps_torchs_keys_and_resumes_bitwise(tmp_path, world_size):
    first = _resumed_bitwise(tmp_path, world_size, "muon+adamw")
    keys = set(first[2])
    assert {"optim.state.up.weight.momentum_buffer", "optim.state.emb.weight.exp_avg",
            "optim.state.emb.weight.exp_avg_sq", "optim.state.emb.weight.step"} <= keys
    assert not any(k.startswith("optim.state.up.weight.") and not k.endswith("momentum_buffer") for k in keys)
    assert not any(k.startswith("optim.state.unused.") for k in keys)  # never updated: no state, as in torch
    # the groups as torch's two optimizers write them: Muon's first (its label first), then AdamW's
    assert "optim.param_groups.0.ns_steps" in keys and "optim.param_groups.1.betas" in keys


def _offloaded(case: str, directory: str, path: str):
    """Per config (in memory; a CPUStore with the parameter shards too, donated; an NVMeStore for half the units): 3
    steps' losses and every state leaf (stored ones read back), with a checkpoint saved after 2 steps and loaded into an
    offloaded state and into an in-memory one, each stepped once more; and the whole-unit path's read peak."""
    from fshard.testing import snapshot
    mesh = fs.Mesh.from_env()
    batches = list(awkward_batches(2, 3, rank=mesh.rank, world_size=mesh.world_size))
    stores = {"none": lambda tag: None,
              "cpu": lambda tag: fs.offload_state(fs.CPUStore(), chunk_mb=0.001, params=True),
              "nvme": lambda tag: fs.offload_state(fs.NVMeStore(f"{directory}/{tag}/r{mesh.rank}"), fraction=0.5,
                                                   chunk_mb=0.001)}
    out = {}
    for key, make in stores.items():
        off = make("run")
        state = fs.init(_model(case), mesh, CASES[case][0]())
        losses, peaks = [], []
        with fs.compose(awkward_loss, *(() if off is None else (off,)), donate=key == "cpu") as step:
            for i, b in enumerate(batches):  # (cpu: donated, written back over the input's items)
                planned = step.plan(state, b).bounds.get("store/buffer_bytes") if off is not None and i else None
                state, m = step(state, b)
                losses.append(m["loss"])
                peaks.append((m.get("offload/whole_unit_peak_bytes"), m.get("io/read_bytes"), planned))
                if i == 1 and off is not None:
                    fs.save(f"{path}/{key}", state)
            resumed = []
            for like_off in (make("load"), None):  # into the store again, and into memory
                like = fs.init(_model(case), mesh, CASES[case][0](), offload=like_off)
                loaded = fs.load(f"{path}/{key}", like=like, offload=like_off) if off is not None else None
                if loaded is not None:
                    with fs.compose(awkward_loss, *(() if like_off is None else (like_off,))) as again:
                        loaded, _ = again(loaded, batches[2])
                    resumed.append([t.numpy().copy() for t in snapshot(loaded)])
        out[key] = (losses, [t.numpy().copy() for t in snapshot(state)], peaks, resumed)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case", ["muon+adamw", "adafactor"])
def test_offload_state_updates_whole_units_bitwise(tmp_path, world_size, case):
    # fs.muon's collective update, fs.partition's compact rows and fs.adafactor's factored rows do not stream run
    # by run: offload_state reads each unit whole, runs the in-memory update and writes it back (issue #40)
    for r, got in enumerate(run_ranks(_offloaded, world_size, case, str(tmp_path / "nvme"), str(tmp_path / "ck"))):
        ref_losses, ref_leaves = got["none"][:2]
        for key in ("cpu", "nvme"):
            losses, leaves, peaks, resumed = got[key]
            assert losses == ref_losses, (key, r)
            assert len(leaves) == len(ref_leaves) and all(
                torch.equal(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(leaves, ref_leaves)), (key, r)
            for other in resumed:  # saved after 2 steps, loaded (into a store, into memory), one step more; the
                # step counts aside: torch's Muon saves none, so a load starts Muon's parameters' counts at 0
                assert len(other) == len(ref_leaves) and all(
                    torch.equal(torch.from_numpy(a), torch.from_numpy(b))
                    for a, b in zip(other, ref_leaves) if a.dtype != "int64"), (key, r)
            assert len(resumed) == 2
            # one unit's rows (and shard) read into memory at a time: all units' reads together are more (CPU:
            # every unit in the store, read each step)
            for peak, read, planned in peaks[1:]:
                assert 0 < peak <= read and (peak < read or key == "nvme"), (key, peaks)
                assert 2 * peak <= planned, (key, peaks)  # step.plan counts the unit read and its items written


def test_offload_state_holds_one_unit_read_at_a_time(monkeypatch):
    # every row read back from the store (Stored.load) is watched: when a unit's rows are read, no other unit's
    # rows read before are still alive (one unit resident beyond the in-memory working set, not the model)
    import weakref

    from fshard.state._stored import Stored
    read, most, load = [], [0], Stored.load

    def watched(self):
        alive = {k for k, r in read if r() is not None and k != self.key}
        most[0] = max(most[0], len(alive) + 1)
        t = load(self)
        read.append((self.key, weakref.ref(t)))
        return t

    monkeypatch.setattr(Stored, "load", watched)
    for donate in (False, True):
        state = fs.init(_model("muon+adamw"), fs.Mesh.local(), CASES["muon+adamw"][0]())
        with fs.compose(awkward_loss, fs.offload_state(fs.CPUStore(), params=True), donate=donate) as step:
            for b in awkward_batches(2, 3):
                state, _ = step(state, b)
        units = {k.split("@")[0] for k, _ in read}  # (the units updated: those that got a gradient)
        assert len(units) >= 3 and most[0] == 1, (donate, most, units)


def test_misuse_names_the_parameter_and_the_fix():
    with pytest.raises(fs.ArgumentError, match=r"parameter '(scale|blocks.0.lin.bias)' has shape.*fs.partition"):
        fs.init(Awkward(), fs.Mesh.local(), fs.muon())
    with pytest.raises(fs.ArgumentError, match=r"returned 'other'.*\['adamw', 'muon'\]"):
        fs.init(Awkward(), fs.Mesh.local(), fs.partition({"muon": fs.muon(), "adamw": fs.adamw()},
                                                          lambda n, p: "other"))
    with pytest.raises(fs.ArgumentError, match="beta2_decay"):
        fs.adafactor(beta2_decay=0.5)
    with pytest.raises(fs.ArgumentTypeError, match="non-empty dict"):
        fs.partition({}, _matrix)
    from fshard.state._flat import plan_unit  # a collective update called without collectives on a sharded unit
    layout = plan_unit("u", "u", [(("w",), (4, 4), True)], torch.float32, 2)
    for opt in (fs.muon(), fs.adafactor()):
        shard = torch.ones(layout.shard_numel)
        with pytest.raises(fs.ArgumentError, match="needs the step's collectives"):
            opt.update(layout, 0, shard, shard, opt.init(layout, 0, shard), [True], donate=False)
    with pytest.raises(fs.ArgumentError, match="ns_steps"):
        fs.muon(ns_steps=100)
    with pytest.raises(fs.ArgumentError, match="adjust_lr_fn"):
        fs.muon(adjust_lr_fn="other")


@pytest.mark.parametrize("case", ["muon+adamw", "adafactor"])
def test_param_copies_follow_the_update(case):
    """The bf16 parameter copies (fs.mixed_precision) are the new parameters, cast, in every unit after each step."""
    model = _model(case)
    names = {n for n, _ in model.named_parameters()}
    state = fs.init(model, fs.Mesh.local(), CASES[case][0]())
    with fs.compose(awkward_loss, fs.mixed_precision(torch.bfloat16)) as step:
        for batch in awkward_batches(2, 2):
            state, _ = step(state, batch)
    full = fs.full_params(state)
    for u in state.spec.units:
        p, c = state.params[u.name], state.copies.get(u.name)
        assert c is not None and c.dtype == torch.bfloat16 and torch.equal(c, p.to(torch.bfloat16)), u.name
    assert set(full) == names


@pytest.mark.parametrize("case", ["muon+adamw", "adafactor"])
def test_clipping_matches_torchs_clip_grad_norm(case):
    """fs.clip_by_global_norm's scale reaches Muon's momentum and Adafactor's statistics as torch's clipped .grad."""
    model = _model(case)
    ref = copy.deepcopy(model)
    state = fs.init(model, fs.Mesh.local(), CASES[case][0]())
    opt = _twins(case, ref)
    with fs.compose(awkward_loss, fs.clip_by_global_norm(0.05)) as step:
        for batch in awkward_batches(2, 3):
            state, _ = step(state, batch)
            oracle_step(ref, opt, awkward_loss, batch, 1, max_norm=0.05)
    diffs, _ = param_diffs(fs.full_params(state), ref)
    assert max(diffs.values()) <= 1e-6, diffs


@given(shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), max_size=12),
       world_size=st.integers(1, 5))
def test_deal_gives_each_matrix_one_rank_within_the_lpt_bound(shapes, world_size):
    """Every matrix to one rank in range; the most loaded rank carries at most the least loaded's FLOPs plus one
    matrix's (the greedy bound), and the deal is a function of its arguments."""
    from fshard.optim._muon import _ns_flops, deal
    matrices = tuple((f"m{i}", s) for i, s in enumerate(shapes))
    table = deal(matrices, world_size)
    assert set(table) == {n for n, _ in matrices} and all(0 <= r < world_size for r in table.values())
    load = [0] * world_size
    for n, s in matrices:
        load[table[n]] += _ns_flops(s)
    assert max(load) <= min(load) + max((_ns_flops(s) for _, s in matrices), default=0)
    assert deal.__wrapped__(matrices, world_size) == table


@given(sizes=st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=8),
       world_size=st.integers(1, 4), data=st.data())
def test_compact_rows_tile_their_slots_in_order(sizes, world_size, data):
    """A partition's row holds exactly its label's slots, back to back in slot order, on every rank."""
    from fshard.optim._protocol import row_numel, row_ranges
    from fshard.state._flat import plan_unit
    params = [((f"p{i}",), (n,), True) for i, (n, _) in enumerate(sizes)]
    layout = plan_unit("u", "u", params, torch.float32, world_size)
    labels = tuple((f"p{i}", "a" if on else "b") for i, (_, on) in enumerate(sizes))
    part = fs.optim.Partition((("a", fs.adamw()), ("b", fs.adamw())), _matrix, labels)  # (labels as bind makes)
    rank = data.draw(st.integers(0, world_size - 1))
    total = 0
    for i in range(len(part.rows)):
        want = "a" if i < 2 else "b"
        got = row_ranges(part, layout, rank, i)
        assert [k for k, *_ in got] == [k for k, (_, lab) in enumerate(labels) if lab == want]
        at = 0
        for _, lo, hi, a in got:
            assert a == at
            at += max(0, hi - lo)
        assert at == row_numel(part, layout, rank, i)
        total += at if i in (0, 2) else 0
    assert total == layout.opt_numel(rank)  # the two labels' first rows split the optimizer range between them


def _reshard(case: str, path: str, again: str):
    """Load at this world size and save again (compact rows and factors through another cut of the shards)."""
    state = fs.load(path, like=fs.init(_model(case), fs.Mesh.from_env(), CASES[case][0]()))
    fs.save(again, state)
    return {k: v.numpy().copy() for k, v in fs.full_params(state).items()}


@pytest.mark.parametrize("case", ["muon+adamw", "adafactor", "adafactor+adamw"])
def test_a_checkpoint_resharded_through_1_and_3_ranks_resumes_bitwise(tmp_path, case):
    """Saved at 2, loaded and saved again at 1 and at 3, loaded at 2: the run continues bitwise as from the
    original checkpoint, so every row (compact, at its shifted place) and factor went through the other cuts intact."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_resume, 2, case, path, "first")[0][1]
    continued = run_ranks(_resume, 2, case, path, "second")[0]
    for n in (1, 3):
        again = str(tmp_path / f"at{n}")
        for full in run_ranks(_reshard, n, case, path, again):
            assert all((saved[k] == full[k]).all() for k in saved), n
        back = run_ranks(_resume, 2, case, again, "second")[0]
        assert back[0] == continued[0] and all((back[1][k] == continued[1][k]).all() for k in saved), (case, n)


def _composed(case: str):
    """fshard with gather_ahead, bucket_reduce and clipping against DDP + the twins with clip_grad_norm_."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env()
    model = _model(case)
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, CASES[case][0]())
    ddp, opt = DDP(ref, find_unused_parameters=True), _twins(case, ref)
    extra = (fs.gather_ahead(1), fs.bucket_reduce(bucket_mb=0.001), fs.clip_by_global_norm(0.05))
    with fs.compose(awkward_loss, *extra) as step:
        for batch in awkward_batches(2, 3, rank=mesh.rank, world_size=mesh.world_size):
            state, _ = step(state, batch)
            oracle_step(ddp, opt, awkward_loss, batch, mesh.world_size, max_norm=0.05)
    return max(param_diffs(fs.full_params(state), ref)[0].values())


@pytest.mark.parametrize("case", ["muon+adamw", "adafactor"])
def test_the_collective_updates_compose_with_the_other_transforms(case):
    """Their collectives come after gather_ahead's and bucket_reduce's in every rank's order (the step's collective
    check passes), and the gradient scale of clipping reaches them, at world size 2."""
    for d in run_ranks(_composed, 2, case):
        assert d <= 1e-6, (case, d)


class _Tensor3(torch.nn.Module):
    """A 3-D parameter (Adafactor factors its last two dims per leading index), cut by the shard boundary."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 5, 7) * 0.3)
        self.b = torch.nn.Parameter(torch.zeros(7))

    def forward(self, x):
        return torch.einsum("nk,ckj->ncj", x, self.w).sum(1) + self.b


def _tensor3():
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env()
    model = _Tensor3()
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, fs.adafactor(lr=1e-2, weight_decay=0.1))
    ddp = DDP(ref) if mesh.world_size > 1 else ref
    opt = torch.optim.Adafactor(ref.parameters(), lr=1e-2, weight_decay=0.1)
    loss_fn = lambda m, b: (m(b[0]) - b[1]).pow(2).mean()  # noqa: E731
    g = torch.Generator().manual_seed(1)
    with fs.compose(loss_fn) as step:
        for _ in range(3):
            x, y = torch.randn(4 * mesh.world_size, 5, generator=g), torch.randn(4 * mesh.world_size, 7, generator=g)
            b = (x[4 * mesh.rank:4 * mesh.rank + 4], y[4 * mesh.rank:4 * mesh.rank + 4])
            state, _ = step(state, b)
            oracle_step(ddp, opt, loss_fn, b, mesh.world_size)
    return max(param_diffs(fs.full_params(state), ref)[0].values()), tuple(state.opt_state["<root>"].factors[
        "w"]["row_var"].shape)


@pytest.mark.parametrize("world_size", [1, 2])
def test_adafactor_factors_a_3d_parameter_per_leading_index(world_size):
    for d, shape in run_ranks(_tensor3, world_size):
        assert shape == (3, 5, 1) and d <= 1e-6, (d, shape)


# --- Adafactor on a bf16 model (review, session 23) ---

def test_adafactor_on_a_bf16_model_is_bitwise_torchs():
    """A bf16 model without mixed precision (Adafactor's usual set-up): the row and column statistics and the norms
    accumulate in fp32 and round to bf16 as torch's norms do (summed in bf16 they drifted 22% off torch's)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 8).to(torch.bfloat16)
    ref, before = copy.deepcopy(model), copy.deepcopy(model)
    loss_fn = lambda m, b: (m(b[0]).float() - b[1]).pow(2).mean()  # noqa: E731
    state = fs.init(model, fs.Mesh.local(), fs.adafactor(lr=1e-2, weight_decay=0.1))
    twin = torch.optim.Adafactor(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    with fs.compose(loss_fn) as step:
        for _ in range(3):
            b = (torch.randn(16, 1024, generator=g).bfloat16(), torch.randn(16, 8, generator=g))
            state, _ = step(state, b)
            twin.zero_grad()
            loss_fn(ref, b).backward()
            twin.step()
    factors = state.opt_state["<root>"].factors["weight"]
    assert torch.equal(factors["row_var"], twin.state[ref.weight]["row_var"])
    assert torch.equal(factors["col_var"], twin.state[ref.weight]["col_var"])
    full = fs.full_params(state)
    for name, p in ref.named_parameters():
        assert torch.equal(full[name], p.detach()), name
        assert not torch.equal(full[name], before.get_parameter(name).detach()), name  # trained, not stood still


# --- a partition's checkpoint keys per member (review, session 23) ---

class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)
        self.unused = torch.nn.Parameter(torch.ones(2))  # never gets a gradient

    def forward(self, x):
        return self.b(self.a(x))


def _nadam_or_adagrad(name, p) -> str:
    return "nadam" if name.endswith("weight") else "adagrad"


def test_a_partitions_checkpoint_has_each_members_keys_as_its_torch_twin(tmp_path):
    """NAdam (through from_torch: its mu_product is replayed, not stored) for the weights and Adagrad (which makes
    every parameter's state when built, the unused one's too) for the rest: fs.save writes the keys that
    get_optimizer_state_dict writes for the two torch optimizers over the same groups."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = _TwoLayers()
    ref = copy.deepcopy(model)
    loss_fn = lambda m, b: (m(b[0]) - b[1]).pow(2).mean()  # noqa: E731
    opt = fs.partition({"nadam": fs.optim.from_torch(torch.optim.NAdam, lr=1e-3),
                        "adagrad": fs.optim.adagrad(lr=0.05)}, _nadam_or_adagrad)
    state = fs.init(model, fs.Mesh.local(), opt)
    groups = {label: [p for n, p in ref.named_parameters() if _nadam_or_adagrad(n, p) == label]
              for label in ("nadam", "adagrad")}
    twins = [torch.optim.NAdam(groups["nadam"], lr=1e-3), torch.optim.Adagrad(groups["adagrad"], lr=0.05)]
    b = (torch.randn(8, 4), torch.randn(8, 1))
    with fs.compose(loss_fn) as step:
        state, _ = step(state, b)
    loss_fn(ref, b).backward()
    for t in twins:
        t.step()
    fs.save(str(tmp_path), state)
    ours = {k[len("optim."):] for k in FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
            if k.startswith("optim.state.")}
    theirs = {f"state.{n}.{k}" for n, entry in get_optimizer_state_dict(ref, twins)["state"].items() for k in entry}
    assert "state.a.weight.mu_product" in theirs and "state.unused.sum" in theirs  # what the fix is about
    assert ours == theirs, (sorted(ours ^ theirs))


# --- Adafactor's shard read as rows of its matrices (issue #40, benchmarks/optim.py) ---


@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=3), data=st.data())
def test_adafactor_row_and_column_sums_of_a_cut_shard_are_the_per_element_formula(shape, data):
    """Any range of a matrix (or a stack of them) that a shard holds, read as whole rows: its row and column sums
    and the outer product row_var[r] * col_var[c] equal the per-element indexing they replaced."""
    from fshard.optim._adafactor import _matrices, _whole_rows
    numel, c, r = math.prod(shape), shape[-1], shape[-2]
    a = data.draw(st.integers(0, numel - 1))
    e = data.draw(st.integers(a + 1, numel))
    sq = torch.rand(e - a, dtype=torch.float64)
    idx = torch.arange(a, e)
    rows, cols = torch.zeros(numel // c, dtype=torch.float64), torch.zeros(numel // (r * c) * c, dtype=torch.float64)
    r0, m = _whole_rows(sq, a, c)
    rows[r0:r0 + m.shape[0]] += m.sum(dim=1)
    est = torch.empty(m.shape, dtype=torch.float64)
    rv, cv = torch.rand(rows.shape, dtype=torch.float64), torch.rand(cols.shape, dtype=torch.float64)
    for b, lo, hi in _matrices(r0, m.shape[0], r):
        cols[b * c:(b + 1) * c] += m[lo:hi].sum(dim=0)
        torch.mul(rv[r0 + lo:r0 + hi, None], cv[None, b * c:(b + 1) * c], out=est[lo:hi])
    col_of = (idx // (r * c)) * c + idx % c
    assert torch.allclose(rows, torch.zeros_like(rows).index_add_(0, idx // c, sq), rtol=1e-12, atol=0)
    assert torch.allclose(cols, torch.zeros_like(cols).index_add_(0, col_of, sq), rtol=1e-12, atol=0)
    assert torch.equal(est.view(-1)[a - r0 * c:a - r0 * c + e - a], rv[idx // c] * cv[col_of])


# --- Muon's exchange: exact pieces (issue #40) ---

def _exchange_run(steps: int):
    """muon+adamw for ``steps`` steps beside DDP + the twins, traced: the losses, the parameter diffs, this rank's
    ``comm/update_bytes`` per step (and step.plan's), its trace, and the bytes its exact pieces make (from the layouts, each matrix
    with a gradient: this rank's elements of another rank's matrix go out in fp32, the others' elements of its own
    come back in bf16)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fshard.optim._muon import owners
    mesh = fs.Mesh.from_env()
    model = _model("muon+adamw")
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, CASES["muon+adamw"][0]())
    ddp, opt = DDP(ref, find_unused_parameters=True), _twins("muon+adamw", ref)
    ours, theirs, sent, traces = [], [], [], []
    with fs.compose(awkward_loss, trace=True) as step:
        for batch in awkward_batches(2, steps, rank=mesh.rank, world_size=mesh.world_size):
            planned = step.plan(state, batch)["comm/update_bytes"]
            state, metrics = step(state, batch)
            ours.append(metrics["loss"])
            sent.append((metrics["comm/update_bytes"], planned))
            traces.append(metrics["trace/collectives"])
            theirs.append(oracle_step(ddp, opt, awkward_loss, batch, mesh.world_size))
    muon, n, r = dict(state.spec.optimizer.optimizers)["muon"], mesh.world_size, mesh.rank
    graded = {name for name, p in ref.named_parameters() if p.grad is not None}
    exact, padded = 0, 0
    for u in state.spec.units:
        slots = [k for k, s in enumerate(u.trainable) if s.name in graded and _matrix(s.name, torch.empty(s.shape, device="meta")) == "muon"]
        own = owners(u, slots, n, muon.matrices)
        lo, hi = u.shard_range(r)
        for k in slots:
            s = u.trainable[k]
            held = max(0, min(hi, s.offset + s.numel) - max(lo, s.offset))
            exact += 4 * held if own[k] != r else 2 * (s.numel - held)
        padded += 4 * (sum(u.trainable[k].numel for k in slots) + u.numel) if slots else 0  # the reduces before
    diffs, equal = param_diffs(fs.full_params(state), ref)
    offloaded = fs.init(_model("muon+adamw"), mesh, CASES["muon+adamw"][0]())  # whole units through a store
    with fs.compose(awkward_loss, fs.offload_state(fs.CPUStore(), chunk_mb=0.001)) as step:
        for i, batch in enumerate(awkward_batches(2, 2, rank=mesh.rank, world_size=mesh.world_size)):
            planned = step.plan(offloaded, batch)["comm/update_bytes"]
            offloaded, metrics = step(offloaded, batch)
            sent.append((metrics["comm/update_bytes"], planned if i else exact))  # (the first plan: see below)
    return ours, theirs, diffs, equal and ours == theirs, sent, traces, exact, padded


@pytest.mark.parametrize("world_size", [2, 3])
def test_muons_exchange_moves_exactly_each_ranks_pieces_and_changes_no_result(world_size):
    """Each step moves, per rank, exactly its pieces of the matrices others orthogonalise (fp32) and the results
    of its own matrices for the others' pieces (bf16): no padding, no zero sums (``comm/update_bytes``, as
    step.plan predicts it, in memory and with fs.offload_state); two
    all-to-alls a unit, the same entries on every rank, no reduce of Muon's left; DDP + torch.optim.Muon's results
    (bitwise at 2 ranks, within 1e-6 at 3, as test_matches_ddp_and_the_torch_twins)."""
    results = run_ranks(_exchange_run, world_size, 3)
    for ours, theirs, diffs, bitwise, sent, traces, exact, padded in results:
        check_oracle("muon+adamw", world_size, "torch", ours, theirs, diffs, bitwise)
        # measured, and as step.plan said; before the first step the plan assumes every parameter gets a gradient
        assert exact > 0 and sent[1:] == [(exact, exact)] * 4 and sent[0][0] == exact <= sent[0][1], (sent, exact)
        assert 4 * exact < padded, (exact, padded)  # under a quarter of what the zero-padded reduces moved
        for trace in traces:
            muon = [e for e in trace if "/muon" in e[1]]
            assert muon and all(e[0] == "exchange" for e in muon), muon
            sends = [e[1] for e in muon if not e[1].endswith("/back")]
            backs = [e[1].removesuffix("/back") for e in muon if e[1].endswith("/back")]
            assert sends == backs and all(muon.index(e) < [x[1] for x in muon].index(e[1] + "/back")
                                          for e in muon if not e[1].endswith("/back")), muon  # each out, then back
            # pipelined: the next unit's pieces go out before the results of the one before come back (at 3 ranks
            # the first two units both exchange; at 2, blocks.0's matrices are whole on their owners')
            if world_size == 3:
                assert [e[1] for e in muon][:3] == ["<root>/muon", "blocks.0/muon", "<root>/muon/back"], muon
            assert all(e[2] == ("bfloat16" if e[1].endswith("/back") else "float32") for e in muon), muon
    fs.testing.check_same_collectives([r[5][-1] for r in results])


# --- the update's pipeline and its one check (issue #40) ---

class _Phased:
    """An optimizer whose update of unit i has ``counts[i]`` phases (pauses + 1) and logs (unit, phase) as each
    runs; no exchange_plan (so nothing is promised)."""

    collective = True

    def __init__(self, counts, log):
        self.counts, self.log = counts, log

    def update_phases(self, u, rank, param, grad, state, active, donate, **kw):
        i = int(u.name)
        for k in range(self.counts[i]):
            if k:
                yield
            self.log.append((i, k))
        return param, state, None


@given(st.lists(st.integers(1, 4), max_size=8))
def test_the_update_pipeline_runs_each_units_phases_in_the_planned_order(counts):
    """DeviceUpdate runs phased updates in ``pipeline``'s order (the order it promises exchanges in): every phase
    once, each unit's in order, unit i's phase k in the turn of unit i + k (while there is one), the newest first."""
    from types import SimpleNamespace as NS

    from fshard.protocol._transform import DeviceUpdate, pipeline
    log = []
    units = [NS(name=str(i)) for i in range(len(counts))]
    rows = NS(rows=(torch.zeros(1),))
    step = NS(spec=NS(mesh=NS(shard_rank=0, shard_size=2), units=units, optimizer=_Phased(counts, log)), comm=None)
    state = NS(params={u.name: torch.zeros(1) for u in units}, opt_state={u.name: rows for u in units}, copies={},
               step=0)
    grads = NS(shards={u.name: torch.zeros(1) for u in units}, scale=1.0)
    params, opt_state, _, _ = DeviceUpdate()(step, state, grads, {u.name: [True] for u in units}, donate=True)
    order = pipeline(counts)
    assert log == order and set(params) == {u.name for u in units}
    assert sorted(order) == [(i, k) for i, c in enumerate(counts) for k in range(c)]
    at = {e: j for j, e in enumerate(order)}
    for i, c in enumerate(counts):
        for k in range(c):
            if k:
                assert at[(i, k - 1)] < at[(i, k)]
            if i + k < len(counts):  # in unit i + k's turn: after its first phase, before the next unit's
                assert at[(i + k, 0)] <= at[(i, k)] and (i + k + 1 == len(counts) or at[(i, k)] < at[(i + k + 1, 0)])


def _promised_run(fail):
    """muon+adamw, 3 steps of the default (checked) step: the checks made per step (each entry), and with ``fail``
    rank 1's third Newton-Schulz call of step 1 raising (rank 1 orthogonalises two matrices a step, so that is the
    step after, with some promised exchanges issued and some not): each rank's
    error, then that step retried with the same state and the run finished. Returns the checks, the errors, the
    final parameters and the losses. ``fail="issue"``: instead, rank 1's second exchange raises as it is issued
    (torch refusing the call), the exchange still promised."""
    import fshard.dist._collectives as c
    import fshard.optim._muon as m
    mesh = fs.Mesh.from_env()
    state = fs.init(_model("muon+adamw"), mesh, CASES["muon+adamw"][0]())
    checked, real_check, ns, calls = [], c.exchange, m._newton_schulz, [0]

    def check(comm, entry, failure=None):
        checked[-1].append(entry[0])
        return real_check(comm, entry, failure)

    def flaky(*args):
        calls[0] += 1
        if fail is True and mesh.rank == 1 and calls[0] == 3:
            raise ValueError("boom in Newton-Schulz")
        return ns(*args)

    real_all_to_all, issued, armed = c.dist.all_to_all_single, [0], [False]

    def refused(*args, **kwargs):  # (Comm.exchange's issue; the zeros of a failed rank go through _promises.py)
        if sys._getframe(1).f_code.co_name == "swap":  # (the blocking reduce's exchange at two ranks: not Muon's)
            return real_all_to_all(*args, **kwargs)
        issued[0] += 1
        if fail == "issue" and mesh.rank == 1 and armed[0] and issued[0] == 2:
            raise ValueError("boom issuing an exchange")
        return real_all_to_all(*args, **kwargs)
    c.exchange, m._newton_schulz, c.dist.all_to_all_single = check, flaky, refused
    errors, losses = [], []
    try:
        with fs.compose(awkward_loss) as step:
            batches = list(awkward_batches(2, 3, rank=mesh.rank, world_size=mesh.world_size))
            for i, batch in enumerate(batches):
                checked.append([])
                if i == 1:
                    calls[0], issued[0], armed[0] = 0, 0, True
                try:
                    state, metrics = step(state, batch)
                except fs.FshardError as e:
                    errors.append((type(e).__name__, str(e)))
                    state, metrics = step(state, batch)  # the same state: nothing was committed
                losses.append(metrics["loss"])
    finally:
        c.exchange, m._newton_schulz, c.dist.all_to_all_single = real_check, ns, real_all_to_all
    return checked, errors, {k: v.flatten().tolist() for k, v in fs.full_params(state).items()}, losses  # (lists:
    # tensors would travel back through shared memory that dies with the rank)


def test_muons_exchanges_are_checked_once_and_a_failure_between_them_reaches_every_rank():
    """The update's exchanges are checked across ranks in one check (``Collectives.promise``), not one each, so
    that no rank waits at each for the others. A rank that raises between them issues the rest with zeros: the
    other ranks finish their update, raise RankFailedError at the commit vote (none hangs), and the step retried
    with the same state ends as a run that never failed."""
    clean = run_ranks(_promised_run, 2, False)
    for checked, errors, _, _ in clean:
        assert errors == [] and len(checked) == 3
        for kinds in checked:
            assert kinds.count("promise") == 1 and "exchange" not in kinds, kinds
    for fail, boom in ((True, "boom in Newton-Schulz"), ("issue", "boom issuing an exchange")):
        for r, (checked, errors, params, losses) in enumerate(run_ranks(_promised_run, 2, fail)):
            assert len(errors) == 1, (fail, errors)
            kind, text = errors[0]
            if r == 1:
                assert kind == "StepError" and f"ValueError: {boom}" in text, text
                assert "The other ranks raise RankFailedError naming it" in text, text
            else:
                assert kind == "RankFailedError" and "rank 1 failed" in text and boom in text, text
            assert losses == clean[r][3] and params == clean[r][2], fail
