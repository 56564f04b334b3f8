"""fs.timeline: a step composed with timeline=True records its spans; fs.timeline draws every rank's as a PNG whose
lanes are the collectives the step traced (issue #18)."""
from __future__ import annotations

import os
import re
import struct
import sys

import pytest
import torch

import fshard as fs
from _dist import run_ranks

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KNOWN = {"compute", "gather", "reduce", "control", "update", "store", "wait"}


def _transforms(name):
    return {"blocking": (), "overlapped": (fs.gather_ahead(2), fs.bucket_reduce(0.002)),
            "offload": (fs.gather_ahead(1), fs.offload_state(fs.CPUStore(), chunk_mb=0.01, overlap_backward=True)),
            "accumulate": (fs.accumulate(2),)}[name]


def _steps(tmp: str, names, local: bool = False) -> dict:
    """Two steps of the tiny GPT per configuration, then fs.timeline on the last one's metrics."""
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    mesh = fs.Mesh.local() if local else fs.Mesh.from_env()
    out = {}
    for name in names:
        torch.manual_seed(0)
        cfg = GPTConfig.tiny(n_layers=3)
        state = fs.init(GPT(cfg), mesh, fs.adamw(lr=1e-3))
        with fs.compose(loss_fn, *_transforms(name), trace=True, timeline=True) as step:
            for b in synthetic_batches(cfg, 2, 2, rank=mesh.rank, world_size=mesh.world_size):
                state, m = step(state, [b, b] if name == "accumulate" else b)
        tl = fs.timeline(m, os.path.join(tmp, f"{name}.png"), mesh=mesh, title=name)
        out[name] = {"trace": m["trace/collectives"], "spans": m["trace/timeline"], "seconds": m["time/step"],
                     "timeline": tl, "units": [u.name for u in state.spec.units]}
    return out


def _reduce_calls(trace) -> list[str]:
    """The reductions of a trace, one per call: reduce_each notes one entry per rank section (``tag/r0`` ..
    ``tag/r{N-1}``) and is one span of the timeline, labelled ``tag``."""
    calls = []
    for kind, tag, *_ in trace:
        if kind == "reduce_scatter":
            calls.append(tag)
        elif kind == "reduce":
            base, r = re.fullmatch(r"(.*)/r(\d+)", tag).groups()
            if r == "0":
                calls.append(base)
    return calls


def _check_png(path: str, size: tuple) -> None:
    from matplotlib.image import imread
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    assert struct.unpack(">II", head[16:24]) == size
    assert imread(path).shape[:2] == (size[1], size[0])


def _check(res: dict, rank: int, world: int, path: str | None) -> None:
    tl, trace, seconds = res["timeline"], res["trace"], res["seconds"]
    lanes = tl.lanes(rank)
    assert set(lanes) <= KNOWN and {"compute", "gather", "update"} <= set(lanes)
    # the lanes are the collectives this rank traced, in order
    assert [label for label, *_ in lanes["gather"]] == [tag for kind, tag, *_ in trace if kind == "all_gather"]
    assert [label for label, *_ in lanes.get("reduce", ())] == _reduce_calls(trace)
    assert [label for label, *_ in lanes.get("control", ())] == [t for k, t, *_ in trace if k == "all_reduce"]
    assert tuple((r, *s) for r, *s in tl.spans if r == rank) == tuple((rank, *s) for s in res["spans"])
    for spans in lanes.values():  # every span lies within the step
        assert all(-1e-9 <= a <= b <= seconds + 1e-9 for _, a, b in spans)
    # a wait is compute's time on a collective, issuing it or blocked on it while it still ran: inside compute and
    # inside that collective's span
    for label, a, b in lanes.get("wait", ()):
        phase, tag = label.split(":", 1)
        assert any(t == tag and s <= a <= e for t, s, e in lanes[phase]), label
        assert any(s <= a and b <= e for _, s, e in lanes["compute"]), label
    assert 0.0 <= tl.overlap <= 1.0 and tl.step_seconds == max(tl.rank_seconds)
    if path is None:
        assert tl.path is None and tl.size is None
        return
    assert tl.path == path
    drawn = {lane for r in range(world) for lane in tl.lanes(r)} - {"wait"}
    assert tl.size == (1400, round((2.0 + 0.45 * world * len(drawn)) * 100))  # one lane per kind per rank
    _check_png(path, tl.size)


