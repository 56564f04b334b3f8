"""fshard.ops.adamw_ against torch's AdamW (shapes, dtypes, modes, non-finite grads, slices, errors), and sq_norm."""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fshard.ops as ops

RTOL, ATOL = 1e-6, 1e-9  # <= 1e-6 relative; ATOL only guards exact zeros
HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
EDGE = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 257, 1023, 1025, 2047, 2049, 4097]
SIZES = st.lists(st.one_of(st.sampled_from(EDGE), st.integers(0, 3000)), min_size=0, max_size=6)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def native():
    if not ops.native_available():
        pytest.skip(f"native ops unavailable: {ops.backend_info()['error']}")
    return ops.load()


@pytest.fixture(scope="module", params=["avx512", "avx2", "scalar"])
def isa(request, native):
    """Each CPU kernel this CPU runs; the others skip with the reason."""
    if request.param not in native.cpu_isas():
        pytest.skip(f"this CPU does not run the {request.param} kernel (it runs {native.cpu_isas()})")
    return request.param


def make_state(sizes, seed, gdtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=gen) for n in sizes]
    m = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    v = [torch.rand(n, generator=gen) * 0.01 for n in sizes]
    g = [torch.randn(n, generator=gen).to(gdtype) for n in sizes]
    return p, g, m, v


def clone(ts):
    return [t.clone() for t in ts]


def assert_all_close(actual, expected):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)


def torch_optim_steps(p0, grads_per_step, adam_w_mode, grad_scale=1.0):
    """Run torch.optim.AdamW / Adam (fused=True) over the given grads; returns params, m, v."""
    params = [torch.nn.Parameter(t.clone()) for t in p0]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = cls(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=HP["weight_decay"], fused=True)
    for grads in grads_per_step:
        for prm, g in zip(params, grads):
            prm.grad = g.float() * torch.tensor(grad_scale, dtype=torch.float32)
        opt.step()
    st_ = [opt.state[prm] for prm in params]
    return ([prm.detach() for prm in params], [s["exp_avg"] for s in st_], [s["exp_avg_sq"] for s in st_])


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
@SETTINGS
@given(sizes=SIZES, seed=st.integers(0, 2**31 - 1), grad_scale=st.sampled_from([1.0, 0.5, 0.37, 3.0]))
def test_matches_torch_optim_over_steps(native, isa, adam_w_mode, gdtype, sizes, seed, grad_scale):
    sizes = [s for s in sizes if s > 0] or [1]  # torch.optim rejects nothing, but its state needs a param
    p, _, _, _ = make_state(sizes, seed)
    grads = [make_state(sizes, seed + k + 1, gdtype)[1] for k in range(3)]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for step, g in enumerate(grads, start=1):
        found = ops.adamw_(p, g, m, v, step=step, grad_scale=grad_scale, adam_w_mode=adam_w_mode,
                           isa=isa, **HP)
        assert found is False
    ep, em, ev = torch_optim_steps(make_state(sizes, seed)[0], grads, adam_w_mode, grad_scale)
    assert_all_close(p, ep)
    assert_all_close(m, em)
    assert_all_close(v, ev)


