"""Placement is a property of the state (issue #39): ``fs.init(offload=)`` and ``fs.load(offload=)`` take any
``fs.state.Placement`` (not only ``fs.offload_state``), a state says where it keeps its units
(``fs.state.placement_of``), misuse is an ``ArgumentTypeError`` naming the call and the fix, and the reader thread
of stored parameter shards belongs to offload_state's policy (ended by ``step.close()``)."""
from __future__ import annotations

import threading

import pytest
import torch

import fshard as fs
from fshard.state import Where, in_store, placement_of


class _Second:
    """A placement that is not fs.offload_state: the second unit with optimizer state goes to ``store``."""

    def __init__(self, store, chunk: int = 64, params: bool = True):
        self.store, self.chunk, self.params, self.asked = store, chunk, params, []

    def placement(self, units, rank):
        self.asked.append(tuple(u.name for u in units))
        return {units[1].name: Where(self.store, self.chunk, self.params)}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(40, 40) for _ in range(3)])


def _values(state) -> dict:
    """Every shard and optimizer row as bytes, read back from its store where it is held."""
    out = {}
    for n, p in state.params.items():
        out[n] = (p.load() if in_store(p) is not None else p).numpy().tobytes()
    for n, s in state.opt_state.items():
        out[n + "/rows"] = [(r.load() if in_store(r) is not None else r).numpy().tobytes() for r in s.rows]
        out[n + "/count"] = s.count.tolist()
    return out


def test_init_and_load_follow_any_placement_and_the_state_says_where_it_keeps_its_units(tmp_path):
    store = fs.CPUStore()
    place = _Second(store)
    plain = fs.init(_model(), fs.Mesh.local(), fs.adamw(lr=1e-2))
    placed = fs.init(_model(), fs.Mesh.local(), fs.adamw(lr=1e-2), offload=place)
    second = place.asked[0][1]
    assert place.asked == [tuple(u.name for u in placed.spec.units if u.trainable)]  # the units with state
    assert placement_of(placed) == {second: Where(store, 64, True)} and placement_of(plain) == {}
    assert in_store(placed.params[second]) is not None and all(in_store(r) is not None
                                                               for r in placed.opt_state[second].rows)
    assert all(in_store(p) is None for n, p in placed.params.items() if n != second)
    assert _values(placed) == _values(plain)  # the same values, only elsewhere
    assert "cpu" in repr(placed.params[second])

    fs.save(tmp_path / "ckpt", placed)
    again = fs.load(tmp_path / "ckpt", like=placed)  # without offload=: where like keeps them
    moved = fs.load(tmp_path / "ckpt", like=plain, offload=_Second(store, chunk=48))
    back = fs.load(tmp_path / "ckpt", like=placed, offload=_Second(store, params=False))
    assert placement_of(again) == {second: Where(store, 64, True)}
    assert placement_of(moved) == {second: Where(store, 48, True)}
    assert placement_of(back) == {second: Where(store, 64, False)}  # rows in the store, the shard in memory
    assert in_store(back.params[second]) is None
    assert _values(again) == _values(moved) == _values(back) == _values(placed)
    store.close()


def test_misused_placements_are_refused_naming_the_call_and_the_fix(tmp_path):
    state = fs.init(_model(), fs.Mesh.local(), fs.adamw())
    with pytest.raises(fs.ArgumentTypeError, match=r"fs\.init\(\.\.\., offload=\).*fs\.offload_state.*CPUStore"):
        fs.init(_model(), fs.Mesh.local(), fs.adamw(), offload=fs.CPUStore())
    fs.save(tmp_path / "ckpt", state)
    with pytest.raises(fs.ArgumentTypeError, match=r"fs\.load\(\.\.\., offload=\).*placement\(units, rank\)"):
        fs.load(tmp_path / "ckpt", like=state, offload="cpu")

    class _Bad:
        def placement(self, units, rank):
            return {units[0].name: "cpu"}

    with pytest.raises(fs.ArgumentTypeError, match=r"_Bad\.placement must map unit names to fshard\.state\.Where"):
        fs.init(_model(), fs.Mesh.local(), fs.adamw(), offload=_Bad())


def _readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fshard-read")]


def test_the_reader_of_stored_shards_is_offload_states_and_ends_with_the_step():
    """The step holds no reader of its own: offload_state's policy reads the stored shards ahead of their gathers
    and ``step.close()`` (its policy's close) ends the thread."""
    store = fs.CPUStore()
    off = fs.offload_state(store, params=True, chunk_mb=0.01)
    state = fs.init(_model(), fs.Mesh.local(), fs.adamw(lr=1e-2), offload=off)
    batch = (torch.randn(4, 40), torch.randn(4, 40))
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    assert _readers() == []
    step = fs.compose(loss_fn, off)
    assert not hasattr(step, "_reader")
    state, m = step(state, batch)
    assert m["io/param_read_bytes"] > 0 and _readers() != []  # read on the policy's reader thread
    step.close()
    assert _readers() == []
    store.close()
