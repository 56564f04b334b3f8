"""The seams between stages: declared protocols, conflicts as errors, state that is data, stores and steps that own
their lifetimes, one public surface and one error family."""
from __future__ import annotations

import ast
import copy
import dataclasses
import gc
import pathlib
import pickle
import re
import subprocess
import sys
import threading
import time
import warnings

import optree
import pytest
import torch

import fshard as fs
import fshard.testing as ft
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
    with pytest.raises(fs.errors.TransformConflictError) as e:
        fs.compose(awkward_loss, fs.clip_by_global_norm(1.0), a, fs.skip_nonfinite(), b)
    msg = str(e.value)
    assert repr(a) in msg and repr(b) in msg and f"both set the {stage} stage" in msg
    assert "Pass only one of them" in msg
    assert isinstance(e.value, fs.FshardError) and isinstance(e.value, ValueError)


class _Mine(fs.protocol.GradsPolicy, fs.protocol.ReducePolicy):
    """A policy that changes nothing (the protocols' defaults), to set a stage with."""


class _SetReduce(fs.Transform):
    name = "set_reduce"
    stages = {"reduce": "set"}

    def wrap_reduce(self, reduce):
        return _Mine()


def test_wrappers_compose_and_a_setter_after_a_wrapper_is_an_error():
    clips = fs.clip_by_global_norm(1.0), fs.skip_nonfinite(), fs.clip_by_global_norm(2.0)
    step = fs.compose(awkward_loss, *clips)
    assert not step.policy.grads_unchanged and tuple(link.transform for link in step.policy.grads) == clips
    assert fs.compose(awkward_loss).policy.grads == ()  # no link: the shards go to the update as they are
    mp = fs.mixed_precision(torch.bfloat16)
    fs.compose(awkward_loss, _SetReduce(), mp)  # set first, then wrap: fine
    with pytest.raises(fs.errors.TransformConflictError,
                       match=re.escape(f"sets the reduce stage, which {mp!r} (passed before it) wraps") +
                       r".*Pass set_reduce\(\) before"):
        fs.compose(awkward_loss, mp, _SetReduce())


def test_a_transform_must_declare_the_stages_it_changes():
    class Undeclared(fs.Transform):
        name = "undeclared"

        def wrap_reduce(self, reduce):
            return _Mine()

    with pytest.raises(fs.ArgumentTypeError, match=r"changes the reduce stage but does not declare how"):
        fs.compose(awkward_loss, Undeclared())


def test_a_policy_must_follow_its_stage_protocol():
    class OldStyle(fs.Transform):  # a plain function as a grads link: it lacks the declared hooks
        name = "old_style"

        def grads_link(self):
            return lambda comm, g: g

    with pytest.raises(fs.ArgumentTypeError, match=r"which is not a GradsPolicy: subclass fs.protocol.GradsPolicy"):
        fs.compose(awkward_loss, OldStyle())


def test_a_grads_method_is_a_link_of_the_grads_chain():
    """``Transform.grads(comm, grads)``: a link run in composition order among the others, no inner, no close to
    forward; changes_grads from the class (issue #39)."""
    seen = []

    class note(fs.Transform):
        changes_grads = False

        def __init__(self, tag):
            self.tag = tag

        def grads(self, comm, grads):
            seen.append((self.tag, grads.scale))
            return grads.with_metrics(**{f"note/{self.tag}": len(grads.shards)})

    assert note.stages == {} and fs.Transform.stages == {}
    step = fs.compose(awkward_loss, note("a"), fs.clip_by_global_norm(1e-3), note("b"))
    assert not step.policy.grads_unchanged
    _, m = step(_state(), next(iter(awkward_batches(2, 1))))
    assert [t for t, _ in seen] == ["a", "b"] and seen[0][1] == 1.0 and seen[1][1] < 1.0  # b runs after the clip
    assert m["note/a"] == m["note/b"] > 0 and m["grad_clip_scale"] < 1.0
    assert fs.compose(awkward_loss, note("a")).policy.grads_unchanged  # it says it changes nothing
    with pytest.raises(fs.ArgumentTypeError, match=r"defines both grads .* and grads_link"):
        class both(fs.Transform):
            def grads(self, comm, grads):
                return grads

            def grads_link(self):
                return None
    with pytest.raises(fs.ArgumentTypeError, match=r"wraps the grads stage.*define grads\(self, comm, grads\)"):
        class wrapper(fs.Transform):  # the wrapping API before issue #39: refused, naming the fix
            def wrap_grads(self, inner):
                return inner


