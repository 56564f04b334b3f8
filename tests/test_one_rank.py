"""World size 1 moves nothing (issue #42): the gathered buffer is the shard itself, the reduced gradient is the
gradient itself, and with donate=True the update is in place. Counted with a dispatch mode (every aten op of a step,
backward included), and held bitwise against what the same step computes where the copies are still made (two
units whose shards share a storage keep their own gathered buffers), and with a process group of one rank: no
collective at all, the results of Mesh.local()."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import Awkward, awkward_batches, awkward_loss

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class _Count(TorchDispatchMode):
    """Calls and bytes written per aten op."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        t = args[0] if name == "copy_" else out
        self.calls[name] = self.calls.get(name, 0) + 1
        if isinstance(t, torch.Tensor):
            self.bytes[name] = self.bytes.get(name, 0) + t.numel() * t.element_size()
        return out


def _gpt():
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    cfg = GPTConfig.tiny(n_layers=3)
    torch.manual_seed(0)
    return GPT(cfg), loss_fn, list(synthetic_batches(cfg, 2, 4, seed=3))


def _torch_counts(model, loss_fn, batches):
    """The plain loop's ops for one step (after warm-up steps): the model's own copies and clones."""
    opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)

    def step(b):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, b).backward()
        opt.step()
    for b in batches[:-1]:
        step(b)
    with _Count() as c:
        step(batches[-1])
    return c


@pytest.mark.parametrize("transforms", ["blocking", "ahead+buckets"])
def test_a_donated_step_at_world_size_1_copies_nothing(transforms):
    import fshard as fs
    model, loss_fn, batches = _gpt()
    theirs = _torch_counts(copy.deepcopy(model), loss_fn, batches)
    state = fs.init(model, fs.Mesh.local(), fs.adamw(**HP))
    ts = (fs.gather_ahead(2), fs.bucket_reduce(0.001)) if transforms != "blocking" else ()
    with fs.compose(loss_fn, *ts, donate=True) as step:
        for b in batches[:-1]:
            state, _ = step(state, b)
        with _Count() as c:
            state, m = step(state, batches[-1])
    units = [u for u in state.spec.units if u.trainable]
    # no gather copies, no reduce-scatter copy, no bucket, no clone of the state
    assert c.calls.get("copy_", 0) == 0, c.calls
    assert c.calls.get("clone", 0) == theirs.calls.get("clone", 0), (c.calls, theirs.calls)
    # nor a flat gradient: each parameter's gradient goes to the update where autograd left it, as in torch
    # (fshard/state/_slot_grad.py; split's backward concatenated them, one unit-sized cat a unit, before)
    assert c.calls.get("cat", 0) == theirs.calls.get("cat", 0), (c.calls, theirs.calls)
    assert c.calls.get("zeros", 0) <= theirs.calls.get("zeros", 0) + len(units), (c.calls, theirs.calls)
    # the figures still describe the step's gathers and reductions (logical: nothing moved)
    assert m["comm/gather_bytes"] > 0 and m["comm/reduce_bytes"] > 0 and m["mem/peak_gathered_bytes"] > 0


def test_mixed_precision_at_world_size_1_casts_once_per_gather():
    """Without copies, a one-rank gather casts the shard into the unit's buffer in one pass: a copy_ that casts,
    no cast and then a copy. With copies, the buffer is the state's bf16 copy: nothing."""
    import fshard as fs
    model, loss_fn, batches = _gpt()
    counts = {}
    for copies in (True, False):
        state = fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(**HP))
        with fs.compose(loss_fn, fs.mixed_precision(param_copies=copies), donate=True) as step:
            state, _ = step(state, batches[0])
            with _Count() as c:
                state, m = step(state, batches[1])
        counts[copies] = c
        units = [u for u in state.spec.units if u.trainable]
        # each unit's gradient cast to fp32 once for the update (reduce_dtype), nothing else cast
        grads = sum(u.numel * 4 for u in units)
        assert c.bytes.get("_to_copy", 0) == grads, (copies, c.bytes)
    assert counts[True].calls.get("copy_", 0) == 0
    gathers = counts[False].calls.get("copy_", 0)
    assert gathers >= len(state.spec.units), counts[False].calls  # one casting copy per gather, forward and backward


