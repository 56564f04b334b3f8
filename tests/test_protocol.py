"""The seams between stages: declared protocols, conflicts as errors, state that is data, stores and steps that own
their lifetimes, one public surface and one error family."""
from __future__ import annotations

import ast
import dataclasses
import gc
import pathlib
import subprocess
import sys
import threading
import warnings

import optree
import pytest
import torch

import fshard as fs
from models import Awkward, awkward_batches, awkward_loss

FSHARD = pathlib.Path(fs.__file__).parent


def _state():
    torch.manual_seed(0)
    return fs.init(Awkward(), fs.Mesh.local(), fs.adamw(lr=1e-2, impl="torch"))


# --- conflicts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a, b, stage", [
    (fs.accumulate(2), fs.accumulate(3), "batches"),
    (fs.gather_ahead(1), fs.gather_ahead(4), "gather"),
    (fs.bucket_reduce(1), fs.bucket_reduce(25), "reduce"),
    (fs.offload_state(fs.CPUStore()), fs.offload_state(fs.CPUStore()), "update"),
])
def test_two_transforms_that_set_one_stage_are_an_error_naming_both(a, b, stage):
    with pytest.raises(fs.TransformConflictError) as e:
        fs.compose(awkward_loss, fs.clip_by_global_norm(1.0), a, fs.skip_nonfinite(), b)
    msg = str(e.value)
    assert repr(a) in msg and repr(b) in msg and f"both set the {stage} stage" in msg
    assert "Pass only one of them" in msg
    assert isinstance(e.value, fs.FshardError) and isinstance(e.value, ValueError)


class _Mine(fs.GradsPolicy, fs.ReducePolicy):
    """A policy that changes nothing (the protocols' defaults), to set a stage with."""


class _SetGrads(fs.Transform):
    name = "set_grads"
    stages = {"grads": "set"}

    def wrap_grads(self, grads):
        return _Mine()


def test_wrappers_compose_and_a_setter_after_a_wrapper_is_an_error():
    step = fs.compose(awkward_loss, fs.clip_by_global_norm(1.0), fs.skip_nonfinite(), fs.clip_by_global_norm(2.0))
    assert not step.policy.grads_unchanged and step.policy.grads.inner.inner.inner.changes_grads is False
    fs.compose(awkward_loss, _SetGrads(), fs.clip_by_global_norm(1.0))  # set first, then wrap: fine
    with pytest.raises(fs.TransformConflictError, match=r"sets the grads stage, which fs.clip_by_global_norm\(1.0\) "
                                                        r"\(passed before it\) wraps.*Pass fs.set_grads\(\) before"):
        fs.compose(awkward_loss, fs.clip_by_global_norm(1.0), _SetGrads())


def test_a_transform_must_declare_the_stages_it_changes():
    class Undeclared(fs.Transform):
        name = "undeclared"

        def wrap_reduce(self, reduce):
            return _Mine()

    with pytest.raises(fs.ArgumentTypeError, match=r"changes the reduce stage but does not declare how"):
        fs.compose(awkward_loss, Undeclared())


def test_a_policy_must_follow_its_stage_protocol():
    class OldStyle(fs.Transform):  # a plain function as a grads policy: it lacks the declared hooks
        name = "old_style"
        stages = {"grads": "wrap"}

        def wrap_grads(self, grads):
            return lambda comm, g: grads(comm, g)

    with pytest.raises(fs.ArgumentTypeError, match=r"which is not a GradsPolicy: subclass fs.GradsPolicy"):
        fs.compose(awkward_loss, OldStyle())


# --- every shipped reduce policy hands every unit over ----------------------------------------------------------


class _Record(fs.Transform):
    """Sets the update stage to the default update plus a record of ``overlap`` calls."""

    name = "record"
    stages = {"update": "set"}

    def __init__(self):
        self.overlapped, self.updated = [], []

    def wrap_update(self, inner):
        rec = self

        class Recording(fs.UpdatePolicy):
            def overlap(self, step, unit):
                rec.overlapped.append((unit.name, step.last, unit.grad is not None))

            def __call__(self, step, state, grads, active, donate):
                rec.updated.append(sorted(grads.shards))
                return inner(step, state, grads, active, donate)
        return Recording()


@pytest.mark.parametrize("reduce", [None, 1e-6, 1e-4, 25])
@pytest.mark.parametrize("k", [1, 3])
def test_every_shipped_reduce_policy_hands_each_unit_over_once_in_the_last_micro_batch(reduce, k):
    state, rec = _state(), _Record()
    ts = (() if reduce is None else (fs.bucket_reduce(reduce),)) + ((fs.accumulate(k),) if k > 1 else ())
    step = fs.compose(awkward_loss, *ts, rec)
    bs = list(awkward_batches(2, 2 * k))
    for i in range(2):
        batch = bs[i * k:(i + 1) * k] if k > 1 else bs[i]
        state, _ = step(state, batch)
        names = rec.updated[-1]
        got = rec.overlapped[-len(names):]
        assert sorted(n for n, _, _ in got) == names  # each unit with a gradient once, none twice
        assert all(last and has for _, last, has in got)  # in the last micro-batch, with its shard
    assert len(rec.overlapped) == sum(len(u) for u in rec.updated)
    # the never-called unit: no gradient to reduce (blocking), or its zeros with its bucket's (bucket_reduce)
    assert ("blocks.2" in rec.updated[-1]) == (reduce is not None) and "<root>" in rec.updated[-1]


