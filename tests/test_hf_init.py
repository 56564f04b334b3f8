"""HF-correct meta init: a Hugging Face model built on the meta device and initialised by fs.init with
``init_fn=model._init_weights`` has HF's per-parameter distributions (children before parents, ties after), the same
weights at world sizes 1 and 2, and HF's buffers. Tiny GPT-2, Llama, BERT and T5 configs; nothing is downloaded."""
from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported; spawned ranks inherit it

import pytest
import torch

import fshard as fs
from _dist import run_ranks
from models import HF_MODELS, hf_model

K = 6.0  # standard errors allowed: a false failure has odds of about 1e-9 per statistic


def _meta_init(names, seed=7, mesh=None):
    """On one rank: each model built on meta, fs.init with HF's init; its full parameters and its buffers."""
    mesh = mesh or fs.Mesh.from_env()
    out = {}
    for name in names:
        with torch.device("meta"):
            model = hf_model(name)
        state = fs.init(model, mesh, fs.adamw(impl="torch"), init_fn=model._init_weights, seed=seed)
        out[name] = (fs.full_params(state), dict(state.buffers))
    return out if mesh.rank == 0 else None


def _as_numpy(out):
    """What a rank returns through the spawn queue: numpy arrays (tensors would travel as shared memory that dies
    with the rank)."""
    return out and {k: tuple({n: t.numpy() for n, t in d.items()} for d in v) for k, v in out.items()}


def _meta_init_numpy(names):
    return _as_numpy(_meta_init(names))


def _mismatches(ours: dict, ref: torch.nn.Module) -> list[str]:
    """Parameters whose mean or std differ from ``ref``'s by more than statistical noise. For n i.i.d. elements of
    std s, a sample mean has standard error s/sqrt(n) and a sample std about s/sqrt(2n); the difference of two
    independent samples has sqrt(2) times that. Constant tensors (norm weights, biases) must be equal. Exact zeros
    are counted too (a padding row HF zeroes, or a tie that kept the wrong source)."""
    bad = []
    for n, p in ref.named_parameters():
        a, b = ours[n].double(), p.detach().double()
        s, k = b.std().item(), b.numel()
        if s == 0:
            if not torch.equal(a, b):
                bad.append(f"{n}: constant {b.flatten()[0].item()} in HF, not in fshard")
            continue
        dm, ds = abs(a.mean().item() - b.mean().item()), abs(a.std().item() - s)
        if dm > K * s * math.sqrt(2 / k) or ds > K * s / math.sqrt(k):
            bad.append(f"{n}: mean {a.mean().item():.4g} vs HF {b.mean().item():.4g}, std {a.std().item():.4g} vs "
                       f"HF {s:.4g} (numel {k})")
        if int((a == 0).sum()) != int((b == 0).sum()):
            bad.append(f"{n}: {int((a == 0).sum())} exact zeros vs HF {int((b == 0).sum())}")
    return bad


def _reference(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return hf_model(name)  # on the CPU: HF's own initialize_weights, then tie_weights


@pytest.fixture(scope="module")
def world_size_1():
    return _meta_init(HF_MODELS, mesh=fs.Mesh(0, 1, "local", torch.device("cpu")))


@pytest.mark.parametrize("name", HF_MODELS)
def test_meta_init_has_hf_distributions(world_size_1, name):
    full, buffers = world_size_1[name]
    ref = _reference(name)
    assert list(full) == [n for n, _ in ref.named_parameters()]  # ties: one entry, under the source's name
    assert not _mismatches(full, ref), "\n".join(_mismatches(full, ref))
    for n, b in ref.named_buffers():  # rotary inv_freq, BERT's position ids: computed, so exactly HF's
        assert torch.equal(buffers[n], b), n


def test_meta_init_does_not_depend_on_the_world_size(world_size_1):
    two = run_ranks(_meta_init_numpy, 2, HF_MODELS)[0]
    for name in HF_MODELS:
        (full1, buf1), (full2, buf2) = world_size_1[name], two[name]
        assert list(full1) == list(full2) and list(buf1) == list(buf2)
        assert all(torch.equal(full1[n], torch.from_numpy(full2[n])) for n in full1), name
        assert all(torch.equal(buf1[n], torch.from_numpy(buf2[n])) for n in buf1), name


def test_the_comparison_tells_parent_first_init_apart():
    """The bug this guards against: init_fn called parent first lets Conv1D/Linear defaults overwrite GPT-2's
    scaled c_proj (0.020 instead of 0.010) and T5's projections (about 1.0)."""
    for name, wrong in (("gpt2", "attn.c_proj.weight"), ("t5", "SelfAttention.q.weight")):
        model = _reference(name)
        with torch.no_grad():
            for m in model.modules():  # parent first, as model.modules() lists them
                model._init_weights(m)
            model.tie_weights()
        bad = _mismatches(dict(model.named_parameters()), _reference(name))
        assert any(wrong in b for b in bad), bad


def test_init_fn_that_reaches_into_another_unit_is_an_error():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def init_fn(m):  # the root's call writes into unit blocks.0, which is a placeholder in the root's copy
        if isinstance(m, Net):
            torch.nn.init.zeros_(m.blocks[0].weight)

    with torch.device("meta"):
        model = Net()
    with pytest.raises(fs.InitError, match=r"init_fn\('<root>'\).*other units are empty placeholders.*units="):
        fs.init(model, fs.Mesh(0, 1, "local", torch.device("cpu")), fs.adamw(), init_fn=init_fn)