def test_the_grads_chain_is_links_run_in_order_and_each_is_closed():
    """``Policy.grads`` is a tuple of links, none holding another; ``step.close()`` closes each (issue #39)."""
    closed = []

    class Link(fs.protocol.GradsPolicy):
        changes_grads = False

        def __init__(self, tag):
            self.tag = tag

        def close(self):
            closed.append(self.tag)

    class linked(fs.Transform):
        def __init__(self, tag):
            self.tag = tag

        def grads_link(self):
            return Link(self.tag)

    clip = fs.clip_by_global_norm(1.0)
    step = fs.compose(awkward_loss, linked("a"), clip, linked("b"))
    assert [getattr(link, "tag", None) for link in step.policy.grads] == ["a", None, "b"]
    assert step.policy.grads[1].transform is clip and not step.policy.grads_unchanged
    with fs.compose(awkward_loss, linked("c"), linked("d")) as other:
        assert other.policy.grads_unchanged  # both links say they change nothing
    assert closed == ["c", "d"]
    step.close()
    assert closed == ["c", "d", "a", "b"]


# --- every shipped reduce policy hands every unit over ----------------------------------------------------------


class _Record(fs.Transform):
    """Sets the update stage to the default update plus a record of ``overlap`` calls."""

    name = "record"
    stages = {"update": "set"}

    def __init__(self):
        self.overlapped, self.updated = [], []

    def wrap_update(self, inner):
        rec = self

        class Recording(fs.protocol.UpdatePolicy):
            def overlap(self, step, unit):
                rec.overlapped.append((unit.name, unit.grad, len(step.order)))

            def __call__(self, step, state, grads, active, donate):
                rec.updated.append((dict(grads.shards), len(step.order)))
                return inner(step, state, grads, active, donate)
        return Recording()


def _hand_over(reduce, k, world_size=1):
    """Per step: the units offered to overlap, in order, and whether each was offered the very shard the update
    got, in the last micro-batch (whose forward called 4 units), before the update."""
    mesh, rec = fs.Mesh.from_env(), _Record()
    torch.manual_seed(0)
    state = fs.init(Awkward(), mesh, fs.adamw(lr=1e-2, impl="torch"))
    ts = (() if reduce is None else (fs.bucket_reduce(reduce),)) + ((fs.accumulate(k),) if k > 1 else ())
    step = fs.compose(awkward_loss, *ts, rec)
    bs = list(awkward_batches(2, 2 * k, rank=mesh.rank, world_size=world_size))
    out = []
    for i in range(2):
        state, _ = step(state, bs[i * k:(i + 1) * k] if k > 1 else bs[i])
        shards, calls = rec.updated[-1]
        offered = rec.overlapped[len(rec.overlapped) - len(shards):]
        out.append((sorted(n for n, _, _ in offered), sorted(shards),
                    all(shards[n] is g and c == calls for n, g, c in offered)))
    return out, len(rec.overlapped) == sum(len(s) for s, _ in rec.updated)


@pytest.mark.parametrize("reduce", [None, 1e-6, 1e-4, 25])
@pytest.mark.parametrize("k", [1, 3])
def test_every_shipped_reduce_policy_hands_each_unit_over_once_in_the_last_micro_batch(reduce, k):
    steps, counted = _hand_over(reduce, k)
    assert counted  # no unit offered twice, none in an earlier micro-batch
    for offered, updated, same in steps:
        assert offered == updated and same  # every unit the update gets, offered once, with that very shard
        # the never-called unit: no gradient to reduce (blocking), or its zeros with its bucket's (bucket_reduce)
        assert ("blocks.2" in updated) == (reduce is not None) and "<root>" in updated


