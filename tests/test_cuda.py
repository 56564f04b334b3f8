"""The CUDA path at world size 1 (issue #23): fshard on one GPU against torch on the same GPU.

Each test runs on a mesh of one CUDA rank, two ways: ``Mesh.local("cuda")`` (no process group) and a one-rank
NCCL group (collectives through NCCL, the gathers on the step's side stream). The oracle is the one the CPU tests
use: torch.optim.AdamW (or FSDP2's MixedPrecisionPolicy) on the same model, on the same device, on the same
batches. Multi-rank tests stay on gloo and the CPU (one GPU). Skipped without a CUDA device; run them on one with
``pytest tests/test_cuda.py`` (the device tool, benchmarks/RESULTS.md's GPU section)."""
from __future__ import annotations

import copy
import gc
import os

import pytest
import torch

from _dist import run_ranks
from models import Awkward, awkward_batches, awkward_loss, check_oracle, oracle_step, param_diffs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 6
MESHES = ["local", "nccl"]


def _on_mesh(kind: str, fn, *args):
    """fn(mesh, *args) on a one-rank CUDA mesh: in this process (local) or in a one-rank NCCL group (spawned)."""
    if kind == "local":
        import fshard as fs
        torch.manual_seed(0)
        return fn(fs.Mesh.local("cuda"), *args)
    return run_ranks(_nccl, 1, fn, args)[0]


def _nccl(fn, args):
    import torch.distributed as dist

    import fshard as fs
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    mesh = fs.Mesh.from_env()
    assert (mesh.backend, mesh.device.type, mesh.world_size) == ("nccl", "cuda", 1), mesh
    return fn(mesh, *args)


def _cuda(batch):
    return tuple(t.cuda() for t in batch)


def _model(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
        cfg = GPTConfig.tiny(n_layers=3)
        return GPT(cfg), loss_fn, [_cuda(b) for b in synthetic_batches(cfg, 2, STEPS, seed=3)]
    return Awkward(), awkward_loss, [_cuda(b) for b in awkward_batches(2, STEPS)]


def _train(mesh, name, impl, transforms=lambda fs: (), donate=False, metrics=None):
    """(losses, full params as CPU tensors) of fshard on ``mesh``; ``metrics``: a list that gets each step's."""
    import fshard as fs
    model, loss_fn, batches = _model(name)
    state = fs.init(model, mesh, fs.adamw(**HP, impl=impl))
    assert all(t.is_cuda for t in state.params.values())
    losses = []
    with fs.compose(loss_fn, *transforms(fs), donate=donate) as step:
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
            if metrics is not None:
                metrics.append({k: v for k, v in m.items() if isinstance(v, (int, float))})
    return losses, {n: t.cpu() for n, t in fs.full_params(state).items()}


def _against_adamw(mesh):
    """Each model and AdamW implementation against torch.optim.AdamW on the same GPU."""
    out = {}
    for name in ("gpt", "awkward"):
        for impl in ("torch", "fused", "native"):
            model, loss_fn, batches = _model(name)
            ref = copy.deepcopy(model).cuda()
            # impl="torch" replays the single-tensor AdamW kernels, "fused" torch._fused_adamw_ (as fused=True)
            opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HP,
                                    foreach=False, fused=impl != "torch")
            theirs = [oracle_step(ref, opt, loss_fn, b, 1) for b in batches]
            ours, full = _train(mesh, name, impl)
            diffs, bitwise = param_diffs({n: t.cuda() for n, t in full.items()}, ref)
            out[name, impl] = ours, theirs, diffs, bitwise and ours == theirs
    return out


@pytest.mark.parametrize("mesh", MESHES)
def test_matches_torch_adamw_on_the_gpu(mesh):
    for (name, impl), (ours, theirs, diffs, bitwise) in _on_mesh(mesh, _against_adamw).items():
        check_oracle(f"cuda/{mesh}/{name}/{impl}", 1, impl, ours, theirs, diffs, bitwise)
        assert ours[-1] < ours[0], f"{name}/{impl} did not train: {ours}"


