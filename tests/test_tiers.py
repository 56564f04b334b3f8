"""fs.offload_state with tiers: a fraction of the units on the device, one in CPU memory (CPUStore), one on NVMe
(NVMeStore), as ColossalAI's Gemini places chunks. The placement rule (``choose_tiers``) as a property; training
bitwise the same as without offload at world sizes 1 and 2, placed at init or moved on the first step, with
parameters in the stores too; a checkpoint of a tiered state resumes bitwise; misuse is refused with the fix."""
from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _dist import run_ranks
from test_offload_params import _bytes as _snapshot  # full parameters and every moment, as bytes

STEPS = 3


class _Layout:
    def __init__(self, name, n):
        self.name, self._n = name, n

    def opt_numel(self, rank):
        return self._n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12),
       st.lists(st.floats(0, 1), min_size=1, max_size=3).filter(lambda f: sum(f) <= 1))
def test_tiers_take_whole_units_in_model_order_until_each_share_is_reached(sizes, fractions):
    """Units in model order fill tier 0, then tier 1, ...: a tier's units are consecutive, tiers come in order,
    the units left stay on the device; a tier stops taking units once the tiers so far hold their cumulative share
    of the bytes (and takes them until then); with one tier, offload_state(store, fraction=...)'s rule."""
    from fshard.offload._tiers import choose_tiers
    layouts = [_Layout(f"u{i}", n) for i, n in enumerate(sizes)]
    tiers = choose_tiers(layouts, 0, tuple(fractions))
    order = [tiers.get(u.name) for u in layouts]
    placed = [t for t in order if t is not None]
    assert placed == sorted(placed) and order[:len(placed)] == placed  # consecutive, in order, device last
    total, acc = 2 * sum(sizes), 0
    for i, u in enumerate(layouts):
        t = order[i]
        share = sum(fractions[:t + 1]) * total if t is not None else None
        if t is not None:
            assert acc < share - 1e-9 * total, (i, t)  # it was taken while its tier still had room
        else:  # left on the device: every tier was full
            assert acc >= (sum(fractions) - 1e-9) * total
        acc += 2 * u._n


def _gpt():
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(n_layers=4)
    return GPT(cfg), loss_fn, lambda r, n: synthetic_batches(cfg, 2, STEPS, seed=5, rank=r, world_size=n)


def _where(state) -> dict:
    """Unit name -> "device", "cpu" or "nvme", from the state's leaves (moments and parameters agree)."""
    import fshard as fs
    out = {}
    for name, s in state.opt_state.items():
        m, p = s.exp_avg, state.params[name]
        kind = "device" if isinstance(m, torch.Tensor) else "nvme" if m.location.startswith("nvme") else "cpu"
        if isinstance(p, fs.state.StoredParam):
            assert p.location == m.location, name
        out[name] = kind
    return out


def _train(directory, params: bool, at_init: bool, donate: bool):
    import fshard as fs
    mesh = fs.Mesh.from_env()
    model, loss_fn, batches = _gpt()
    out = {}
    for kind in ("none", "tiers"):
        stores = (fs.CPUStore(), fs.NVMeStore(f"{directory}/{kind}{mesh.rank}")) if kind == "tiers" else ()
        off = fs.offload_state(stores, fraction=(0.3, 0.4), chunk_mb=0.002, params=params) if stores else None
        state = fs.init(model, mesh, fs.adamw(lr=3e-3, weight_decay=0.1), offload=off if at_init else None)
        placed = _where(state)
        with fs.compose(loss_fn, fs.gather_ahead(2), fs.mixed_precision(torch.bfloat16),
                        *(() if off is None else (off,)), donate=donate) as step:
            losses = []
            for b in batches(mesh.rank, mesh.world_size):
                state, m = step(state, b)
                losses.append(m["loss"])
            plan = step.plan(state, b)
        out[kind] = (losses, _snapshot(state), placed, _where(state), str(state),
                     {k: plan.bounds.get(k, 0) for k in ("store/peak_bytes", "store/memory_peak_bytes")})
        del state
        gc.collect()
        for s in stores:
            s.close()
    return out


@pytest.mark.parametrize("world_size,params,at_init,donate", [
    (1, True, True, False), (2, True, False, True), (2, False, True, False)])
def test_three_tiers_train_bitwise_the_same_as_no_offload(tmp_path, world_size, params, at_init, donate):
    args = (str(tmp_path), params, at_init, donate)
    for r, res in enumerate(run_ranks(_train, world_size, *args) if world_size > 1 else [_train(*args)]):
        ref, got = res["none"], res["tiers"]
        assert got[0] == ref[0], f"rank {r}: losses differ"
        bad = [k for k in ref[1] if got[1][k] != ref[1][k]]
        assert not bad, f"rank {r}: {bad[:4]} differ"
        where = got[3]
        assert set(where.values()) == {"device", "cpu", "nvme"}, where  # every tier holds some units
        kinds = list(where.values())  # in model order: the CPU tier first, then NVMe, the rest on the device
        assert kinds == sorted(kinds, key=["cpu", "nvme", "device"].index), kinds
        assert got[2] == (where if at_init else {n: "device" for n in where})  # placed at init, or by step 1
        assert "cpu" in got[4] and "nvme:" in got[4]  # print(state) shows each leaf's store
        bounds = got[5]
        assert 0 < bounds["store/memory_peak_bytes"] < bounds["store/peak_bytes"]  # the CPU tier is in RSS