def test_one_rank_timeline_png_matches_the_traced_collectives(tmp_path):
    res = _steps(str(tmp_path), ["blocking", "overlapped", "offload", "accumulate"], local=True)
    for name, r in res.items():
        _check(r, 0, 1, str(tmp_path / f"{name}.png"))
        lanes = r["timeline"].lanes(0)  # one local rank: a gather is a copy when issued; nothing blocks later
        issued = {(f"{lane}:{t}", s) for lane in ("gather", "reduce") for t, s, _ in lanes.get(lane, ())}
        assert {(label, a) for label, a, _ in lanes["wait"]} == issued
    compute = [label for label, *_ in res["accumulate"]["timeline"].lanes(0)["compute"]]
    assert compute == ["forward", "backward", "forward", "backward"]  # per micro-batch
    # offload_state records its store I/O through StepView.record: every unit with moments is streamed
    lanes = res["offload"]["timeline"].lanes(0)
    streamed = {label.removeprefix("stream ") for label, *_ in lanes["store"] if label.startswith("stream ")}
    assert streamed == set(res["offload"]["units"]) and ("write-back" in [x for x, *_ in lanes["store"]])
    early = [label for label, *_ in lanes["update"] if label.endswith(" (early)")]
    assert set(early) <= {f"{u} (early)" for u in res["offload"]["units"]}


@pytest.mark.slow
def test_two_ranks_timeline_gathers_every_rank_and_rank_0_draws(tmp_path):
    names = ["blocking", "overlapped"]
    results = run_ranks(_steps, 2, str(tmp_path), names)
    for rank, res in enumerate(results):
        for name in names:
            _check(res[name], rank, 2, str(tmp_path / f"{name}.png") if rank == 0 else None)
            assert res[name]["timeline"].spans == results[0][name]["timeline"].spans  # the same on every rank
    # blocking collectives over gloo: compute blocks on (some of) them after issuing them
    blocking = results[0]["blocking"]["timeline"]
    lanes = [blocking.lanes(r) for r in range(2)]
    issued = [{s for lane in ("gather", "reduce") for _, s, _ in ls[lane]} for ls in lanes]
    assert any(a not in issued[r] for r, ls in enumerate(lanes) for _, a, _ in ls["wait"])
    assert blocking.overlap < 1.0


def test_off_by_default_and_clear_errors(tmp_path, monkeypatch):
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    cfg = GPTConfig.tiny()
    state = fs.init(GPT(cfg), fs.Mesh.local(), fs.adamw())
    _, m = fs.compose(loss_fn)(state, next(iter(synthetic_batches(cfg, 2, 1))))
    assert "trace/timeline" not in m
    with pytest.raises(fs.ArgumentError, match=r"no 'trace/timeline'.*timeline=True"):
        fs.timeline(m, tmp_path / "x.png")
    with pytest.raises(fs.ArgumentTypeError, match="metrics must be"):
        fs.timeline([1, 2])
    with pytest.raises(fs.ArgumentTypeError, match="mesh must be an fs.Mesh"):
        fs.timeline({"trace/timeline": ()}, mesh="rank0")
    for mod in [m for m in list(sys.modules) if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, mod, None)  # as if matplotlib were not installed
    spans = (("compute", "forward", 0.0, 0.5), ("gather", "u", 0.0, 0.2), ("wait", "gather:u", 0.1, 0.2))
    tl = fs.timeline({"trace/timeline": spans, "time/step": 0.5})  # no path: spans only, no matplotlib needed
    assert tl.overlap == pytest.approx(0.5) and tl.step_seconds == 0.5 and tl.path is None
    with pytest.raises(fs.ArgumentError, match=r"matplotlib.*pip install matplotlib==.*path=None"):
        fs.timeline({"trace/timeline": spans, "time/step": 0.5}, tmp_path / "y.png")
    assert not (tmp_path / "y.png").exists()
