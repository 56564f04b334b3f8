"""fs.full_state_dict and the hand-off to Hugging Face: a tiny GPT-2 and Llama trained 3 steps with fshard at world
sizes 1 and 2 load into a fresh (or meta-built) HF model with strict=True, keep their ties and buffers, generate the
tokens of an oracle trained with plain torch (DDP at 2 ranks, torch.optim.AdamW, the same batches), and round-trip
through save_pretrained / from_pretrained. Nothing is downloaded."""
from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported; spawned ranks inherit it

import pytest
import torch
import torch.nn as nn

import fshard as fs
from _dist import run_ranks
from models import HF_VOCAB, Awkward, hf_model

STEPS, HP = 3, dict(lr=1e-2, weight_decay=0.01)
PROMPT = torch.tensor([[5, 6, 7, 8]])
TIED = {"gpt2": ("lm_head.weight", "transformer.wte.weight"), "llama": ("lm_head.weight", "model.embed_tokens.weight")}


def _loss(module, batch):
    return module(input_ids=batch, labels=batch).loss


def _batches(rank: int, world_size: int):
    """Per-rank rows of a deterministic global batch: counting sequences mod the vocabulary, so there is
    something for 3 steps to learn."""
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 + s)
        start = torch.randint(3, HF_VOCAB, (2 * world_size, 1), generator=g)
        rows = (start + torch.arange(8)) % (HF_VOCAB - 3) + 3
        yield rows[2 * rank:2 * rank + 2]


def _generate(model):
    model.eval()
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=4, do_sample=False).tolist(), model(PROMPT).logits


def _check_model(label, model, ref, full, tied):
    """``model`` after a hand-off: fshard's parameters, the oracle's buffers, its tie, the oracle's logits and
    tokens."""
    target, source = tied
    assert model.get_parameter(target) is model.get_parameter(source), f"{label}: {target} is no longer tied"
    for n, p in model.named_parameters():
        assert torch.equal(p, full[n]), f"{label}: {n} differs from fs.full_params"
    for n, b in ref.named_buffers():  # Llama's rotary inv_freq (non-persistent: from the constructor)
        assert torch.equal(model.get_buffer(n), b), f"{label}: buffer {n} differs from the oracle's"
    tokens, logits = _generate(model)
    ref_tokens, ref_logits = _generate(ref)
    assert torch.equal(logits, ref_logits), f"{label}: logits differ from the oracle's"
    assert tokens == ref_tokens, f"{label}: generate gave {tokens}, the oracle {ref_tokens}"


def _train_and_hand_off(name: str, tmp: str):
    """On each rank: fshard and the oracle side by side; rank 0 then hands fshard's state off to HF models."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from models import oracle_step
    mesh = fs.Mesh.from_env()
    torch.manual_seed(0)
    model = hf_model(name)
    ref = copy.deepcopy(model)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    step = fs.compose(_loss)
    oracle = DDP(ref) if mesh.world_size > 1 else ref
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    for batch in _batches(mesh.rank, mesh.world_size):
        state, metrics = step(state, batch)
        assert metrics["loss"] == oracle_step(oracle, opt, _loss, batch, mesh.world_size), "loss differs"
    full = fs.full_params(state)
    sd = fs.full_state_dict(state)  # a collective: every rank
    assert all(torch.equal(full[n], p) for n, p in ref.named_parameters()), "fshard is not bitwise the oracle"
    if mesh.rank != 0:
        return None
    keys = list(ref.state_dict())
    assert list(sd) == keys, f"keys {list(sd)} are not model.state_dict()'s {keys}"
    target, source = TIED[name]
    assert sd[target] is sd[source], "a tied alias is not the same tensor, as in model.state_dict()"
    assert "model.rotary_emb.inv_freq" not in sd  # non-persistent: state_dict leaves it out

    torch.manual_seed(1)
    fresh = hf_model(name)  # other weights; its constructor makes the tie and the buffers
    fresh.load_state_dict(sd)  # strict
    _check_model("fresh", fresh, ref, full, TIED[name])

    with torch.device("meta"):
        meta = hf_model(name)
    meta.to_empty(device="cpu")
    assert meta.get_parameter(target) is not meta.get_parameter(source)  # why the hand-off ties again
    meta.load_state_dict(sd)
    meta.tie_weights()
    for n, b in state.buffers.items():  # non-persistent buffers are in no state_dict
        meta.get_buffer(n).copy_(b)
    _check_model("meta-built", meta, ref, full, TIED[name])

    path = os.path.join(tmp, name)
    fresh.save_pretrained(path)
    loaded = type(fresh).from_pretrained(path)
    _check_model("from_pretrained", loaded, ref, full, TIED[name])
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_hand_off_to_hf_keeps_ties_and_buffers_and_generates_the_oracles_tokens(world_size, tmp_path):
    for name in ("gpt2", "llama"):
        if world_size == 1:
            assert _train_and_hand_off(name, str(tmp_path))
        else:
            assert run_ranks(_train_and_hand_off, 2, name, str(tmp_path))[0]


class _Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Awkward()  # tied emb/head across the root, a persistent buffer, a frozen parameter
        self.register_buffer("scratch", torch.arange(3.0), persistent=False)
        self.register_buffer("count", torch.tensor(7))
        self.alias = self.inner  # the same module at two paths: two names per tensor in state_dict


def test_full_state_dict_is_keyed_like_state_dict():
    model = _Buffers()
    state = fs.init(model, fs.Mesh(0, 1, "local", torch.device("cpu")), fs.adamw())
    sd = fs.full_state_dict(state)
    assert list(sd) == list(model.state_dict()) and "scratch" not in sd
    assert sd["inner.head.weight"] is sd["inner.emb.weight"] is sd["alias.emb.weight"]
    assert sd["alias.shift"] is sd["inner.shift"] and sd["count"].dtype == torch.int64
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k
    assert sd["count"].data_ptr() != state.buffers["count"].data_ptr()  # copies: the state stays immutable
    copy.deepcopy(model).load_state_dict(sd)  # strict
    with pytest.raises(fs.ArgumentError, match="fs.TrainState"):
        fs.full_state_dict(sd)
