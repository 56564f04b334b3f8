"""fs.gather_ahead: same results as blocking (bitwise), same collectives on every rank, bounded live memory, an
inspectable gather order, and a model whose unit order changes never hangs and never mixes units up."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from _dist import run_ranks

DEPTHS = (0, 1, 2, 4)
STEPS = 4


def _bytes(params):
    """Parameters as raw bytes: compared bitwise, and passed back from rank processes by value."""
    return {n: p.detach().cpu().numpy().tobytes() for n, p in params.items()}


def _setup(name):
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    from models import Awkward, awkward_batches, awkward_loss
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    if name == "gpt":  # 4 blocks, so that depth 4 reaches across the whole model
        cfg = GPTConfig.tiny(n_layers=4)
        return mesh, GPT(cfg), loss_fn, lambda: synthetic_batches(cfg, 2, STEPS, seed=5, rank=mesh.rank,
                                                                    world_size=mesh.world_size)
    return mesh, Awkward(), awkward_loss, lambda: awkward_batches(2, STEPS, mesh.rank, mesh.world_size)


def _train(name, transforms):
    """Train STEPS steps with each transform list; return per config: losses, final full params, traces and
    metrics."""
    import fshard as fs
    mesh, model, loss_fn, batches = _setup(name)
    out = {}
    for key, ts in transforms.items():
        state = fs.init(model, mesh, fs.adamw(lr=3e-3, weight_decay=0.1, impl="torch"))
        step = fs.compose(loss_fn, *ts, trace=True)
        losses, traces, metrics = [], [], []
        for b in batches():
            state, m = step(state, b)
            losses.append(m["loss"])
            traces.append(m.pop("trace/collectives"))
            metrics.append(m)
        units = {u.name: u.nbytes for u in state.spec.units}
        out[key] = (losses, _bytes(fs.full_params(state)), traces, metrics, units, step.gather_order)
    return out


def _configs():
    import fshard as fs
    cfg = {"blocking": ()}
    cfg.update({f"depth{d}": (fs.gather_ahead(d),) for d in DEPTHS})
    cfg["keep"] = (fs.gather_ahead(2, reshard_after_forward=False),)
    return cfg


def _bound(units, depth, extra):
    """root + the (depth + 1 + extra) largest other units."""
    from fshard.state._flat import ROOT
    others = sorted((b for n, b in units.items() if n != ROOT), reverse=True)
    return units.get(ROOT, 0) + sum(others[:depth + 1 + extra])


@pytest.mark.parametrize("world_size", [2, 3])
def test_bitwise_identical_to_blocking_at_every_depth(world_size):
    import fshard.testing as ft
    for name in ("gpt", "awkward"):
        ranks = run_ranks(_train, world_size, name, _configs())
        for r, res in enumerate(ranks):
            ref_losses, ref_params = res["blocking"][:2]
            for key, (losses, params, traces, metrics, units, order) in res.items():
                assert losses == ref_losses, f"{name} {key} rank {r}: losses differ from blocking"
                assert params == ref_params, f"{name} {key} rank {r}: parameters differ from blocking"
                if key.startswith("depth"):
                    d = int(key[5:])
                    assert order is not None and order.forward[0] == "<root>"
                    if d > 0:
                        assert sum(m["gather/prefetched"] for m in metrics[1:]) > 0  # it really prefetched
                    if d > 0 and name == "gpt":  # (each unit used once: forward gathers each unit once)
                        # a unit's gather is issued before those of the units ahead of it (issued after them, the
                        # step's first unit, the root, waited behind them): forward's gathers in the gather order
                        gathers = [tag for kind, tag, *_ in traces[-1] if kind == "all_gather"]
                        assert gathers[:len(order.forward)] == list(order.forward), (key, gathers, order)
                    if name == "gpt":
                        # nothing is freed to be gathered again by the next event: the root is gathered once a
                        # step, and block i of n stays gathered from forward to backward when its backward use is
                        # within depth + 1 non-root positions of its forward use (2 (n - i) - 1 of them), i.e. the
                        # last depth // 2 + 1 blocks
                        blocks = len(order.forward) - 1
                        kept = min(blocks, d // 2 + 1)
                        for tr in traces[1:]:  # (the first step records the order, without prefetch)
                            gathers = [tag for kind, tag, *_ in tr if kind == "all_gather"]
                            assert gathers.count("<root>") == 1, (key, gathers)
                            assert len(gathers) == 1 + blocks + blocks - kept, (key, gathers)
                    if name == "gpt":  # no frozen units (a frozen unit stays gathered in backward)
                        for m in metrics:
                            assert m["mem/peak_gathered_bytes_forward"] <= _bound(units, d, 0), (key, m)
                            assert m["mem/peak_gathered_bytes_backward"] <= _bound(units, d, 1), (key, m)
            # reshard_after_forward=False gathers each unit once per step instead of twice
            keep, blocking = res["keep"][3][-1], res["blocking"][3][-1]
            assert keep["comm/gather_bytes"] < 0.6 * blocking["comm/gather_bytes"]
        for key in ranks[0]:  # every rank issues the same collectives in the same order, step by step
            for s in range(STEPS):
                ft.check_same_collectives([res[key][2][s] for res in ranks])


def test_deeper_prefetch_holds_more_and_depth_zero_holds_what_blocking_holds():
    import fshard as fs
    res = _train("gpt", {"blocking": (), **{f"depth{d}": (fs.gather_ahead(d),) for d in (0, 1, 2)}})
    peak = {k: v[3][-1]["mem/peak_gathered_bytes_forward"] for k, v in res.items()}
    assert peak["depth0"] == peak["blocking"] < peak["depth1"] < peak["depth2"]


def test_the_gather_order_is_an_inspectable_value():
    import fshard as fs
    mesh, model, loss_fn, batches = _setup("awkward")
    state = fs.init(model, mesh, fs.adamw())
    step = fs.compose(loss_fn, fs.gather_ahead(2))
    assert step.gather_order is None  # nothing recorded yet
    b = next(iter(batches()))
    state, m = step(state, b)
    s = step.gather_order
    assert isinstance(s, fs.GatherOrder)
    # blocks.0 is applied twice; blocks.2 is never called
    assert s.forward == ("<root>", "blocks.0", "blocks.1", "blocks.0")
    assert s.backward == ("<root>", "blocks.0", "blocks.1", "blocks.0")
    assert "blocks.1" in repr(s) and s.events == s.forward + s.backward
    with pytest.raises(Exception):
        s.forward = ()  # frozen
    # an explicit gather order is used from the first step on, and an equal one is kept as it is
    step2 = fs.compose(loss_fn, fs.gather_ahead(1, order=s))
    assert step2.gather_order is s
    _, m2 = step2(state, b)
    assert m2["gather/prefetched"] > 0 and m2["gather/replanned"] == 0 and step2.gather_order is s
    with pytest.raises(ValueError, match="unknown unit names"):
        fs.compose(loss_fn, fs.gather_ahead(order=fs.GatherOrder(["<root>", "nope"], [])))(state, b)
    with pytest.raises(ValueError, match="depth"):
        fs.gather_ahead(-1)
    with pytest.raises(TypeError, match="GatherOrder"):
        fs.gather_ahead(order=["blocks.0"])


class Switch(nn.Module):
    """Three blocks applied in the order the batch names (the same on every rank, different between steps)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        from models import Block
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.head = nn.Linear(8, 11)

    def forward(self, x, order):
        h = self.emb(x)
        for i in order:
            h = self.blocks[i](h) + h
        return self.head(h)