class _Lazy(fs.Transform):
    """A reduce policy that forgets to hand a unit over, or hands it over twice."""

    name = "lazy"
    stages = {"reduce": "set"}

    def __init__(self, times):
        self.times = times

    def wrap_reduce(self, reduce):
        times = self.times

        class Lazy(fs.ReducePolicy):
            def reduce(self, step, unit, grad):
                for _ in range(times if unit.name == "blocks.1" else 1):
                    step.grad_ready(unit, grad[:unit.layout.shard_numel].clone())
        return Lazy()


def test_a_reduce_policy_that_breaks_the_hand_over_is_named():
    b = next(iter(awkward_batches(2, 1)))
    with pytest.raises(fs.PolicyError, match=r"reduce policy Lazy did not hand over.*\['blocks.1'\].*grad_ready"):
        fs.compose(awkward_loss, _Lazy(0))(_state(), b)
    with pytest.raises(fs.PolicyError, match=r"handed over unit 'blocks.1'.*twice"):
        fs.compose(awkward_loss, _Lazy(2))(_state(), b)


def test_policies_see_only_the_documented_views():
    seen = {}

    class Peek(fs.Transform):
        name = "peek"
        stages = {"gather": "set"}

        def wrap_gather(self, gather):
            class Peeking(fs.GatherPolicy):
                def before_forward(self, step, unit):
                    seen.setdefault("step", {a for a in dir(step) if not a.startswith("_")})
                    seen.setdefault("unit", {a for a in dir(unit) if not a.startswith("_")})
                    unit.acquire()
            return Peeking()

    fs.compose(awkward_loss, Peek())(_state(), next(iter(awkward_batches(2, 1))))
    for name, proto in (("step", fs.StepView), ("unit", fs.UnitView)):
        declared = set(proto.__annotations__) | {a for a in vars(proto) if not a.startswith("_")}
        assert seen[name] <= declared, f"{name} exposes undocumented {sorted(seen[name] - declared)}"


# --- state is data ----------------------------------------------------------------------------------------------


def test_state_mappings_are_read_only_and_name_the_fix():
    state = _state()
    for field in ("params", "opt_state", "buffers"):
        m = getattr(state, field)
        key = next(iter(m))
        with pytest.raises(fs.FrozenStateError, match=rf"state\.replace\({field}=\{{\*\*state\.{field}, "):
            m[key] = None
        with pytest.raises(fs.FrozenStateError):
            del m[key]
    new = state.replace(params={**state.params, "<root>": state.params["<root>"] + 1})
    assert isinstance(new.params, fs.FrozenMap) and list(new.params) == list(state.params)
    leaves, spec = optree.tree_flatten(new, namespace="fshard")
    back = optree.tree_unflatten(spec, leaves)
    assert isinstance(back.params, fs.FrozenMap) and back.params["<root>"] is new.params["<root>"]
    paths = [".".join(map(str, p)) for p in optree.tree_paths(state, namespace="fshard")]
    assert "params.<root>" in paths and "skipped" in paths