@SETTINGS
@given(sizes=SIZES, seed=st.integers(0, 2**31 - 1), step=st.integers(1, 10_000),
       copy_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       gdtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_fused_adamw_and_param_copies(native, isa, sizes, seed, step, copy_dtype, gdtype):
    p, g, m, v = make_state(sizes, seed, gdtype)
    copies = [torch.full((n,), 7.0, dtype=copy_dtype) for n in sizes]
    rp, rm, rv = clone(p), clone(m), clone(v)
    found = ops.adamw_(p, g, m, v, step=step, grad_scale=0.25, param_copies=copies,
                       isa=isa, **HP)
    assert found is False
    keep = [i for i, n in enumerate(sizes) if n]
    if keep:
        g32 = [g[i].float() * 0.25 for i in keep]
        torch._fused_adamw_([rp[i] for i in keep], g32, [rm[i] for i in keep], [rv[i] for i in keep], [],
                            [torch.tensor(float(step)) for _ in keep], amsgrad=False, maximize=False, **HP)
    assert_all_close(p, rp)
    assert_all_close(m, rm)
    assert_all_close(v, rv)
    for c, prm in zip(copies, p):  # the copy is exactly torch's rounding of the new param
        assert torch.equal(c, prm.to(copy_dtype))


@SETTINGS
@given(sizes=st.lists(st.one_of(st.sampled_from(EDGE[1:]), st.integers(1, 3000)), min_size=1, max_size=5),
       seed=st.integers(0, 2**31 - 1), data=st.data(),
       bad=st.sampled_from([float("inf"), float("-inf"), float("nan")]),
       gdtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_nonfinite_grad_updates_nothing(native, isa, sizes, seed, data, bad, gdtype):
    p, g, m, v = make_state(sizes, seed, gdtype)
    t = data.draw(st.integers(0, len(sizes) - 1))
    g[t][data.draw(st.integers(0, sizes[t] - 1))] = bad
    copies = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    before = clone(p) + clone(m) + clone(v) + clone(copies)
    assert ops.adamw_(p, g, m, v, step=5, param_copies=copies, isa=isa, **HP) is True
    for a, b in zip(p + m + v + copies, before):
        assert torch.equal(a, b)


def same_bits(a, b):
    """Bit for bit, except that any NaN equals any NaN: payloads are not part of the contract (torch's own
    float->bf16 gives 0xffff in its vector path and 0x7fc0 in its scalar one)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ia, ib = (t.view(torch.int32 if t.dtype == torch.float32 else torch.int16) for t in (a, b))
    return torch.equal(ia[~nan], ib[~nan])


@SETTINGS
@given(sizes=SIZES, seed=st.integers(0, 2**31 - 1), step=st.integers(1, 10_000),
       adam_w_mode=st.booleans(), grad_scale=st.sampled_from([1.0, 0.37, 3.0]),
       gdtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       copy_dtype=st.sampled_from([None, torch.bfloat16, torch.float16]),
       lr=st.sampled_from([1e-3, 0.0]),  # lr 0 keeps the odd params below as they are, into the copies
       specials=st.lists(st.sampled_from([0.0, -0.0, 1e-40, -3e-39, 1e38, float("inf"), float("nan"),
                                          0x7FA00000, 0x7FFFFFFF, 0xFF812345 - (1 << 32)]), max_size=4))
def test_every_cpu_kernel_gives_the_same_bits(native, sizes, seed, step, adam_w_mode, grad_scale, gdtype,
                                              copy_dtype, lr, specials):
    """AVX-512, AVX2 and scalar run one IEEE sequence per element: identical bits, NaN (with payloads)
    and denormal params and their bf16/fp16 copies included, at every length and tail."""
    p, g, m, v = make_state(sizes, seed, gdtype)
    for k, x in enumerate(specials):  # odd params the check does not look at; ints are NaN bit patterns
        t = p[k % len(p)] if p else torch.empty(0)
        if t.numel():
            t.view(torch.int32)[(7 * k) % t.numel()] = x if isinstance(x, int) else torch.tensor(x).view(torch.int32)
    results = {}
    for name in native.cpu_isas():
        state = [clone(p), clone(g), clone(m), clone(v)]
        copies = [torch.zeros(n, dtype=copy_dtype) for n in sizes] if copy_dtype else None
        assert ops.adamw_(*state, step=step, grad_scale=grad_scale, adam_w_mode=adam_w_mode,
                          param_copies=copies, isa=name, **dict(HP, lr=lr)) is False
        results[name] = state[0] + state[2] + state[3] + (copies or [])
    first, *rest = results
    for name in rest:
        for a, b in zip(results[first], results[name]):
            assert same_bits(a, b), f"{name} differs from {first}"
    if copy_dtype:  # and each copy is torch's own rounding of the param, bit for bit
        n = len(sizes)
        for c, prm in zip(results[first][3 * n:], results[first][:n]):
            assert same_bits(c, prm.to(copy_dtype))


def test_isa_choice_is_checked_and_the_env_caps_it(native, monkeypatch):
    p, g, m, v = make_state([40], 2)
    before = clone(p)
    with pytest.raises(ValueError, match="unknown CPU kernel isa='sse4'"):
        ops.adamw_(p, g, m, v, step=1, isa="sse4", **HP)
    if "avx512" not in native.cpu_isas():
        with pytest.raises(ValueError, match="runs at most"):
            ops.adamw_(p, g, m, v, step=1, isa="avx512", **HP)
    assert torch.equal(p[0], before[0])
    monkeypatch.setattr(ops, "_cap", "scalar")  # what load() took from FSHARD_OPS_CPU_ISA=scalar
    assert ops.backend_info()["cpu_isa"] == "scalar"
    calls = []
    monkeypatch.setattr(ops, "_lib", type("Spy", (), {  # what adamw_ hands the kernel under the cap
        "cpu_isas": native.cpu_isas, "adamw": lambda *a: calls.append(a[-1]) or False})())
    ops.adamw_(p, g, m, v, step=1, **HP)
    ops.adamw_(p, g, m, v, step=1, isa="auto", **HP)
    ops.adamw_(p, g, m, v, step=1, isa="avx2", **HP)  # an explicit choice is not capped
    assert calls == ["scalar", "scalar", "avx2"]


def _read_cap(cap):
    """The kernel a process runs under FSHARD_OPS_CPU_ISA=cap (set before it loads them): what backend_info says at
    the first use and after the variable changes mid-run, and the CPU's best; or the error of a bad value."""
    os.environ["FSHARD_OPS_CPU_ISA"] = cap
    try:
        first = ops.backend_info()["cpu_isa"]
    except ValueError as e:
        return f"error: {e}"
    os.environ["FSHARD_OPS_CPU_ISA"] = "scalar"  # changed mid-run: the running job keeps its kernel
    return first, ops.backend_info()["cpu_isa"], ops.cpu_isas()[-1]


def test_the_isa_cap_is_read_once_when_the_kernels_load(native):
    """Each cap in a process of its own that has not loaded the kernels: forked from one interpreter that imported
    fshard.ops (tests/_proc.py ``forked``), as a fresh job would load them."""
    from _proc import forked
    caps = ["scalar", "avx512", "neon"]
    got = dict(zip(caps, (r for r, in forked(_read_cap, [({}, (cap,)) for cap in caps]))))
    assert "FSHARD_OPS_CPU_ISA='neon'" in got["neon"]  # a bad value is an fshard error naming the variable
    for cap in ("scalar", "avx512"):
        first, later, best = got[cap]
        assert later == first  # read once
        assert first == ("scalar" if cap == "scalar" else best)  # a cap above the CPU's best is no error


def test_grad_scale_overflow_counts_as_nonfinite(native):
    p, g, m, v = make_state([100], 0)
    g[0][3] = 1e30
    before = clone(p)
    assert ops.adamw_(p, g, m, v, step=1, grad_scale=1e10, **HP) is True  # 1e40 overflows fp32
    assert torch.equal(p[0], before[0])
    assert ops.adamw_(p, g, m, v, step=1, grad_scale=1e-10, **HP) is False


def test_check_finite_false_skips_the_check(native):
    p, g, m, v = make_state([64], 1)
    g[0][0] = float("inf")
    assert ops.adamw_(p, g, m, v, step=1, check_finite=False, **HP) is False
    assert not torch.isfinite(p[0][0])  # the caller asked for no check and got the raw update


def test_large_multithreaded_slices_of_flat_buffer(native, isa):
    """Unaligned 1-D views into one flat shard, spanning many blocks and both threads."""
    sizes = [1, 130_001, 3, 70_000, 4097, 0, 99_999]
    total = sum(sizes) + 2 * len(sizes) + 1
    gen = torch.Generator().manual_seed(3)
    flat = {k: torch.randn(total, generator=gen) for k in ("p", "m")}
    flat["v"] = torch.rand(total, generator=gen)
    flat["g"] = torch.randn(total, generator=gen).bfloat16()
    flat["c"] = torch.zeros(total, dtype=torch.bfloat16)
    ref = {k: t.clone() for k, t in flat.items()}
    views, off = {k: [] for k in flat}, 1
    for n in sizes:
        for k in flat:
            views[k].append(flat[k][off:off + n])
        off += n + 2  # gaps of 2 elements must stay untouched
    assert ops.adamw_(views["p"], views["g"], views["m"], views["v"], step=7, param_copies=views["c"],
                      isa=isa, **HP) is False
    rv = {k: [] for k in ref}
    off = 1
    for n in sizes:
        for k in ref:
            rv[k].append(ref[k][off:off + n])
        off += n + 2
    ops.adamw_reference_(rv["p"], rv["g"], rv["m"], rv["v"], step=7, param_copies=rv["c"], **HP)
    for k in ("p", "m", "v"):
        torch.testing.assert_close(flat[k], ref[k], rtol=RTOL, atol=ATOL)
    assert torch.equal(flat["c"], ref["c"])  # also checks the untouched gaps


def test_empty_inputs(native):
    assert ops.adamw_([], [], [], [], step=1, **HP) is False
    e = torch.empty(0)
    assert ops.adamw_(e, e.clone(), e.clone(), e.clone(), step=1, **HP) is False
    p, g, m, v = make_state([5], 0)  # a single tensor is a 1-list
    rp = p[0].clone()
    assert ops.adamw_(p[0], g[0], m[0], v[0], step=1, **HP) is False
    assert not torch.equal(p[0], rp)


@pytest.mark.parametrize("case, exc, needle", [
    ("len", ValueError, "same length"),
    ("numel", ValueError, "grads[1] has"),
    ("pdtype", TypeError, "exp_avgs[0] must be float32"),
    ("gdtype", TypeError, "grads[0] has dtype"),
    ("copy_dtype", TypeError, "param_copies[1] has dtype"),
    ("copies_len", ValueError, "param_copies has 1 tensors"),
    ("noncontig", ValueError, "params[1] is not contiguous"),
    ("device", ValueError, "exp_avg_sqs[0] is on meta"),
    ("step", ValueError, "step must be >= 1"),
])
def test_errors_name_the_argument(native, case, exc, needle):
    p, g, m, v = make_state([6, 6], 0)
    kw = dict(HP, step=1)
    copies = None
    if case == "len":
        g = g[:1]
    elif case == "numel":
        g[1] = torch.randn(5)
    elif case == "pdtype":
        m[0] = m[0].double()
    elif case == "gdtype":
        g[0] = g[0].double()
    elif case == "copy_dtype":
        copies = [torch.zeros(6, dtype=torch.bfloat16), torch.zeros(6)]
    elif case == "copies_len":
        copies = [torch.zeros(6, dtype=torch.bfloat16)]
    elif case == "noncontig":
        p[1] = torch.randn(12)[::2]
    elif case == "device":
        v[0] = torch.empty(6, device="meta")
    elif case == "step":
        kw["step"] = 0
    before = clone(p)
    with pytest.raises(exc, match=needle.replace("[", r"\[").replace("]", r"\]")):
        ops.adamw_(p, g, m, v, param_copies=copies, **kw)
    for a, b in zip(p, before):
        assert torch.equal(a, b)


def test_reference_matches_torch_optim():
    sizes = [1, 17, 300]
    p, _, m, v = make_state(sizes, 9)
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    grads = [make_state(sizes, 10 + k, torch.bfloat16)[1] for k in range(2)]
    for step, g in enumerate(grads, start=1):
        assert ops.adamw_reference_(p, g, m, v, step=step, grad_scale=0.5, **HP) is False
    ep, em, ev = torch_optim_steps(make_state(sizes, 9)[0], grads, True, 0.5)
    assert_all_close(p + m + v, ep + em + ev)
    g = clone(grads[0])
    g[1][3] = float("nan")
    before = clone(p)
    assert ops.adamw_reference_(p, g, m, v, step=3, **HP) is True
    assert all(torch.equal(a, b) for a, b in zip(p, before))


def test_missing_compiler_is_named_and_fallback_warns_once(monkeypatch):
    from fshard.ops import _build

    monkeypatch.setenv("CXX", "no-such-cxx-fshard")
    with pytest.raises(_build.BuildError, match="no-such-cxx-fshard"):
        _build.check_toolchain()

    err = _build.BuildError("fshard.ops: C++ compiler 'no-such-cxx-fshard' not found")
    monkeypatch.setattr(ops, "_lib", None)
    monkeypatch.setattr(ops, "_error", err)
    monkeypatch.setattr(ops, "_warned", False)
    monkeypatch.delenv("FSHARD_OPS_REQUIRE_NATIVE", raising=False)
    before = ops.metrics()["fallback_calls"]
    p, g, m, v = make_state([10], 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ops.adamw_(p, g, m, v, step=1, **HP)
        ops.adamw_(p, g, m, v, step=2, **HP)
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "no-such-cxx-fshard" in msgs[0] and "falling back" in msgs[0]
    assert ops.metrics()["fallback_calls"] == before + 2
    assert ops.backend_info()["backend"] == "reference"
    monkeypatch.setenv("FSHARD_OPS_REQUIRE_NATIVE", "1")
    with pytest.raises(_build.BuildError, match="no-such-cxx-fshard"):
        ops.adamw_(p, g, m, v, step=3, **HP)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA kernel is compile-checked only")
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ctype", [torch.bfloat16, torch.float16])
def test_cuda_is_bitwise_the_cpu_kernel(native, gdtype, ctype):
    """The CUDA kernel (vector body and scalar loop) computes the CPU kernel's bits, which are ATen's fused Adam's:
    the same operations in the same order, each rounded once. Slices at an odd offset take the scalar loop."""
    assert native.built_with_cuda(), "CUDA is available but fshard.ops was built without the .cu"
    sizes = [0, 1, 1025, 65_537, 3, 1_000_003, 262_147]
    p, g, m, v = make_state(sizes, 4, gdtype)
    copies = [torch.zeros(t.numel(), dtype=ctype) for t in p]
    dev = [[t.cuda() for t in ts] for ts in (p, g, m, v, copies)]
    for ts in dev:  # the last tensor of each list one element past an aligned start
        ts[-1] = torch.empty(ts[-1].numel() + 1, dtype=ts[-1].dtype, device="cuda")[1:].copy_(ts[-1])
    for s in (3, 4):
        assert ops.adamw_(*dev[:4], step=s, grad_scale=0.5, param_copies=dev[4], **HP) is False
        assert ops.adamw_(p, g, m, v, step=s, grad_scale=0.5, param_copies=copies, isa="scalar", **HP) is False
    for got, want in zip(dev, (p, g, m, v, copies)):
        for k, (a, e) in enumerate(zip(got, want)):
            assert torch.equal(a.cpu(), e), f"tensor {k} of {sizes[k]}: {(a.cpu() != e).sum()} elements differ"
    dev[1][5][17] = float("inf")
    before = [t.clone() for t in dev[0]]
    assert ops.adamw_(*dev[:4], step=5, **HP) is True
    assert all(torch.equal(a, b) for a, b in zip(dev[0], before))


# ---- fshard.ops.sq_norm: the sum of squares over gradient shards --------------------------------------------------

def sq_ref(ts) -> float:
    """float64 reference: each element widened exactly, squared exactly, summed by torch in float64."""
    ts = [ts] if isinstance(ts, torch.Tensor) else ts
    return float(sum((t.double().reshape(-1) ** 2).sum().item() for t in ts))


def sq_bits(x: float) -> int:
    return torch.tensor(x, dtype=torch.float64).view(torch.int64).item()


def sq_every_way(native, ts) -> dict:
    """sq_norm of ts with every CPU kernel, under 1 and 2 torch threads (the count is restored)."""
    threads = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for name in native.cpu_isas():
                out[name, n] = ops.sq_norm(ts, isa=name)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("sizes", [[0], [1], [7], [63], [1_000_003], [5, 0, 63, 131_073, 1, 70_000]],
                         ids=["0", "1", "7", "63", "1000003", "several"])
def test_sq_norm_matches_float64_reference(native, isa, sizes, dtype):
    gen = torch.Generator().manual_seed(sum(sizes) + 1)
    ts = [(torch.randn(n, generator=gen) * 3).to(dtype) for n in sizes]
    got = ops.sq_norm(ts, isa=isa)
    assert isinstance(got, float)
    want = sq_ref(ts)
    assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    assert ops.sq_norm_reference(ts) == pytest.approx(want, rel=1e-12, abs=0.0)
    if len(ts) == 1:  # one tensor is a 1-list
        assert ops.sq_norm(ts[0], isa=isa) == got


def test_sq_norm_empty(native):
    assert ops.sq_norm([]) == 0.0
    assert ops.sq_norm(torch.empty(0)) == 0.0
    assert ops.sq_norm([torch.empty(0), torch.empty(0, 3, dtype=torch.bfloat16)]) == 0.0
    assert ops.sq_norm_reference([]) == 0.0


def test_sq_norm_same_bits_for_every_kernel_and_thread_count_large(native):
    """Several tasks per tensor and tensors that end mid-task, so both threads take part."""
    gen = torch.Generator().manual_seed(11)
    ts = [torch.randn(n, generator=gen) for n in (200_003, 1, 65_536, 65_537, 131_071)]
    ts.append(torch.randn(99_999, generator=gen).bfloat16())
    ts.append(torch.randn(77_777, generator=gen).half())
    got = sq_every_way(native, ts)
    assert len({sq_bits(v) for v in got.values()}) == 1, got
    assert next(iter(got.values())) == pytest.approx(sq_ref(ts), rel=1e-12, abs=0.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.one_of(st.sampled_from(EDGE), st.integers(0, 3000), st.integers(60_000, 140_000)),
                      min_size=1, max_size=4),
       seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1.0, 1e-20, 1e20]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       offset=st.integers(0, 5))
def test_sq_norm_bit_identical_across_kernels_and_threads(native, sizes, seed, scale, dtype, offset):
    """Every CPU kernel and 1 or 2 threads give the same bits, for any lengths, tails and (unaligned) slices."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes) + offset
    # Magnitudes over several decades, so that adding in another order or grouping changes the rounding.
    x = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    flat = (x * (scale if dtype == torch.float32 else 1.0)).to(dtype)
    ts, off = [], offset
    for n in sizes:
        ts.append(flat[off:off + n])
        off += n
    got = sq_every_way(native, ts)
    assert len({sq_bits(v) for v in got.values()}) == 1, got
    want = sq_ref(ts)
    assert next(iter(got.values())) == pytest.approx(want, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_sq_norm_nonfinite_element_makes_it_nonfinite(native, isa, dtype, where, bad):
    gen = torch.Generator().manual_seed(5)
    ts = [torch.randn(n, generator=gen).to(dtype) for n in (1000, 131_075, 33)]
    t, i = {"first": (0, 0), "middle": (1, 70_001), "last": (2, 32)}[where]
    ts[t][i] = bad
    got = ops.sq_norm(ts, isa=isa)
    assert not math.isfinite(got)
    assert math.isnan(got) if math.isnan(bad) else got == float("inf")
    assert not math.isfinite(ops.sq_norm_reference(ts))
    ts[t][i] = 0.0
    assert math.isfinite(ops.sq_norm(ts, isa=isa))


def test_sq_norm_large_finite_values_stay_finite(native, isa):
    t = torch.full((1001,), 1e30)
    t[7] = torch.finfo(torch.float32).max
    got = ops.sq_norm(t, isa=isa)
    assert math.isfinite(got)
    assert got == pytest.approx(1000 * 1e60 + torch.finfo(torch.float32).max ** 2, rel=1e-6)


def test_sq_norm_errors_and_isa(native, monkeypatch):
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.float64"):
        ops.sq_norm([torch.ones(3), torch.ones(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"tensors\[0\] is not contiguous"):
        ops.sq_norm([torch.ones(8)[::2]])
    with pytest.raises(ValueError, match="sq_norm: unknown CPU kernel isa='sse4'"):
        ops.sq_norm(torch.ones(3), isa="sse4")
    with pytest.raises(TypeError, match="tensors must be a Tensor or a list"):
        ops.sq_norm(3.0)
    calls = []
    monkeypatch.setattr(ops, "_cap", "scalar")
    monkeypatch.setattr(ops, "_lib", type("Spy", (), {
        "cpu_isas": native.cpu_isas, "sq_norm": staticmethod(lambda ts, isa: calls.append(isa) or 0.0)})())
    ops.sq_norm(torch.ones(3))
    ops.sq_norm(torch.ones(3), isa="avx2")  # an explicit choice is not capped
    assert calls == ["scalar", "avx2"]


def test_sq_norm_falls_back_to_torch_without_a_build(monkeypatch):
    from fshard.ops import _build

    monkeypatch.setattr(ops, "_lib", None)
    monkeypatch.setattr(ops, "_error", _build.BuildError("fshard.ops: C++ compiler 'no-such-cxx' not found"))
    monkeypatch.setattr(ops, "_warned", False)
    monkeypatch.delenv("FSHARD_OPS_REQUIRE_NATIVE", raising=False)
    ts = [torch.randn(100), torch.randn(7).bfloat16()]
    before = ops.metrics()["sq_norm_fallback_calls"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert ops.sq_norm(ts) == pytest.approx(sq_ref(ts), rel=1e-12)
        ops.sq_norm(ts)
    assert len([x for x in w if issubclass(x.category, RuntimeWarning)]) == 1
    assert ops.metrics()["sq_norm_fallback_calls"] == before + 2
    monkeypatch.setenv("FSHARD_OPS_REQUIRE_NATIVE", "1")
    with pytest.raises(_build.BuildError, match="no-such-cxx"):
        ops.sq_norm(ts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_sq_norm_cuda_goes_to_torch():
    ts = [torch.randn(1000).cuda(), torch.randn(33).cuda().bfloat16()]
    assert ops.sq_norm(ts) == pytest.approx(sq_ref([t.cpu() for t in ts]), rel=1e-12)
    ts[0][5] = float("inf")
    assert ops.sq_norm(ts) == float("inf")


@SETTINGS
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6), gap=st.integers(0, 40),
       gdtype=st.sampled_from([torch.float32, torch.bfloat16]), copy=st.booleans())
def test_offsets_into_whole_tensors_are_bitwise_the_views(native, sizes, gap, gdtype, copy):
    """adamw_(..., offsets=): runs given as offsets into a unit's whole flat tensors update exactly what the same
    runs given as views do (fs.adamw's unit update hands them so: no view a run), elements outside them untouched."""
    starts, pos = [], 0
    for n in sizes:
        pos += gap
        starts.append(pos)
        pos += n
    total = pos + gap
    p, _, m, v = make_state([total], 7)
    g = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(gdtype) for n in sizes]
    c = [torch.zeros(total, dtype=torch.bfloat16)] if copy else []
    ref = [clone(x) for x in (p, m, v, c)]
    views = lambda t: [t[0][a:a + n] for a, n in zip(starts, sizes)]  # noqa: E731
    ops.adamw_(views(ref[0]), g, views(ref[1]), views(ref[2]), step=3, param_copies=views(ref[3]) if copy else None,
               check_finite=False, **HP)
    k = len(sizes)
    ops.adamw_(p * k, g, m * k, v * k, step=3, param_copies=c * k if copy else None, check_finite=False,
               offsets=starts, **HP)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v + c, ref[0] + ref[1] + ref[2] + ref[3]))