def _resume(directory):
    import fshard as fs
    model, loss_fn, batches = _gpt()
    bs = list(batches(0, 1))
    stores = (fs.CPUStore(), fs.NVMeStore(f"{directory}/store"))
    off = fs.offload_state(stores, fraction=(0.25, 0.5), chunk_mb=0.002, params=True)
    with fs.compose(loss_fn, off) as step:
        s, _ = step(fs.init(model, fs.Mesh.local(), fs.adamw(lr=1e-2), offload=off), bs[0])
        fs.save(f"{directory}/ckpt", s)
        ref, _ = step(s, bs[1])
        loaded = fs.load(f"{directory}/ckpt", like=s, offload=off)
        assert _where(loaded) == _where(s)  # fs.load(offload=) puts each unit's moments back in its tier
        got, _ = step(loaded, bs[1])
        same = _snapshot(got) == _snapshot(ref)
    for x in stores:
        x.close()
    return same


def test_a_checkpoint_of_a_tiered_state_resumes_bitwise(tmp_path):
    assert _resume(str(tmp_path))


def test_tiers_refuse_misuse_and_say_how():
    import fshard as fs
    a, b = fs.CPUStore(), fs.CPUStore()
    with pytest.raises(fs.ArgumentTypeError, match=r"fraction=\(0.3, 0.5\)"):
        fs.offload_state((a, b), fraction=0.5)  # one fraction for two stores
    with pytest.raises(fs.ArgumentError, match="summing to at most 1"):
        fs.offload_state((a, b), fraction=(0.7, 0.5))
    with pytest.raises(fs.ArgumentError, match="one per store"):
        fs.offload_state((a, b), fraction=(0.5,))
    with pytest.raises(fs.ArgumentError, match="appears twice"):
        fs.offload_state((a, a), fraction=(0.2, 0.2))
    with pytest.raises(fs.ArgumentTypeError, match="sequence of them"):
        fs.offload_state((a, "nvme"), fraction=(0.2, 0.2))
    off = fs.offload_state((a, b), fraction=(0.25, 0.5), params=True)
    assert off.fraction == 0.75 and off.store is b and "fraction=(0.25, 0.5)" in repr(off)


def _fit(directory):
    """Plan.fractions: from a plan with everything on the device, the fractions that fit a budget; a step composed
    with them, its state placed at init, is planned under the budget."""
    import fshard as fs
    with torch.device("meta"):  # 24 units of 4 MiB: 300 MiB of state to place, against RSS noise of a few MiB
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    b = (torch.randn(4, 1024), torch.randn(4, 1024))
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    cpu, nvme = fs.CPUStore(), fs.NVMeStore(f"{directory}/store")
    off = fs.offload_state((cpu, nvme), fraction=(0.0, 0.0), chunk_mb=1, params=True)
    state = fs.init(model, fs.Mesh.local(), fs.adamw(), offload=off, seed=0)
    with fs.compose(loss_fn, off, donate=True) as step:
        p0 = step.plan(state, b)
    movable = p0.bounds["offload/movable_bytes"]
    assert p0.tiers[0][1] and not p0.tiers[1][1] and movable == p0.bounds["offload/device_bytes"] > 0
    budget = p0.predicted_rss - movable // 2
    fr = p0.fractions(budget)
    with pytest.raises(fs.errors.MemoryBudgetError) as e:
        p0.check(budget)
    assert f"fraction={fr}" in str(e.value)
    assert p0.fractions(p0.predicted_rss) == (0.0, 0.0)  # fits already, everything on the device: as it is
    assert p0.fractions(p0.baseline_rss // 2) is None  # nothing the state could move fits that
    off2 = fs.offload_state((cpu, nvme), fraction=fr, chunk_mb=1, params=True)
    del state
    gc.collect()
    state = fs.init(model, fs.Mesh.local(), fs.adamw(), offload=off2, seed=0)
    with fs.compose(loss_fn, off2, donate=True) as step:
        p1 = step.plan(state, b)
    where = _where(state)
    back = p1.fractions(p1.predicted_rss + movable // 4)  # room for a quarter of the state: some of it comes back
    cpu.close()
    nvme.close()
    return fr, p1.predicted_rss, budget, where, back


def test_the_plan_chooses_fractions_that_fit_a_budget(tmp_path):
    """On a CPU mesh the CPU tier is the same RAM as the device: the plan moves the excess to the disk tier; with
    room left it brings units back to the device."""
    (fr, predicted, budget, where, back), = run_ranks(_fit, 1, str(tmp_path))
    assert fr[0] == 0.0 and 0.5 <= fr[1] <= 1.0, fr
    assert predicted <= budget, (predicted, budget)
    assert "nvme" in where.values() and "cpu" not in where.values()
    assert back[0] == 0.0 and fr[1] - 0.3 < back[1] < fr[1], (fr, back)