@pytest.mark.parametrize("reduce", [None, 1e-4])
def test_the_hand_over_holds_at_world_size_2(reduce):
    from _dist import run_ranks
    for steps, counted in run_ranks(_hand_over, 2, reduce, 3, 2):
        assert counted and all(offered == updated and same for offered, updated, same in steps)


class _Lazy(fs.Transform):
    """A reduce policy that forgets to hand a unit over, or hands it over twice."""

    name = "lazy"
    stages = {"reduce": "set"}

    def __init__(self, times, short=0):
        self.times, self.short = times, short

    def wrap_reduce(self, reduce):
        times, short = self.times, self.short

        class Lazy(fs.protocol.ReducePolicy):
            def reduce(self, step, unit, grad):
                for _ in range(times if unit.name == "blocks.1" else 1):
                    step.grad_ready(unit, grad[:unit.layout.shard_numel - short].clone())
        return Lazy()


def test_a_reduce_policy_that_breaks_the_hand_over_is_named():
    b = next(iter(awkward_batches(2, 1)))
    with pytest.raises(fs.errors.PolicyError,
                       match=r"reduce policy Lazy did not hand over.*\['blocks.1'\].*grad_ready"):
        fs.compose(awkward_loss, _Lazy(0))(_state(), b)
    with pytest.raises(fs.errors.PolicyError, match=r"handed over unit 'blocks.1'.*twice"):
        fs.compose(awkward_loss, _Lazy(2))(_state(), b)
    with pytest.raises(fs.errors.PolicyError,
                       match=r"handed over 111 elements of torch.float32 as the gradient shard of "
                             r"unit 'blocks.1', whose shard has 112 of torch.float32"):
        fs.compose(awkward_loss, _Lazy(1, short=1))(_state(), b)


def test_policies_see_only_the_documented_views():
    seen = {}

    class Peek(fs.Transform):
        name = "peek"
        stages = {"gather": "set"}

        def wrap_gather(self, gather):
            class Peeking(fs.protocol.GatherPolicy):
                def before_forward(self, step, unit):
                    seen.setdefault("step", {a for a in dir(step) if not a.startswith("_")})
                    seen.setdefault("unit", {a for a in dir(unit) if not a.startswith("_")})
                    seen.setdefault("comm", {a for a in dir(step.comm) if not a.startswith("_")})
                    unit.acquire()
            return Peeking()

    fs.compose(awkward_loss, Peek())(_state(), next(iter(awkward_batches(2, 1))))
    for name, proto in (("step", fs.protocol.StepView), ("unit", fs.protocol.UnitView),
                        ("comm", fs.protocol.Collectives)):
        declared = set(proto.__annotations__) | {a for a in vars(proto) if not a.startswith("_")}
        assert seen[name] <= declared, f"{name} exposes undocumented {sorted(seen[name] - declared)}"


# --- state is data ----------------------------------------------------------------------------------------------


def test_state_mappings_are_read_only_and_name_the_fix():
    state = _state()
    for field in ("params", "opt_state", "buffers"):
        m = getattr(state, field)
        key = next(iter(m))
        with pytest.raises(fs.errors.FrozenStateError, match=rf"state\.replace\({field}=\{{\*\*state\.{field}, "):
            m[key] = None
        with pytest.raises(fs.errors.FrozenStateError):
            del m[key]
    new = state.replace(params={**state.params, "<root>": state.params["<root>"] + 1})
    assert isinstance(new.params, fs.state.FrozenMap) and list(new.params) == list(state.params)
    leaves, spec = optree.tree_flatten(new, namespace="fshard")
    back = optree.tree_unflatten(spec, leaves)
    assert isinstance(back.params, fs.state.FrozenMap) and back.params["<root>"] is new.params["<root>"]
    paths = [".".join(map(str, p)) for p in optree.tree_paths(state, namespace="fshard")]
    assert "params.<root>" in paths and "skipped" in paths