def _transform_runs(mesh):
    runs = {
        "blocking": lambda fs: (),
        "ahead+buckets": lambda fs: (fs.gather_ahead(2), fs.bucket_reduce(0.002)),
        "ahead+buckets+clip+skip": lambda fs: (fs.gather_ahead(1), fs.bucket_reduce(0.002),
                                               fs.clip_by_global_norm(1e9), fs.skip_nonfinite()),
    }
    return {k: _bits(*_train(mesh, "awkward", "native", ts)) for k, ts in runs.items()}


def _bits(losses, full):
    """Parameters as bytes: what a spawned rank sends back through a queue (tensors would need shared memory)."""
    return losses, {n: t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() for n, t in full.items()}


@pytest.mark.parametrize("mesh", MESHES)
def test_side_stream_transforms_are_bitwise_the_blocking_step(mesh):
    """gather_ahead issues gathers on the step's side stream, bucket_reduce reduces while backward runs: a missing
    stream wait would read a buffer before it is written, which shows as differing bits here."""
    runs = _on_mesh(mesh, _transform_runs)
    base_losses, base = runs["blocking"]
    for k, (losses, full) in runs.items():
        assert losses == base_losses, f"{k}: losses {losses} vs blocking {base_losses}"
        assert full == base, f"{k}: parameters differ from the blocking step"