def _bits(state):
    import fshard as fs
    return {n: t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            for n, t in fs.full_params(state).items()}


def _run(state, loss_fn, batches, ts=(), donate=False):
    import fshard as fs
    losses = []
    with fs.compose(loss_fn, *ts, donate=donate) as step:
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
    return losses, _bits(state)


def _shared_storage(state):
    """The same state with every unit's shard a view of one tensor: the units cannot use their shards as their
    gathered buffers (the saved-tensor hook tells units by storage), so they gather copies."""
    flat = torch.cat([state.params[u.name] for u in state.spec.units])
    params, at = {}, 0
    for u in state.spec.units:
        params[u.name] = flat[at:at + u.numel]
        at += u.numel
    return state.replace(params=params)


@pytest.mark.parametrize("donate", [False, True])
def test_shards_sharing_a_storage_gather_copies_and_train_the_same(donate):
    import fshard as fs
    for model, loss_fn, batches in (_gpt(), (Awkward(), awkward_loss, list(awkward_batches(2, 4)))):
        for ts in ((), (fs.gather_ahead(1), fs.bucket_reduce(1e-4)), (fs.mixed_precision(param_copies=False),)):
            state = fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(**HP, impl="torch"))
            shared = _shared_storage(fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(**HP, impl="torch")))
            a = _run(state, loss_fn, batches, ts, donate)
            b = _run(shared, loss_fn, batches, ts, donate)
            assert a == b, f"{type(model).__name__} {ts}: sharing a storage changed the results"
    shared = _shared_storage(fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(**HP)))
    with fs.compose(loss_fn, donate=donate) as step, _Count() as c:
        step(shared, batches[0])
    assert c.calls.get("copy_", 0) >= len(shared.spec.units), c.calls  # each unit gathered into a buffer of its own


def test_a_step_at_world_size_1_leaves_its_input_intact():
    """Forward binds views of the input's own shards: the step still never writes them without donate."""
    import fshard as fs
    for ts in ((), (fs.gather_ahead(2), fs.bucket_reduce(1e-4)), (fs.mixed_precision(),)):
        state = fs.init(Awkward(), fs.Mesh.local(), fs.adamw(**HP))
        before = _bits(state)
        batches = list(awkward_batches(2, 3))
        first = _run(state, awkward_loss, batches, ts)
        assert _bits(state) == before, f"{ts}: the input state changed"
        assert _run(state, awkward_loss, batches, ts) == first, f"{ts}: a second run from the input differs"


def test_bucket_reduce_at_world_size_1_is_the_blocking_step():
    """Without buckets at one rank: the blocking step's results, for every bucket size, and with a reduce dtype
    narrower than the units' (the gradient rounded as its copy into a bf16 bucket rounded it)."""
    import fshard as fs
    batches = list(awkward_batches(2, 4))
    torch.manual_seed(0)
    model = Awkward()
    runs = {}
    for key, ts in {"blocking": (), "tiny": (fs.bucket_reduce(1e-6),), "whole": (fs.bucket_reduce(1e4),),
                    "per_unit": (fs.bucket_reduce(per_unit=True),),
                    "bf16": (fs.bucket_reduce(1e4, reduce_dtype=torch.bfloat16),)}.items():
        state = fs.init(copy.deepcopy(model), fs.Mesh.local(), fs.adamw(**HP))
        runs[key] = _run(state, awkward_loss, batches, ts)
    for key in ("tiny", "whole", "per_unit"):
        assert runs[key] == runs["blocking"], key
    assert runs["bf16"][0][0] == runs["blocking"][0][0]  # the first loss comes before any update
    assert runs["bf16"] != runs["blocking"]  # the bf16 rounding of the gradients is there


