"""benchmarks/optim.py runs (issue #40), so that it cannot rot: its --quick updates of every optimizer on the tiny GPT
(each row present, both sides timed, fshard's parameters equal to torch's after the same updates), its --overhead
--quick (both sides and the kernel alone timed), and its --muon --quick step at world size 2 (both configs timed, the
same losses). benchmarks/paired.py (issue #42): its statistics (the sign test, the bootstrap interval: properties),
and a tiny run at one rank (every pair timed, the same losses). Timings here mean nothing (a loaded machine)."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _proc import run_logged

_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "optim.py")
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_optim_benchmark_quick_times_every_optimizer_against_its_peer(tmp_path):
    out = tmp_path / "optim.json"
    log = run_logged([sys.executable, _SCRIPT, "--quick", "--json", str(out)], env=_ENV, timeout=120)
    res = json.loads(out.read_text())
    assert list(res) == ["adamw", "adam", "adam(impl=native)", "sgd(momentum)", "sgd(nesterov)",
                         "sgd(momentum, impl=native)", "adagrad", "adagrad(impl=native)", "adam(impl=torch)", "rmsprop",
                         "lion", "adafactor", "from_torch(NAdam)", "from_torch(NAdam)[foreach=True]"]
    for name, r in res.items():
        assert r["fshard_ms"] > 0 and r["torch_ms"] > 0 and r["elements"] == 32_192, (name, r)
        assert r["speed_ratio"] == pytest.approx(r["torch_ms"] / r["fshard_ms"]) and len(r["per_repeat"]) == 2
        assert r["fshard_faster"] == sum(x > 1 for x in r["per_repeat"]) and 0 < r["sign_test_p"] <= 1
        # the same optimizer on the same tensors: equal up to rounding (Lion's peer: a sign flip moves 2 lr = 2e-4)
        assert r["max_abs_diff"] <= (2e-4 * 3 if name == "lion" else 1e-6), (name, r["max_abs_diff"])
        assert f"| {name} | {r['fshard_impl']} | " in log
    assert res["adamw"]["peer"] == "AdamW (fused)" and res["rmsprop"]["peer"] == "RMSprop (foreach)"
    # the defaults (issue #40): adam, sgd and adagrad run torch's fused kernel
    assert [res[k]["fshard_impl"] for k in ("adam", "sgd(momentum)", "adagrad", "adam(impl=native)")] == [
        "fused", "fused", "fused", "native"]
    assert "ForeachLion (foreach, the paper's formula" in res["lion"]["peer"]
    assert log.count("load average") == 2  # uptime before and after


def test_optim_benchmark_overhead_times_the_kernel_alone_beside_both_sides(tmp_path):
    sys.path.insert(0, os.path.dirname(_SCRIPT))
    import optim
    out = tmp_path / "overhead.json"
    optim.main(["--overhead", "--quick", "--json", str(out)])
    res = json.loads(out.read_text())
    assert set(res["median_ms"]) == {"fshard", "direct", "torch"} and all(v > 0 for v in res["median_ms"].values())
    assert set(res["beyond_kernel_ms"]) == {"fshard", "torch"} and res["units"] >= 3


def test_optim_benchmark_muon_quick_runs_both_steps_at_two_ranks(tmp_path):
    out = tmp_path / "muon.json"
    log = run_logged([sys.executable, _SCRIPT, "--muon", "--quick", "--json", str(out)], env=_ENV, timeout=120)
    res = json.loads(out.read_text())
    ddp, ours = res["configs"]["ddp+muon"], res["configs"]["fshard+ahead+buckets+muon+donate"]
    assert res["world_size"] == 2 and ddp["median_s"] > 0 and ours["median_s"] > 0
    assert len(ours["loss_curve"]) == 3  # 1 warm-up + 2 timed steps
    assert max(abs(a - b) for a, b in zip(ours["loss_curve"], ddp["loss_curve"])) <= 1e-5
    assert "[optim.py] Muon step, world size 2: fshard+ahead+buckets+muon+donate" in log and "(issue #40's bar" in log


_PAIRED = os.path.join(os.path.dirname(_SCRIPT), "paired.py")


def _paired():
    if os.path.dirname(_SCRIPT) not in sys.path:
        sys.path.insert(0, os.path.dirname(_SCRIPT))
    import paired
    return paired


@given(st.integers(1, 60), st.data())
def test_paired_sign_test_is_a_binomial_tail(n, data):
    sign_test = _paired().sign_test
    k = data.draw(st.integers(0, n))
    assert sign_test(0, n) == 1 and sign_test(n, n) == 0.5**n
    assert sign_test(k, n) >= sign_test(min(k + 1, n), n)  # fewer wins are likelier
    assert sign_test(k, n) == pytest.approx(sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n)


@given(st.lists(st.floats(0.5, 2.0), min_size=1, max_size=40))
def test_paired_bootstrap_interval_holds_medians_of_the_sample(xs):
    bootstrap_median = _paired().bootstrap_median
    lo, hi = bootstrap_median(xs, draws=200)
    assert min(xs) <= lo <= hi <= max(xs)
    assert bootstrap_median(xs, draws=200) == (lo, hi)  # seeded


def test_paired_benchmark_times_each_pair_and_both_see_the_same_batches(tmp_path):
    out = tmp_path / "paired.json"
    log = run_logged([sys.executable, _PAIRED, "--tiny", "--world-size", "1", "--configs", "torch,fshard+donate",
                      "--pairs", "3", "--warmup", "1", "--json", str(out)], env=_ENV, timeout=180)
    res = json.loads(out.read_text())
    assert res["reference"] == "torch" and res["pairs"] == 3 and list(res["configs"]) == ["torch", "fshard+donate"]
    ref, got = res["configs"]["torch"], res["configs"]["fshard+donate"]
    assert len(got["times"]) == len(got["ratios"]) == len(got["faults"]) == len(got["cpu_s"]) == 3
    assert all(0 <= s <= c for c, s in zip(got["cpu_s"], got["system_s"])) and sum(got["cpu_s"]) > 0
    assert got["ratios"] == pytest.approx([a / b for a, b in zip(got["times"], ref["times"])])
    assert got["slower"] == sum(r > 1 for r in got["ratios"]) and ref["median_ratio"] == 1
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)  # the same model, batches and AdamW
    assert "| fshard+donate |" in log and "pairs after 1 warm-up" in log