def _mixed_against_fsdp2(mesh, transforms):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    model, loss_fn, batches = _model("gpt")
    ref = copy.deepcopy(model).cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dm = init_device_mesh("cuda", (1,))
    for block in ref.blocks:
        fully_shard(block, mesh=dm, mp_policy=policy)
    fully_shard(ref, mesh=dm, mp_policy=policy)
    opt = torch.optim.AdamW(ref.parameters(), **HP, foreach=False)
    theirs = [oracle_step(ref, opt, loss_fn, b, 1) for b in batches]
    ts = (lambda f: (f.gather_ahead(2), f.bucket_reduce(0.002), f.mixed_precision())) if transforms \
        else (lambda f: (f.mixed_precision(),))
    ours, full = _train(mesh, "gpt", "torch", ts)
    equal = all(torch.equal(full[n], (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu())
                for n, p in ref.named_parameters())
    return ours, theirs, equal


@pytest.mark.parametrize("transforms", [False, True], ids=["blocking", "ahead+buckets"])
def test_bf16_is_bitwise_fsdp2_mixed_precision_on_the_gpu(transforms):
    ours, theirs, equal = _on_mesh("nccl", _mixed_against_fsdp2, transforms)
    assert ours == theirs and equal, f"fshard bf16 {ours} vs FSDP2 {theirs}; parameters equal: {equal}"


def _offload_runs(mesh, directory):
    import fshard as fs
    configs = {"none": None, "cpu": lambda: fs.CPUStore()}
    if _has_tensornvme():
        configs["nvme"] = lambda: fs.NVMeStore(os.path.join(directory, "nvme"))
    out = {}
    for k, store in configs.items():
        for mixed in (False, True):
            def ts(f, store=store, mixed=mixed):
                extra = (f.gather_ahead(2), f.bucket_reduce(0.002)) + ((f.mixed_precision(),) if mixed else ())
                return extra + (() if store is None else (f.offload_state(store(), chunk_mb=0.001),))
            out[k, mixed] = _bits(*_train(mesh, "gpt", "native", ts))
    return out


def _has_tensornvme() -> bool:
    import importlib.util
    return importlib.util.find_spec("tensornvme") is not None  # NVMeStore's engine


@pytest.mark.parametrize("mesh", MESHES)
def test_offloaded_moments_are_bitwise_on_the_gpu(mesh, tmp_path):
    """Moments in pinned host memory (CPUStore) or on disk (NVMeStore, where tensornvme is installed), the update
    on the host, the parameters copied back to the GPU: the same bits as moments kept on the GPU."""
    runs = _on_mesh(mesh, _offload_runs, str(tmp_path))
    for (k, mixed), (losses, full) in runs.items():
        base_losses, base = runs["none", mixed]
        assert losses == base_losses, f"{k} (mixed={mixed}): losses {losses} vs {base_losses}"
        assert full == base, f"{k} (mixed={mixed}): parameters differ"
    assert runs["cpu", False][0][-1] < runs["cpu", False][0][0]


def _host_update_runs(mesh, directory):
    """Moments (and with params=True the master weights) in host memory, the update on the host: gradients and
    parameters staged through pinned memory on a copy stream (fshard/offload/_staging.py), after backward or during it
    (overlap_backward: each unit's update starts once its gradient is final), with and without donate; and with
    bucket_reduce, whose gradient shards are views of buckets the GPU writes again (the update reads a copy); and
    stored parameters in a pinned CPUStore, uploaded straight from its items on the gather stream; and tiers: half
    of the units on the GPU and half in host memory, and (with tensornvme) parameters and moments split between a
    pinned CPUStore and an NVMeStore. And the update on the GPU instead (``update_on="device"``): the stored chunks
    copied up and back on two copy streams, after backward; and split (``update_on=0.5``): half of the units so,
    the others on the host, a chunk of each in turn."""
    out = {}
    tiers = [("half on the GPU", dict(fraction=0.5, overlap_backward=True), True)]
    devnvme = []
    if _has_tensornvme():
        tiers.append(("cpu+nvme tiers", dict(params=True, overlap_backward=True, nvme=(0.5, 0.5)), True))
        devnvme.append(("device nvme", dict(update_on="device", nvme_only=True), True))
    for k, kw, donate in (("none", None, False), ("after", dict(overlap_backward=False), False),
                          ("during", dict(overlap_backward=True), False),
                          ("during+donate", dict(overlap_backward=True), True),
                          ("params", dict(params=True, overlap_backward=True), False),
                          ("params+donate", dict(params=True, overlap_backward=True), True),
                          ("params after+donate", dict(params=True, overlap_backward=False), True),
                          ("during+buckets", dict(overlap_backward=True), True),
                          ("params pinned", dict(params=True, overlap_backward=True, pin=True), False),
                          ("params pinned+donate", dict(params=True, overlap_backward=True, pin=True), True),
                          # the update on the GPU: the stored chunks go up and come back (DeviceChunks)
                          ("device", dict(update_on="device"), False),
                          ("device pinned+donate", dict(update_on="device", pin=True), True),
                          ("device params pinned+donate", dict(update_on="device", params=True, pin=True), True),
                          ("device half on the GPU", dict(update_on="device", fraction=0.5, pin=True), False),
                          ("device params", dict(update_on="device", params=True), False),
                          # a split: the first half of the units on the GPU, the rest on the host's cores meanwhile
                          ("split pinned+donate", dict(update_on=0.5, pin=True), True),
                          ("split params", dict(update_on=0.5, params=True), False),
                          *devnvme, *tiers):
        for mixed in (False, True):
            def ts(f, kw=kw, mixed=mixed, k=k):
                extra = (f.gather_ahead(2),) + ((f.bucket_reduce(0.002),) if "buckets" in k else ()) \
                    + ((f.mixed_precision(),) if mixed else ())
                if kw is None:
                    return extra
                kw = dict(kw)
                store = f.CPUStore(pin=kw.pop("pin", False))  # pinned: stored parameters go up straight from it
                if kw.pop("nvme_only", False):
                    store = f.NVMeStore(os.path.join(directory, f"nvme1-{mixed}"))
                if "nvme" in kw:  # two tiers after the GPU: a pinned CPUStore, then an NVMeStore
                    kw["fraction"] = kw.pop("nvme")
                    store = (f.CPUStore(pin=True), f.NVMeStore(os.path.join(directory, f"nvme-{mixed}")))
                return extra + (f.offload_state(store, chunk_mb=0.001, **kw),)
            ms = []
            losses, full = _train(mesh, "gpt", "native", ts, donate=donate, metrics=ms)
            out[k, mixed] = (*_bits(losses, full), ms[-1].get("update/overlapped_units", 0))
    return out


@pytest.mark.parametrize("mesh", MESHES)
def test_the_host_update_streams_bitwise_after_and_during_backward(mesh, tmp_path):
    runs = _on_mesh(mesh, _host_update_runs, str(tmp_path))
    bad = [(k, mixed) for (k, mixed), (losses, full, _) in runs.items()
           if (losses, full) != runs["none", mixed][:2]]
    assert not bad, f"differ from moments on the GPU: {bad}"
    for (k, mixed), (losses, full, overlapped) in runs.items():
        base_losses, base, _ = runs["none", mixed]
        assert losses == base_losses, f"{k} (mixed={mixed}): losses {losses} vs {base_losses}"
        assert full == base, f"{k} (mixed={mixed}): parameters differ"
        expect = k in ("during", "during+donate", "params", "params+donate", "during+buckets", "params pinned",
                       "params pinned+donate", "half on the GPU", "cpu+nvme tiers")
        assert (overlapped > 0) == expect, f"{k} (mixed={mixed}): {overlapped} units updated during backward"


def test_a_chunk_comes_back_down_only_after_its_update():
    """DeviceChunks (update_on="device"): the copy down waits for the update on the current stream, however long
    that takes (a sleeping kernel before it), and the copy up for nothing of it; the streams are the caller's."""
    from fshard.offload._staging import DeviceChunks
    host = torch.zeros(1 << 20, pin_memory=True)
    chunks = DeviceChunks("cuda", 2, (torch.cuda.Stream(), torch.cuda.Stream()))
    dev = chunks.up(host)
    torch.cuda._sleep(10**8)  # (about 0.05-0.1 s of the current stream)
    dev.add_(1)
    chunks.down([(dev, host)])
    chunks.settle()
    assert bool((host == 1).all()), "the copy down did not wait for the update"


def _skip_and_resume(mesh, directory):
    """A state saved on the GPU (fs.save, DCP) and loaded back trains on as the state itself does, bit for bit."""
    import fshard as fs
    model, loss_fn, batches = _model("awkward")
    state = fs.init(model, mesh, fs.adamw(**HP))
    with fs.compose(loss_fn, fs.gather_ahead(1), fs.skip_nonfinite()) as step:
        for batch in batches[:2]:
            state, _ = step(state, batch)
        fs.save(os.path.join(directory, "ckpt"), state)
        resumed = fs.load(os.path.join(directory, "ckpt"), like=state)
        on_gpu = all(t.is_cuda for t in resumed.params.values())
        a, b = state, resumed
        for batch in batches[2:]:
            a, _ = step(a, batch)
            b, _ = step(b, batch)
    full_a, full_b = fs.full_params(a), fs.full_params(b)
    return all(torch.equal(full_a[n], full_b[n]) for n in full_a), _nan_step(mesh), on_gpu


def _nan_step(mesh):
    """skip_nonfinite on the GPU: a NaN loss leaves every parameter's bits and counts the skip."""
    import fshard as fs
    model, loss_fn, batches = _model("awkward")
    state = fs.init(model, mesh, fs.adamw(**HP))
    with fs.compose(lambda mod, b: loss_fn(mod, b) * float("nan"), fs.skip_nonfinite()) as step:
        before = {n: t.clone() for n, t in fs.full_params(state).items()}
        after, m = step(state, batches[0])
    full = fs.full_params(after)
    return int(after.skipped), all(torch.equal(full[n], before[n]) for n in before)


@pytest.mark.parametrize("mesh", MESHES)
def test_skip_nonfinite_and_a_checkpoint_round_trip_on_the_gpu(mesh, tmp_path):
    same, (skipped, unchanged), on_gpu = _on_mesh(mesh, _skip_and_resume, str(tmp_path))
    assert on_gpu
    assert same, "a state loaded from its checkpoint trained differently from the state itself"
    assert skipped == 1 and unchanged, f"NaN step: skipped {skipped}, parameters unchanged: {unchanged}"


def _memory(mesh, at_base=None):
    """Peak GPU memory of a step with the moments on the GPU and with them in pinned host memory; ``at_base(k)``
    is called where each configuration's resident bytes are read (benchmarks/gpu/memory43.py looks there)."""
    import fshard as fs
    from gpt import GPT, GPTConfig, loss_fn, synthetic_batches
    cfg = GPTConfig(vocab=4096, dim=512, n_layers=4, n_heads=8, seq=64)
    peaks, moments = {}, 0
    for k in ("gpu", "host"):
        gc.collect()  # (what an earlier test in this process, or the run before, left is let go first: session 50
        torch.cuda.empty_cache()  # saw a run in another order read 71 MB less difference than the moments)
        torch.manual_seed(0)
        state = fs.init(GPT(cfg), mesh, fs.adamw(**HP))
        moments = sum(2 * s.exp_avg.nbytes for s in state.opt_state.values())
        ts = (fs.offload_state(fs.CPUStore()),) if k == "host" else ()
        with fs.compose(loss_fn, *ts) as step:
            for b in synthetic_batches(cfg, 2, 3, seed=0):
                state, _ = step(state, _cuda(b))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if at_base is not None:
                at_base(k)
            state, _ = step(state, _cuda(next(iter(synthetic_batches(cfg, 2, 1, seed=1)))))
            torch.cuda.synchronize()
            peaks[k] = (base, torch.cuda.max_memory_allocated())
        del state
    return peaks, moments


def test_offload_frees_the_moments_from_gpu_memory():
    """The measured claim behind offload on a GPU: with the moments in the store, the GPU holds their bytes less,
    before the step and at its peak."""
    peaks, moments = _on_mesh("local", _memory)
    (gb, gp), (hb, hp) = peaks["gpu"], peaks["host"]
    assert gb - hb >= 0.95 * moments, f"resident: {gb} (moments on the GPU) vs {hb} offloaded; moments {moments}"
    assert gp - hp >= 0.5 * moments, f"peak: {gp} vs {hp}; moments {moments}"


def _profile(mesh):
    import fshard as fs
    from torch.profiler import ProfilerActivity, profile, record_function
    model, loss_fn, batches = _model("gpt")
    state = fs.init(model, mesh, fs.adamw(**HP))
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(0.002), fs.mixed_precision()) as step:
        state, _ = step(state, batches[0])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for b in batches[1:3]:
                with record_function("fshard_step"):
                    state, _ = step(state, b)
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU  # the range appears on the GPU's timeline too
    steps = [e.time_range for e in events if e.name == "fshard_step" and e.device_type == cpu]
    inside = [e.name for e in events if any(r.start <= e.time_range.start <= r.end for r in steps)]
    return len(steps), inside.count("cudaDeviceSynchronize"), [e.name for e in events].count("cudaDeviceSynchronize")