def test_states_copy_and_pickle():
    state = _state()
    for back in (copy.deepcopy(state), pickle.loads(pickle.dumps(state)), copy.copy(state)):
        assert isinstance(back.params, fs.state.FrozenMap) and list(back.params) == list(state.params)
        ft.check_unchanged(back, ft.snapshot(state))
    assert dict(copy.copy(state.params)) == dict(state.params)


def test_grads_are_frozen():
    g = fs.protocol.Grads({"a": torch.ones(3)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.scale = 2.0
    with pytest.raises(TypeError):
        g.shards["b"] = torch.ones(1)
    h = g.replace(scale=0.5).with_metrics(x=1)
    assert (g.scale, dict(g.metrics), h.scale, dict(h.metrics)) == (1.0, {}, 0.5, {"x": 1})
    normed = g.replace(sq_norm=3.0)
    assert normed.replace(scale=2.0).sq_norm == 3.0  # the norm is of the shards, before any scale
    assert normed.replace(shards={"a": torch.zeros(3)}).sq_norm is None  # new shards: the cached norm is stale


def test_a_transform_is_its_fields_and_is_frozen():
    """Its fields are its fingerprint (written alike on every rank) and its default repr; a repr of its own cannot
    hide them from the rank check; once made it is frozen (issue #39)."""
    class scaled(fs.Transform):
        def __init__(self, factor, device=torch.device("cpu"), on=None):
            self.factor, self.device, self.on = factor, device, on

    class quiet(scaled):
        def __repr__(self):
            return "quiet()"

    @dataclasses.dataclass(frozen=True)
    class dc(fs.Transform):
        factor: float = 1.0

    a = scaled(0.5, on=lambda name: True)
    assert repr(a).startswith("scaled(factor=0.5, device=device('cpu'), on=test_protocol.") and a.name == "scaled"
    assert repr(a).endswith(".<lambda>)") and " at 0x" not in repr(a)  # a function by its qualified name
    assert "factor=0.5" in a.fingerprint() and " at 0x" not in a.fingerprint()
    assert scaled(0.5, torch.device("cuda", 1)).fingerprint() == scaled(0.5, torch.device("cuda", 0)).fingerprint()
    assert scaled(0.5).fingerprint() != scaled(0.25).fingerprint()
    assert quiet(0.5).fingerprint() != quiet(0.25).fingerprint() and repr(quiet(0.5)) == "quiet()"
    assert quiet(0.5).fingerprint() != scaled(0.5).fingerprint()  # the class counts too
    assert dc(2.0).fingerprint() != dc(3.0).fingerprint() and "factor=2.0" in dc(2.0).fingerprint()
    with pytest.raises(fs.errors.FrozenStateError, match=r"scaled\(factor=0.5.*is frozen.*Make another one"):
        a.factor = 1.0
    with pytest.raises(fs.errors.FrozenStateError):
        del a.factor
    with pytest.raises(dataclasses.FrozenInstanceError):
        dc(2.0).factor = 1.0

    class local(scaled):
        rank_local = ("device",)
    assert "device" not in local(0.5).fingerprint() and "device=" in repr(local(0.5))
    # the built-ins: short reprs for people, every field in the fingerprint
    g = fs.gather_ahead(2, on_change="error")
    assert repr(g) == "fs.gather_ahead(depth=2)" and "on_change='error'" in g.fingerprint()
    assert repr(fs.skip_nonfinite()) == "fs.skip_nonfinite()"
    assert "reduce_dtype=torch.float32" in fs.bucket_reduce(1, reduce_dtype=torch.float32).fingerprint()
    assert copy.deepcopy(g).fingerprint() == g.fingerprint()
    with pytest.raises(fs.errors.FrozenStateError):
        g.depth = 3


def test_donation_is_a_field_shared_by_states_that_share_tensors():
    state = _state()
    alias = state.replace(step=state.step)  # shares every tensor
    assert not state.donation.done and alias.donation is state.donation
    b = next(iter(awkward_batches(2, 1)))
    new, _ = fs.compose(awkward_loss, donate=True)(state, b)
    assert state.donation.done and "donated at step 0" in repr(state) and not new.donation.done
    for s in (state, alias):
        with pytest.raises(fs.errors.DonatedStateError, match="at step 0"):
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
            ["fshard: non-finite gradients (inf or NaN); the step was skipped: no update, and state.skipped "
             "counted up (metrics['skipped_total'])."] if i == 1 else [])
        if i == 1:
            assert new.params is state.params and new.step is state.step and int(new.skipped) == 1
        state = new
    assert (int(state.step), int(state.skipped), m["skipped_total"], m["skipped"]) == (2, 1, 1, 0)


@pytest.mark.parametrize("donate", [False, True])
def test_a_skipped_step_keeps_the_buffers_forward_updated(donate):
    """As torch: a step whose optimizer step is skipped (GradScaler, an overflow) has run forward, which updated
    BatchNorm's running statistics; the parameters stay, the buffers move on, with and without donate."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.lin(x)).square().mean()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 4)
    state = fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(impl="torch"))
    step = fs.compose(lambda m, b: m(b[0]) * b[1], fs.skip_nonfinite(), donate=donate)
    params = {n: t.clone() for n, t in fs.full_params(state).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new, m = step(state, (x, float("inf")))
    model(x)  # torch: forward ran, so the running statistics moved; the optimizer step was skipped
    assert m["skipped"] == 1 and int(new.step) == 0
    assert all(torch.equal(params[n], t) for n, t in fs.full_params(new).items())
    for name, b in model.named_buffers():
        assert torch.equal(new.buffers[name], b), name


# --- lifetimes: store versions and threads --------------------------------------------------------------------


def _live_keys(state) -> set:
    return {k for s in state.opt_state.values() if isinstance(s.exp_avg, fs.state.Stored)
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


class _OneUser:
    """A store wrapper that counts operations begun while another thread's is under way (the store is not locked:
    it must have one user at a time), and fails the worker's first stream (a disk error in the first unit begun)."""

    def __init__(self, inner):
        self.inner, self.lock, self.overlaps, self.fail_next = inner, threading.Lock(), 0, False

    def _op(self, name, *args, **kwargs):
        if not self.lock.acquire(blocking=False):
            self.overlaps += 1
            self.lock.acquire()
        try:
            time.sleep(0.002)  # widen the window a race would need
            return getattr(self.inner, name)(*args, **kwargs)
        finally:
            self.lock.release()

    def put(self, key, t):
        return self._op("put", key, t)

    def get(self, key, out=None):
        return self._op("get", key, out)

    def delete(self, key):
        return self._op("delete", key)

    def collect(self):
        return self._op("collect")

    def keys(self):
        return self._op("keys")

    def stream(self, keys, depth=2, writeback=False, max_writes=None):
        from fshard.store import Stream
        if self.fail_next and threading.current_thread().name.startswith("fshard-offload"):
            self.fail_next = False
            raise OSError(5, "Input/output error (injected)")
        return Stream(self, keys, depth=depth, writeback=writeback, max_writes=max_writes)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_failed_update_begun_in_backward_waits_for_the_others_before_touching_the_store(tmp_path):
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(n_layers=4)
    state = fs.init(GPT(cfg), fs.Mesh.local(), fs.adamw())
    bs = list(synthetic_batches(cfg, 2, 3, seed=1))
    store = _OneUser(fs.NVMeStore(str(tmp_path)))
    with fs.compose(loss_fn, fs.offload_state(store, chunk_mb=0.002, overlap_backward=True)) as step:
        state, _ = step(state, bs[0])
        state, m = step(state, bs[1])
        assert m["update/overlapped_units"] >= 3
        keys = set(store.keys())
        store.fail_next = True  # the first unit begun in the next backward fails; the others go on writing
        with pytest.raises(fs.errors.OffloadError, match="Input/output error"):
            step(state, bs[2])
        assert store.overlaps == 0 and set(store.keys()) == keys  # one user at a time; nothing left behind
        again, m = step(state, bs[2])  # the input state is intact
        assert m["update/overlapped_units"] >= 3
    store.inner.close()


