"""examples/train_hf.py: a transformers causal LM from its config, trained with fshard end to end: under torchrun
at 2 ranks with bf16, activation checkpointing and NVMe offload (the loss falls, the handed-off model generates the
learnt continuation); and in process, its training in fp32 with blocking policies and no clipping equals a plain
torch loop (AdamW, the same batches, from the same initial weights) within 1e-5."""
from __future__ import annotations

import os
import re
import sys

import torch

from _proc import run_logged

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))


def test_train_hf_at_two_ranks_with_checkpointing_and_nvme(tmp_path):
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
           os.path.join(_ROOT, "examples", "train_hf.py"), "--model", "gpt2", "--steps", "25", "--checkpointing",
           "--nvme-dir", str(tmp_path), "--save", str(tmp_path / "saved")]
    log = run_logged(cmd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 25 steps", log).groups())
    assert last < 0.6 * first, log[-3000:]
    assert "generated [10, 11, 12" in log, log[-3000:]  # counting, learnt
    assert (tmp_path / "saved" / "config.json").exists()


def test_train_hf_in_fp32_equals_a_plain_torch_loop():
    import fshard as fs
    import train_hf
    mesh = fs.Mesh(0, 1, "local", torch.device("cpu"))
    flags = ["--model", "llama", "--precision", "fp32", "--depth", "0", "--bucket-mb", "0", "--clip", "0"]
    state, _, cfg = train_hf.train(train_hf.parse_args(flags + ["--steps", "0"]), mesh)
    model = train_hf.hand_off(state, cfg).train()  # the initial weights fs.init made
    args = train_hf.parse_args(flags + ["--steps", "4"])
    _, losses, _ = train_hf.train(args, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    for batch, ours in zip(train_hf.batches(cfg, args, 0, 1), losses):
        opt.zero_grad(set_to_none=True)
        loss = train_hf.loss_fn(model, batch)
        loss.backward()
        opt.step()
        assert abs(loss.item() - ours) <= 1e-5, (loss.item(), ours)