def test_a_step_never_synchronizes_the_device():
    """No cudaDeviceSynchronize inside a step (the profiler itself may make one when it starts or stops)."""
    steps, inside, anywhere = _on_mesh("nccl", _profile)
    assert steps == 2 and inside == 0, f"{inside} cudaDeviceSynchronize calls in {steps} steps ({anywhere} in all)"


def test_the_store_pool_pins_every_buffer_it_maps_again():
    """NVMeStore's buffers are pinned with cudaHostRegister. A mapping freed without unregistering kept its range
    registered, so the next mapping at that address failed to register and the next CUDA call raised
    cudaErrorHostMemoryAlreadyRegistered (seen on an H100). Map, pin and free the same sizes many times."""
    import gc

    from fshard.store._pool import AlignedBuffer
    for size in (4096, 1 << 20, 4 << 20):
        for _ in range(20):
            buf = AlignedBuffer(size)
            assert buf.pinned, f"a {size}-byte buffer at {buf.address:#x} was not pinned"
            del buf
            gc.collect()
    assert (torch.ones(4, device="cuda") + 1).sum().item() == 8.0  # no error left behind for the next CUDA call


# --- one rank moves nothing (issue #42) ---

def _one_rank_counts(mesh):
    """Aten ops of one donated step (the H100 benchmark's transforms), counted with a dispatch mode: calls of
    copy_ (gathers, reductions, bucket copies), cat, and the bytes of casts; with the units' sizes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import fshard as fs

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls, self.cast_bytes = {}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "_to_copy" and out.dtype != args[0].dtype:  # a cast (not a read to the host)
                self.cast_bytes += out.numel() * out.element_size()
            return out

    model, loss_fn, batches = _model("gpt")
    # impl="torch": its update writes each unit's bf16 copy with one copy_ (the native kernel writes it in its pass)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(0.002), fs.mixed_precision(),
                    donate=True) as step:
        for b in batches[:2]:
            state, _ = step(state, b)
        with Count() as c:
            state, _ = step(state, batches[2])
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
    trainable = [u for u in state.spec.units if u.trainable]
    params = sum(1 for p in model.parameters() if p.requires_grad)
    return c.calls, c.cast_bytes, params, sum(u.numel * 4 for u in trainable)


@pytest.mark.parametrize("mesh", MESHES)
def test_one_rank_makes_no_copy_on_the_gpu(mesh):
    """At world size 1 (no process group, or a one-rank NCCL group) a step gathers nothing (the buffers are the
    state's bf16 copies), reduces nothing (each parameter's gradient is its own slot of the unit's gradient shard,
    fshard/state/_slot_grad.py) and fills no bucket: the only copy_ of a step is the update's write of each
    parameter's bf16 copy (impl="torch" updates one parameter a run); no cat assembles a flat gradient (the CPU
    counterpart: tests/test_one_rank.py), and each gradient is cast to fp32 once."""
    calls, cast_bytes, params, fp32_grad_bytes = _on_mesh(mesh, _one_rank_counts)
    assert calls.get("copy_", 0) == calls.get("addcdiv_", 0) == params, calls
    assert calls.get("cat", 0) == 0, calls
    assert cast_bytes == fp32_grad_bytes, (cast_bytes, fp32_grad_bytes)


# --- fs.init(offload=) from the GPU: each stored byte written once (init speed) ---

@pytest.mark.parametrize("pin", [False, True])
def test_init_into_a_store_from_the_gpu_holds_the_bits_of_init_on_the_gpu(pin):
    """fs.init on a CUDA mesh with offload_state(CPUStore(pin=...), params=True, items of 256 elements): each
    parameter shard goes into the store item by item straight from the GPU (no host copy of the whole shard), the
    moments' rows straight into their items (CPUStore.put_stacked); read back, every shard and moment is the bits
    fs.init keeps on the GPU without offload."""
    import fshard as fs
    from gpt import GPT, GPTConfig

    def model():
        with torch.device("meta"):
            return GPT(GPTConfig.tiny(n_layers=2))

    mesh, opt = fs.Mesh.local("cuda"), fs.adamw(lr=1e-3, weight_decay=0.1)
    ref = fs.init(model(), mesh, opt, seed=0)
    off = fs.offload_state(fs.CPUStore(pin=pin), chunk_mb=256 * 4 / 2**20, params=True)
    state = fs.init(model(), mesh, opt, seed=0, offload=off)
    for name, p in ref.params.items():
        assert p.is_cuda and isinstance(state.params[name], fs.state.StoredParam)
        assert torch.equal(state.params[name].load().view(torch.uint8), p.cpu().view(torch.uint8)), name
        for r, s in zip(ref.opt_state[name].rows, state.opt_state[name].rows):
            assert torch.equal(s.load().view(torch.uint8), r.cpu().view(torch.uint8)), name
