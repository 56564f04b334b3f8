"""Activation checkpointing lowers fshard's peak memory as it lowers a plain model's: a GPT-2 with 8 layers (HF
transformers, random weights), one training step after a warm-up one, peak RSS growth during the step measured as
VmHWM in a process of its own per variant, forked from one fresh interpreter that imported torch, transformers and
fshard (at sequence 512 the same figures as a fresh interpreter per variant: torch 244 -> 38 MiB, fshard 251 -> 45;
batch 4 x 256 here, in three quarters of the time, checkpointing still saving 100 MiB; the peak reset
through /proc/self/clear_refs right before the step; glibc maps every block of 64 KiB or more on its own,
MALLOC_MMAP_THRESHOLD_, so freed tensors leave the RSS at once and it measures what the step holds rather than how
the heap keeps freed blocks), for plain torch and for fshard (gather_ahead + bucket_reduce), each with and without
``activation_checkpointing_enable()``; and fshard's gathered bytes stay within the gather_ahead bound."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes, json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
import transformers as T
import fshard as fs
T.logging.set_verbosity_error()

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def variant(who, ckpt):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=128, n_positions=256, n_embd=128, n_layer=8, n_head=4, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)
    model = T.GPT2LMHeadModel(cfg)
    if ckpt:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    batch = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(0))
    loss_fn = lambda m, b: m(input_ids=b, labels=b).loss
    out = {}
    if who == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            opt.step()
    else:
        state = fs.init(model, fs.Mesh(0, 1, "local", torch.device("cpu")), fs.adamw(lr=1e-3))
        stepper = fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(1), donate=True)
        units = state.spec.units
        out["root"] = sum(u.nbytes for u in units if not u.module)
        out["largest"] = max(u.nbytes for u in units if u.module)
        def step():
            nonlocal state
            state, m = stepper(state, batch)
            out["gathered"] = m["mem/peak_gathered_bytes"]
    step()  # warm-up: allocator pools, the gather_ahead gather order, torch's optimizer state
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the warm-up freed (below the mmap threshold) leaves the RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    step()
    out["growth"] = status("VmHWM") - before
    return out

# one interpreter imports torch, transformers and fshard once (three quarters of a variant's time), with GPT-2's
# modeling module and the dynamo that its weights' init imports (4 s a variant when each child imported them); each
# variant runs in a child forked from it before any thread or tensor op, a fresh process as far as its heap's peak goes
T.GPT2LMHeadModel
import torch._dynamo
results = {}
for arg in sys.argv[1:]:
    who, ckpt = arg.split(":")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its result down the pipe, then out without running the parent's exit handlers
        os.close(r)
        ok = False
        try:
            os.write(w, json.dumps(variant(who, ckpt == "1")).encode())
            ok = True
        finally:
            os._exit(0 if ok else 1)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, code = os.waitpid(pid, 0)
    assert code == 0, (arg, code)
    results[arg] = json.loads(text)
print(json.dumps(results))
"""


def _probe(*variants: str) -> dict:
    """``{"who:ckpt": result}`` for each of ``variants`` ("torch:0", "fshard:1", ...), from one fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _PROBE, *variants], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_checkpointing_lowers_fshards_peak_as_it_lowers_torchs():
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS here (/proc/self/clear_refs: {e})")
    got = _probe("torch:0", "torch:1", "fshard:0", "fshard:1")
    torch_plain, torch_ckpt, fs_plain, fs_ckpt = got["torch:0"], got["torch:1"], got["fshard:0"], got["fshard:1"]
    mib = {k: v["growth"] / 2**20 for k, v in
           {"torch": torch_plain, "torch+ckpt": torch_ckpt, "fshard": fs_plain, "fshard+ckpt": fs_ckpt}.items()}
    saved_torch = torch_plain["growth"] - torch_ckpt["growth"]
    saved_fs = fs_plain["growth"] - fs_ckpt["growth"]
    assert saved_torch > 64 * 2**20, f"the model is too small to show checkpointing: {mib} MiB"
    # measured (MiB): torch 119 -> 18, fshard 126 -> 25 (design/ARCHITECTURE.md: at sequence 512, 244 -> 38 and
    # 253 -> 50)
    # (at sequence 256: 101 MiB saved either way, against a bound of 91)
    assert saved_fs >= 0.9 * saved_torch, f"checkpointing saved fshard less than torch (peak growth, MiB): {mib}"
    assert fs_ckpt["growth"] <= torch_ckpt["growth"] + 32 * 2**20, f"peak growth, MiB: {mib}"
    for m in (fs_plain, fs_ckpt):  # gather_ahead(2): the current unit, two ahead, one more in backward
        assert m["gathered"] <= m["root"] + 4 * m["largest"], m