def test_offsets_are_checked_against_the_tensors(native):
    p, g, m, v = make_state([10], 1)
    with pytest.raises(ValueError, match=r"params\[0\] has 10 elements, too few for offsets\[0\] = 5"):
        ops.adamw_(p, g, m, v, step=1, offsets=[5], **HP)
    for bad in ([0, 0], []):
        with pytest.raises(ValueError, match=f"offsets has {len(bad)} entries but grads has 1"):
            ops.adamw_(p, g, m, v, step=1, offsets=bad, **HP)


def test_offsets_without_the_native_kernel_are_the_reference_on_views(monkeypatch):
    """The fallback (no native build) takes the same flat elements through views, and checks them alike."""
    p, g, m, v = make_state([30], 2)
    g = [g[0][:7], g[0][7:12]]
    ref = [clone(x) for x in (p, m, v)]
    monkeypatch.setattr(ops, "_native", lambda: None)
    with warnings.catch_warnings():  # (the fallback's warning, once a process)
        warnings.simplefilter("ignore")
        ops.adamw_(p * 2, g, m * 2, v * 2, step=2, offsets=[3, 20], check_finite=False, **HP)
        ops.adamw_([ref[0][0][3:10], ref[0][0][20:25]], g, [ref[1][0][3:10], ref[1][0][20:25]],
                   [ref[2][0][3:10], ref[2][0][20:25]], step=2, check_finite=False, **HP)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, ref[0] + ref[1] + ref[2]))
    with pytest.raises(ValueError, match=r"params\[0\] has 30 elements, too few for offsets\[0\] = -1"):
        ops.adamw_(p, g[:1], m, v, step=1, offsets=[-1], **HP)