def test_work_begun_in_backward_is_dropped_when_the_update_is_skipped(tmp_path):
    class Fickle(fs.Transform):  # wrongly says it changes nothing, then skips the step
        name = "fickle"

        def grads_link(self):
            class Policy(fs.protocol.GradsPolicy):
                changes_grads = False

                def __call__(self, comm, grads):
                    return grads.replace(skip=True)
            return Policy()

    state, bs = _state(), list(awkward_batches(2, 2))
    with fs.NVMeStore(str(tmp_path)) as store:
        with fs.compose(awkward_loss, fs.offload_state(store, chunk_mb=0.001, overlap_backward=True)) as step:
            state, _ = step(state, bs[0])  # moves the moments into the store
        keys = set(store.keys())
        with fs.compose(awkward_loss, Fickle(), fs.offload_state(store, chunk_mb=0.001, overlap_backward=True)) \
                as step:
            new, m = step(state, bs[1])
        assert int(new.skipped) == 1 and new.opt_state is state.opt_state
        store.collect()
        assert set(store.keys()) == keys  # what the worker began for the skipped step is gone


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
    with pytest.raises(fs.errors.StepClosedError, match="was closed"):
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
    assert {"ops", "testing", "store"} <= set(dir(fs))  # subpackages: shown, not star-imported
    public = {n for n, v in vars(fs).items() if not n.startswith("_") and not isinstance(v, type(sys))}
    assert public - {"annotations", "importlib"} <= set(fs.__all__)