def _one_rank_group():
    """In a process with a one-rank gloo group: the torch.distributed calls each step makes (none expected), and the
    results against Mesh.local()'s, for the blocking step and for gather_ahead + bucket_reduce."""
    import torch.distributed as dist

    import fshard as fs
    dist.init_process_group("gloo")
    mesh = fs.Mesh.from_env()
    assert mesh.group is not None and mesh.world_size == 1
    names = [n for n in ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single",
                         "reduce_scatter_tensor", "reduce", "all_gather", "all_to_all_single")
             if hasattr(dist, n)]  # (all_gather_single: torch 2.13 on; fshard/dist/_bare.py)
    calls, saved = [], {n: getattr(dist, n) for n in names}

    def counted(n, f):
        def call(*args, **kwargs):
            calls.append(n)
            return f(*args, **kwargs)
        return call
    model, loss_fn, batches = _gpt()
    out = {}
    for key, ts in {"blocking": lambda: (), "ahead+buckets": lambda: (fs.gather_ahead(2), fs.bucket_reduce(1e-3)),
                    "bf16": lambda: (fs.mixed_precision(param_copies=False),)}.items():
        runs = {}
        for where, m in (("group", mesh), ("local", fs.Mesh.local())):
            state = fs.init(copy.deepcopy(model), m, fs.adamw(**HP))
            for n in names:
                setattr(dist, n, counted(n, saved[n]))
            try:
                runs[where] = _run(state, loss_fn, batches, ts(), donate=True)
            finally:
                for n in names:
                    setattr(dist, n, saved[n])
        out[key] = (runs["group"] == runs["local"], list(calls))
        calls.clear()
    return out


def test_a_one_rank_process_group_issues_no_collective():
    from _dist import run_ranks
    for key, (same, calls) in run_ranks(_one_rank_group, 1)[0].items():
        assert same, f"{key}: a one-rank gloo group trained differently from Mesh.local()"
        assert calls == [], f"{key}: a one-rank step issued {calls}"


def test_a_step_holds_its_gradients_until_the_next_call_and_no_longer():
    """As torch's loop holds ``.grad`` until its next ``zero_grad()``: a step function keeps the last step's gradient
    shards until its next call (a step, ``step.eval``, ``step.plan``) or ``close()``, each of which lets them go
    before anything else (fshard/step/_step.py, ``_held``; freed as the step returned, glibc gave the top of its heap
    back and the next forward faulted it in anew: benchmarks/RESULTS.md, "Session 49"). The results are the other
    tests'."""
    import weakref

    import fshard as fs
    model, loss_fn, batches = _gpt()
    held, dead_at_forward = [], []

    def watching(module, batch):  # the previous step's gradients, as this call's forward begins
        dead_at_forward.append(bool(held) and all(r() is None for r in held))
        return loss_fn(module, batch)

    step = fs.compose(watching, donate=True)
    state = fs.init(model, fs.Mesh.local(), fs.adamw(**HP))

    def kept():  # the gradients the step function holds now, as weak references
        held[:] = [weakref.ref(g) for g in step._held]
        return bool(held) and all(r() is not None for r in held)

    state, _ = step(state, batches[0])
    assert kept()
    state, _ = step(state, batches[1])  # its forward found the first step's gone; it holds its own
    assert kept()
    step.eval(state, batches[2])  # its forward found them gone
    assert all(r() is None for r in held)
    state, _ = step(state, batches[3])
    assert kept()
    step.plan(state, batches[3])
    assert all(r() is None for r in held)
    state, _ = step(state, batches[0])
    assert kept()
    step.close()
    assert all(r() is None for r in held)
    assert dead_at_forward[1:3] == [True, True], dead_at_forward  # a step's and eval's forward: none left
