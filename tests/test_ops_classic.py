"""fshard.ops' single-tensor kernels (ops/classic*.cpp: ``adam_``, ``sgd_``, ``adagrad_``), the defaults of
fs.optim.adam, sgd and adagrad (issue #40).

- Bitwise torch.optim.Adam / SGD / Adagrad (``foreach=False``: the single-tensor arithmetic torch runs on the CPU by
  default) over several steps, on every CPU kernel this CPU runs, with the run cut at arbitrary points (as flat
  shards and offload chunks cut a parameter): hypothesis over lengths (primes, vector-width edges), cuts and
  hyperparameters (both of ATen's lerp formulas, L2 decay, AMSGrad, momentum, dampening, Nesterov, maximize,
  lr_decay), zeros in the gradient (sqrt(0)); one long run on torch's thread pool; inf and NaN as torch has them.
- The sqrt is torch's (MKL's vmsSqrt where torch is built with MKL); "auto" resolves as documented (torch's fused
  kernel on the CPU, torch's ops elsewhere); an explicit "native"
  that cannot run is named; the FSHARD_OPS_CPU_ISA cap reaches these kernels.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fshard as fs
import fshard.ops as ops

EDGE = [1, 2, 7, 8, 15, 16, 17, 31, 97, 127, 257, 2039, 2048, 2053, 4099]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
O = torch.optim


@pytest.fixture(scope="module")
def native():
    if not ops.native_available():
        pytest.skip(f"native ops unavailable: {ops.backend_info()['error']}")
    return ops.load()


def _data(n, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    gs = [torch.randn(n, generator=gen) for _ in range(steps)]
    for g in gs[:1]:
        g[:: 5] = 0.0  # sqrt(0) in the first step's second moment
    return p, gs


def _torch_run(cls, kw, p, gs):
    """torch's single-tensor step on the whole tensor: the parameter and its state after each step."""
    t = p.clone().requires_grad_()
    opt = cls([t], foreach=False, **kw)
    for g in gs:
        t.grad = g.clone()
        opt.step()
    return t.detach(), opt.state[t]


def _pieces(n, cuts):
    edges = sorted({0, n, *(c % (n + 1) for c in cuts)})
    return list(zip(edges, edges[1:]))


def _ours(kind, kw, p, gs, cuts, isa):
    """The native kernel over the same steps, each step run piece by piece over the cuts."""
    n = p.numel()
    p = p.clone()
    if kind == "adam":
        rows = [torch.zeros(n) for _ in range(3 if kw.get("amsgrad") else 2)]
    elif kind == "sgd":
        rows = [torch.zeros(n)] if kw.get("momentum", 0) else []
    else:
        rows = [torch.full((n,), float(kw.get("initial_accumulator_value", 0.0)))]
    for step, g in enumerate(gs, 1):
        for lo, hi in _pieces(n, cuts):
            r = [x[lo:hi] for x in rows]
            if kind == "adam":
                b1, b2 = kw.get("betas", (0.9, 0.999))
                ops.adam_(p[lo:hi], g[lo:hi], *r[:2], r[2] if len(r) == 3 else None, step=float(step), lr=kw["lr"],
                          beta1=b1, beta2=b2, eps=kw.get("eps", 1e-8), weight_decay=kw.get("weight_decay", 0.0),
                          isa=isa)
            elif kind == "sgd":
                ops.sgd_(p[lo:hi], g[lo:hi], *r, first=step == 1, lr=kw["lr"], momentum=kw.get("momentum", 0.0),
                         dampening=kw.get("dampening", 0.0), weight_decay=kw.get("weight_decay", 0.0),
                         nesterov=kw.get("nesterov", False), maximize=kw.get("maximize", False), isa=isa)
            else:
                ops.adagrad_(p[lo:hi], g[lo:hi], *r, step=float(step), lr=kw["lr"], lr_decay=kw.get("lr_decay", 0.0),
                             weight_decay=kw.get("weight_decay", 0.0), eps=kw.get("eps", 1e-10),
                             maximize=kw.get("maximize", False), isa=isa)
    return p, rows


STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "sgd": ("momentum_buffer",), "adagrad": ("sum",)}
CLASSES = {"adam": O.Adam, "sgd": O.SGD, "adagrad": O.Adagrad}

HYPER = st.one_of(
    st.tuples(st.just("adam"), st.fixed_dictionaries({
        "lr": st.sampled_from([1e-3, 3e-2]), "betas": st.sampled_from([(0.9, 0.999), (0.3, 0.9), (0.5, 0.95)]),
        "weight_decay": st.sampled_from([0.0, 0.1]), "amsgrad": st.booleans(), "eps": st.sampled_from([1e-8, 1e-3])})),
    st.tuples(st.just("sgd"), st.sampled_from([
        {"lr": 0.05}, {"lr": 0.05, "maximize": True, "weight_decay": 0.01},
        {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
        {"lr": 0.01, "momentum": 0.9, "nesterov": True, "maximize": True},
        {"lr": 0.01, "momentum": 0.5, "nesterov": True, "weight_decay": 0.1}])),
    st.tuples(st.just("adagrad"), st.fixed_dictionaries({
        "lr": st.sampled_from([0.05, 1e-3]), "lr_decay": st.sampled_from([0.0, 0.01]),
        "weight_decay": st.sampled_from([0.0, 0.01]), "initial_accumulator_value": st.sampled_from([0.0, 0.1]),
        "maximize": st.booleans()})))


def _check(kind, kw, n, cuts, seed, isas, steps=3):
    p, gs = _data(n, steps, seed)
    want_p, want_state = _torch_run(CLASSES[kind], kw, p, gs)
    for isa in isas:
        got_p, rows = _ours(kind, kw, p, gs, cuts, isa)
        assert torch.equal(got_p, want_p), f"{kind} {kw} n={n} cuts={cuts} isa={isa}: param differs"
        for key, row in zip(STATE_KEYS[kind], rows):
            assert torch.equal(row, want_state[key]), f"{kind} {kw} n={n} cuts={cuts} isa={isa}: {key} differs"


@SETTINGS
@given(case=HYPER, n=st.one_of(st.sampled_from(EDGE), st.integers(1, 5000)),
       cuts=st.lists(st.integers(0, 5000), max_size=3), seed=st.integers(0, 2**16))
def test_bitwise_torch_single_tensor_on_every_kernel_and_cut(native, case, n, cuts, seed):
    kind, kw = case
    _check(kind, kw, n, cuts, seed, native.cpu_isas())


@pytest.mark.parametrize("kind, kw", [("adam", {"lr": 1e-3, "weight_decay": 0.1, "amsgrad": True}),
                                      ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
                                      ("adagrad", {"lr": 0.05, "lr_decay": 0.01})])
def test_a_long_run_on_the_thread_pool(native, kind, kw):
    """Blocks run on torch's threads; a run's bits do not depend on that split (nor on the cut)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _check(kind, kw, 200_003, [70_001], 7, [native.cpu_isas()[-1]], steps=2)
    finally:
        torch.set_num_threads(threads)


def test_the_sqrt_is_torchs(native):
    """torch's CPU float sqrt is MKL's vmsSqrt (within 1 ulp, not IEEE's) in an MKL build; the kernels use it."""
    assert native.classic_sqrt_is_mkl() == torch.backends.mkl.is_available()


def test_auto_resolves_as_documented(native, monkeypatch):
    """Torch's fused kernel on the CPU (the bitwise one-pass kernels measured slower than it: design/OPS.md), torch's
    ops anywhere else; an explicit impl is what runs, "native" where its kernel can (else torch's ops, the same
    bits)."""
    cpu = torch.device("cpu")
    for opt in (fs.optim.adam(), fs.optim.sgd(momentum=0.9), fs.optim.adagrad()):
        assert opt.impl == "auto"
        assert opt.resolved_impl(cpu) == "fused" and opt.resolved_impl(cpu, torch.bfloat16) == "fused"
        assert opt.resolved_impl(torch.device("cuda")) == "torch"
        assert type(opt)(impl="native").resolved_impl(cpu) == "native"
        assert type(opt)(impl="native").resolved_impl(torch.device("cuda")) == "torch"
        assert type(opt)(impl="native").resolved_impl(cpu, torch.bfloat16) == "torch"
        assert type(opt)(impl="torch").resolved_impl(cpu) == "torch"
    monkeypatch.setattr(ops, "native_available", lambda: False)  # no build: torch's ops, the same bits
    assert fs.optim.sgd(impl="native").resolved_impl(cpu) == "torch"


def test_a_run_the_native_kernel_cannot_take_runs_torchs_ops_and_low_precision_gradients_are_taken(native):
    p, g = torch.zeros(5), torch.ones(5, dtype=torch.bfloat16)
    want = torch.zeros(5)
    fs.optim.sgd(lr=0.1, momentum=0.9, impl="torch").apply(want, g, torch.zeros(5), 1)
    fs.optim.sgd(lr=0.1, momentum=0.9, impl="native").apply(p, g, torch.zeros(5), 1)  # (a bf16 gradient)
    assert torch.equal(p, want) and torch.equal(p, torch.full((5,), -0.1))
    for opt in (fs.optim.sgd(lr=0.1), fs.optim.adam(lr=0.1), fs.optim.adagrad(lr=0.1)):  # the defaults take it
        want, got = torch.zeros(5), torch.zeros(5)
        rows = [torch.zeros(5) for _ in opt.rows]
        type(opt)(lr=0.1, impl="torch").apply(want, g.float(), *[r.clone() for r in rows], 1)
        opt.apply(got, g, *rows, 1)  # (torch's fused kernel takes one dtype: the gradient widened first, exactly)
        assert torch.allclose(got, want, rtol=0, atol=1e-6) and got.abs().sum() > 0, (opt, got, want)
    with pytest.raises(fs.ArgumentError, match=r"impl='fast'.*\('auto', 'torch', 'fused', 'native'\)"):
        fs.optim.adagrad(impl="fast")


def test_the_isa_cap_reaches_these_kernels(native, monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "_cap", "scalar")  # what load() took from FSHARD_OPS_CPU_ISA=scalar
    monkeypatch.setattr(ops, "_lib", type("L", (), {"classic_step": lambda *a: calls.append(a[-1])})())
    p = torch.zeros(3)
    ops.sgd_(p, p.clone(), first=True, lr=0.1)
    ops.adagrad_(p, p.clone(), p.clone(), step=1.0, lr=0.1, isa="avx2")  # an explicit choice is not capped
    assert calls == ["scalar", "avx2"]


@pytest.mark.parametrize("kind, kw", [("adam", {"lr": 1e-3, "weight_decay": 0.1, "amsgrad": True}),
                                      ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
                                      ("adagrad", {"lr": 0.05, "weight_decay": 0.01, "maximize": True})])
def test_inf_and_nan_propagate_as_in_torch(native, kind, kw):
    """Non-finite gradients and params give torch's values: the same bits, except that a NaN's sign and payload
    may differ (torch's own differ between its vector body and its scalar tail: torch.maximum writes all-ones)."""
    p, gs = _data(37, 3, 11)
    gs[0][3], gs[1][5], gs[2][7], p[9], gs[2][13] = float("nan"), float("inf"), -float("inf"), float("nan"), -0.0
    want_p, want_state = _torch_run(CLASSES[kind], kw, p, gs)
    for isa in native.cpu_isas():
        got_p, rows = _ours(kind, kw, p, gs, [17], isa)
        torch.testing.assert_close(got_p, want_p, rtol=0, atol=0, equal_nan=True)
        for key, row in zip(STATE_KEYS[kind], rows):
            torch.testing.assert_close(row, want_state[key], rtol=0, atol=0, equal_nan=True)