def test_import_loads_neither_the_native_ops_nor_the_test_helpers():
    code = ("import sys; from fshard import *; import fshard as fs;"
            "heavy = ('fshard.ops', 'fshard.testing', 'hypothesis', 'tensornvme');"
            "print(sorted(m for m in sys.modules if m.startswith(heavy))); fs.ops; fs.testing;"
            "print(sorted(m for m in ('fshard.ops', 'fshard.testing') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "['fshard.ops', 'fshard.testing']"


# Raised on purpose but not FshardErrors, by Python's own protocols: a module's __getattr__ must raise
# AttributeError, an iterator ends with StopIteration, and fshard.testing's checkers fail a test with
# AssertionError, as pytest expects.
_PROTOCOL_RAISES = {("__init__.py", "AttributeError"), ("_stream.py", "StopIteration"), ("_cpu.py", "StopIteration"),
                    ("testing.py", "AssertionError"),
                    ("_protocol.py", "AttributeError"),  # OptState.__getattr__: a row by its name, or none
                    ("_read.py", "UnpicklingError"),  # pickle's protocol; read_metadata makes it a CheckpointError
                    ("_dcp.py", "FileNotFoundError")}  # DCP's reader protocol: no rank-local metadata, its fallback


def test_every_error_fshard_raises_on_purpose_is_an_fshard_error():
    namespace = {}
    for mod in ("fshard.errors",):  # every error type fshard declares
        namespace.update(vars(__import__(mod, fromlist=["_"])))
    bad = []
    for path in sorted(FSHARD.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(exc, ast.Attribute) else None
                if name is None or name.lstrip("_")[0].islower() or (path.name, name) in _PROTOCOL_RAISES:
                    continue  # re-raising a caught exception (raise e) or a computed one (raise self._failed(...))
                cls = namespace.get(name)
                if not (isinstance(cls, type) and issubclass(cls, fs.FshardError)):
                    bad.append(f"{path.relative_to(FSHARD)}:{node.lineno} raises {name}")
    assert not bad, bad