def test_grads_are_frozen():
    g = fs.Grads({"a": torch.ones(3)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.scale = 2.0
    with pytest.raises(TypeError):
        g.shards["b"] = torch.ones(1)
    h = g.replace(scale=0.5).with_metrics(x=1)
    assert (g.scale, dict(g.metrics), h.scale, dict(h.metrics)) == (1.0, {}, 0.5, {"x": 1})


def test_donation_is_a_field_shared_by_states_that_share_tensors():
    state = _state()
    alias = state.replace(step=state.step)  # shares every tensor
    assert not state.donation.done and alias.donation is state.donation
    b = next(iter(awkward_batches(2, 1)))
    new, _ = fs.compose(awkward_loss, donate=True)(state, b)
    assert state.donation.done and "donated at step 0" in repr(state) and not new.donation.done
    for s in (state, alias):
        with pytest.raises(fs.DonatedStateError, match="at step 0"):
            fs.compose(awkward_loss)(s, b)
    leaves, spec = optree.tree_flatten(new, namespace="fshard")
    assert not optree.tree_unflatten(spec, leaves).donation.done  # rebuilt from leaves: a fresh token


def test_skipped_steps_are_counted_in_the_state():
    def loss(m, batch):
        x, y, poison = batch
        return awkward_loss(m, (x, y)) * (float("inf") if poison else 1.0)

    state = _state()
    step = fs.compose(loss, fs.skip_nonfinite())
    for i, (x, y) in enumerate(awkward_batches(2, 3)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new, m = step(state, (x, y, i == 1))
        assert [str(w.message) for w in caught if "skipped" in str(w.message)] == (
            ["fshard: non-finite gradients (inf or NaN); the step was skipped and the state is unchanged but for "
             "state.skipped (metrics['skipped_total'])."] if i == 1 else [])
        if i == 1:
            assert new.params is state.params and new.step is state.step and int(new.skipped) == 1
        state = new
    assert (int(state.step), int(state.skipped), m["skipped_total"], m["skipped"]) == (2, 1, 1, 0)


# --- lifetimes: store versions and threads --------------------------------------------------------------------


def _live_keys(state) -> set:
    return {k for s in state.opt_state.values() if isinstance(s.exp_avg, fs.Stored)
            for k in s.exp_avg.items.item_keys()}


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_no_stored_version_outlives_the_states_after_recomposing_the_step(kind, tmp_path):
    store = fs.CPUStore() if kind == "cpu" else fs.NVMeStore(str(tmp_path))
    state, bs = _state(), list(awkward_batches(2, 6))
    for i in range(3):  # three step functions in turn over one store, as a restarted loop would make them
        with fs.compose(awkward_loss, fs.offload_state(store, chunk_mb=0.001)) as step:
            for b in bs[2 * i:2 * i + 2]:
                state, _ = step(state, b)
    gc.collect()
    store.collect()
    assert set(store.keys()) == _live_keys(state) and _live_keys(state)
    del state
    gc.collect()
    store.collect()
    assert store.keys() == []  # no state left: nothing left in the store
    store.close()


def _fshard_threads(before=()) -> list[str]:
    """fshard's threads alive now that were not in ``before`` (earlier tests may leave steps unclosed)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("fshard") and t.is_alive() and t not in before]


def test_close_ends_the_threads_and_refuses_further_steps(tmp_path):
    state, bs = _state(), list(awkward_batches(2, 2))
    before = set(threading.enumerate())
    store = fs.NVMeStore(str(tmp_path))
    with fs.compose(awkward_loss, fs.offload_state(store, chunk_mb=0.001, overlap_backward=True)) as step:
        state, _ = step(state, bs[0])
        state, m = step(state, bs[1])
        assert m["update/overlapped_units"] > 0 and "fshard-offload_0" in _fshard_threads(before)
    assert "fshard-offload_0" not in _fshard_threads(before)
    with pytest.raises(fs.StepClosedError, match="was closed"):
        step(state, bs[0])
    step.close()  # idempotent
    store.close()
    assert _fshard_threads(before) == []


# --- the public surface -----------------------------------------------------------------------------------------


def test_all_names_every_public_object_and_dir_shows_them():
    assert len(set(fs.__all__)) == len(fs.__all__)
    for name in fs.__all__:
        assert getattr(fs, name) is not None, name
    assert set(fs.__all__) <= set(dir(fs)) and "NVMeStore" in dir(fs)
    public = {n for n, v in vars(fs).items() if not n.startswith("_") and not isinstance(v, type(sys))}
    assert public - {"annotations", "importlib"} <= set(fs.__all__)


def test_import_loads_neither_the_native_ops_nor_the_test_helpers():
    code = ("import sys, fshard as fs; heavy = ('fshard.ops', 'fshard.testing', 'hypothesis', 'tensornvme');"
            "print(sorted(m for m in sys.modules if m.startswith(heavy))); fs.ops; fs.testing;"
            "print(sorted(m for m in ('fshard.ops', 'fshard.testing') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "['fshard.ops', 'fshard.testing']"


# Raised on purpose but not FshardErrors, by Python's own protocols: a module's __getattr__ must raise
# AttributeError, an iterator ends with StopIteration, and fshard.testing's checkers fail a test with
# AssertionError, as pytest expects.
_PROTOCOL_RAISES = {("__init__.py", "AttributeError"), ("_stream.py", "StopIteration"),
                    ("testing.py", "AssertionError")}


def test_every_error_fshard_raises_on_purpose_is_an_fshard_error():
    namespace = {}
    for mod in ("fshard._errors", "fshard._offload", "fshard.store._errors", "fshard.ops._build"):
        namespace.update(vars(__import__(mod, fromlist=["_"])))
    bad = []
    for path in sorted(FSHARD.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = exc.id if isinstance(exc, ast.Name) else None
                if name is None or name.lstrip("_")[0].islower() or (path.name, name) in _PROTOCOL_RAISES:
                    continue  # re-raising a caught exception (raise e) or a computed one (raise self._failed(...))
                cls = namespace.get(name)
                if not (isinstance(cls, type) and issubclass(cls, fs.FshardError)):
                    bad.append(f"{path.relative_to(FSHARD)}:{node.lineno} raises {name}")
    assert not bad, bad