def _switch_loss(module, batch):
    x, y, order = batch
    return nn.functional.cross_entropy(module(x, order).flatten(0, 1), y.flatten())


ORDERS = [(0, 1, 2), (0, 1, 2), (2, 1, 0), (2, 1, 0), (0, 2), (0, 1, 2)]


def _switch_batches(rank, n):
    g = torch.Generator().manual_seed(7)
    for order in ORDERS:
        x = torch.randint(0, 11, (2 * n, 5), generator=g)
        y = torch.randint(0, 11, (2 * n, 5), generator=g)
        yield x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2], order


def _order_change(on_change):
    import fshard as fs
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = Switch()
    out = {}
    for key in ("blocking", "ahead"):
        state = fs.init(model, mesh, fs.adamw(lr=1e-2, impl="torch"))
        step = fs.compose(_switch_loss, *(() if key == "blocking" else (fs.gather_ahead(2, on_change=on_change),)))
        losses, replans, errors = [], [], []
        for b in _switch_batches(mesh.rank, mesh.world_size):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    state, m = step(state, b)
                except fs.errors.GatherOrderError as e:
                    errors.append(str(e))
                    # the state is intact: continue this batch with a step that adopts the new order
                    state, m = fs.compose(_switch_loss, fs.gather_ahead(2))(state, b)
            losses.append(m["loss"])
            replans.append((m.get("gather/replanned", 0), len([w for w in caught if "order changed" in str(w.message)])))
        out[key] = (losses, _bytes(fs.full_params(state)), replans, errors, step.gather_order)
    return out


@pytest.mark.parametrize("on_change", ["replan", "error"])
def test_a_changing_unit_order_replans_or_raises_and_never_hangs(on_change):
    # collective_timeout_s bounds any hang inside a collective; run_ranks fails on a hung rank after timeout_s
    ranks = run_ranks(_order_change, 2, on_change, timeout_s=120, collective_timeout_s=30)
    for res in ranks:
        ref_losses, ref_params = res["blocking"][:2]
        losses, params, replans, errors, order = res["ahead"]
        assert losses == ref_losses
        assert params == ref_params
        if on_change == "replan":
            # steps 2 (new order), 4 (a shorter order) and 5 (back to the first) change the order; warned once
            assert [r for r, _ in replans] == [0, 0, 1, 0, 1, 1]
            assert sum(w for _, w in replans) == 1
            assert order.forward == ("<root>", "blocks.0", "blocks.1", "blocks.2")
            assert not errors
        else:
            assert len(errors) == 3 and "differs from gather_ahead's gather order" in errors[0]
            assert "blocks.2" in errors[0] and "on_change='replan'" in errors[0]
