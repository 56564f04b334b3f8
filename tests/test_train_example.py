"""examples/train_gpt.py on real text (issue #38): the data module (examples/data.py) tokenizes a corpus with a cached
byte-level BPE, its DistributedSampler gives each rank a disjoint slice, a resumed stream reads the batches an
uninterrupted one reads, the unigram baseline is the hand-computed entropy, and a 5-step run under torchrun writes
its JSONL, TensorBoard events, loss curve and checkpoint, ends with the validation line, and resumes when rerun (on
forked ranks)."""
from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest
import torch

import data
from _dist import run_ranks
from _proc import example_main, run_logged

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _corpus(tmp_path, n=12):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(n):
        (root / f"mod{i:02d}.py").write_text(
            "".join(f"def f{i}_{j}(x, y={j}):\n    return x * y + {i} if x else None\n\n" for j in range(40)))
    return str(root)


def test_the_data_module_tokenizes_splits_by_file_and_caches(tmp_path):
    root, cache = _corpus(tmp_path), str(tmp_path / "cache")
    c = data.prepare(cache, 300, root=root, max_train_bytes=10**6, max_val_bytes=10**6)
    assert c.vocab == 300 and c.train.dtype == torch.int32 and int(c.train.max()) < 300
    assert not set(c.train_files) & set(c.val_files) and len(c.train_files) + len(c.val_files) == 12
    text = open(c.val_files[0]).read()
    assert c.tok.decode(c.tok.encode(text).ids) == text  # byte-level: lossless
    eot = c.tok.token_to_id(data.SPECIAL)
    assert int((c.train == eot).sum()) == len(c.train_files)  # one end-of-text per file
    cached = sorted(os.listdir(cache))
    again = data.prepare(cache, 300, root=root, max_train_bytes=10**6, max_val_bytes=10**6)
    assert sorted(os.listdir(cache)) == cached and torch.equal(again.train, c.train)  # read back, not retrained


def test_the_sampler_gives_each_rank_a_disjoint_slice_and_resumes_exactly():
    tokens = torch.arange(2 * 7 * 16 + 1, dtype=torch.int32)  # 2 * 7 windows of seq 16 (+1 for the last target)
    ds = data.Windows(tokens, 16)
    assert len(ds) == 14 and torch.equal(ds[3][0][1:], ds[3][1][:-1])
    firsts = {}
    for r in range(2):
        dl = data.loader(ds, 2, r, 2, shuffle=True, seed=3)
        firsts[r] = [int(x[k, 0]) // 16 for x, _ in dl for k in range(x.shape[0])]  # window index
    assert len(firsts[0]) == len(firsts[1]) == 6  # 7 each, the last partial batch dropped
    assert not set(firsts[0]) & set(firsts[1])
    dl = data.loader(ds, 2, 0, 2, shuffle=True, seed=3)
    whole = [x for _, (x, y) in zip(range(10), data.train_batches(dl))]  # 3 batches an epoch: over 3 epochs
    assert not torch.equal(whole[0], whole[3])  # each epoch reshuffled (set_epoch)
    resumed = [x for _, (x, y) in zip(range(6), data.train_batches(dl, start=4))]  # from epoch 1's second batch
    assert len(resumed) == 6 and all(torch.equal(a, b) for a, b in zip(whole[4:], resumed))


def test_the_unigram_baseline_is_the_entropy_of_the_token_frequencies():
    # p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert data.unigram_entropy(torch.tensor([5, 5, 1, 2]), 8) == pytest.approx(1.5 * math.log(2), abs=1e-12)
    assert data.unigram_entropy(torch.tensor([3] * 9), 8) == 0.0
    assert data.unigram_entropy(torch.arange(8), 8) == pytest.approx(math.log(8), abs=1e-12)


def _run(run_dir, cache, steps, *flags):
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
           os.path.join(_ROOT, "examples", "train_gpt.py"), "--tiny", "--steps", str(steps), "--threads", "1",
           "--run-dir", str(run_dir), "--cache-dir", str(cache), "--vocab", "512", "--max-train-mb", "0.3",
           "--eval-every", "3", "--eval-batches", "2", "--log-every", "2", "--save-every", "0",
           "--sample-tokens", "8", "--schedule", "constant", *flags]
    return run_logged(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _ranks(run_dir, cache, steps, *flags) -> dict:
    """``_run``'s arguments, the example's ``main`` on two ranks forked from the test's rank server rather than
    under torchrun (which starts three fresh interpreters, a third of this file's time): rank 0's summary. The
    torchrun launch itself is what test_a_short_run_writes_its_outputs_and_a_rerun_resumes runs."""
    argv = ["--tiny", "--steps", str(steps), "--threads", "1", "--run-dir", str(run_dir), "--cache-dir", str(cache),
            "--vocab", "512", "--max-train-mb", "0.3", "--eval-every", "3", "--eval-batches", "2", "--log-every", "2",
            "--save-every", "0", "--sample-tokens", "8", "--schedule", "constant", *flags]
    return run_ranks(example_main, 2, argv)[0]


def test_a_short_run_writes_its_outputs_and_a_rerun_resumes(tmp_path):
    run = tmp_path / "run"
    log = _run(run, tmp_path / "cache", 5)
    last = log.strip().splitlines()[-1]
    m = re.fullmatch(r"validation loss (\d+\.\d{3}) \(unigram baseline (\d+\.\d{3})\)", last)
    assert m, log[-3000:]
    assert "\r" not in log  # stdout is a pipe: summary lines only, no progress bar
    assert "first step (builds native kernels once, then cached)" in log and "step     2/5" in log
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 5]
    assert recs[-1]["val_loss"] == pytest.approx(float(m.group(1)), abs=1e-3)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run / "tb"))
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(run / "ckpt") == ["step-00000005"] and (run / "sample.txt").read_text().startswith("def ")

    # the rerun on forked ranks (the torchrun launch is checked above): it resumes, trains steps 6-8 only
    summary = _ranks(run, tmp_path / "cache", 8, "--export", str(tmp_path / "resumed.pt"))
    assert summary["steps"] == 8 and summary["trained_now"] == 3, summary
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sorted(os.listdir(run / "ckpt")) == ["step-00000005", "step-00000008"]
    assert recs[-1]["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-12)
    # resumed = uninterrupted, bitwise: the sampler's stream picks up at step 5 (a constant learning rate: the
    # schedule does not depend on --steps)
    _ranks(tmp_path / "straight", tmp_path / "cache", 8, "--export", str(tmp_path / "straight.pt"))
    got, ref = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt")
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_run_directory_refuses_another_models_checkpoints(tmp_path):
    import argparse

    import fshard as fs
    from gpt import GPT, GPTConfig
    from run_io import RunLog

    args = argparse.Namespace(run_dir=str(tmp_path / "run"), checkpoint_dir=str(tmp_path / "run" / "ckpt"),
                              data="stdlib")
    log = RunLog(args, 0)
    log.check_config(GPTConfig.tiny())  # a new directory: this run's config written
    RunLog(args, 0).check_config(GPTConfig.small())  # no checkpoint yet: another model may take it over
    state = fs.init(GPT(GPTConfig.small()), fs.Mesh.local(), fs.adamw())
    fs.save(os.path.join(args.checkpoint_dir, "step-00000001"), state)
    RunLog(args, 0).check_config(GPTConfig.small())  # the same model resumes
    with pytest.raises(SystemExit, match=r"holds checkpoints of another run .* pass --run-dir DIR for a new run, "
                                         r"or delete .* to start this one there afresh"):
        RunLog(args, 0).check_config(GPTConfig.tiny())


def test_train_hf_trains_on_the_same_corpus(tmp_path):
    import fshard as fs
    import train_hf

    c = data.prepare(str(tmp_path / "cache"), 300, root=_corpus(tmp_path), max_train_bytes=10**6,
                     max_val_bytes=10**6)
    args = train_hf.parse_args(["--model", "llama", "--data", "stdlib", "--steps", "3", "--seq-len", "16",
                                "--batch-size", "2", "--precision", "fp32"])
    cfg = train_hf.config(args, c)
    assert cfg.vocab_size == 300
    rows = list(train_hf.batches(cfg, args, 0, 1, c))
    assert len(rows) == 3 and all(r.shape == (2, 16) for r in rows)
    windows = {tuple(data.Windows(c.train, 16)[i][0].tolist()) for i in range(len(c.train) // 16)}
    assert all(tuple(r[k].tolist()) in windows for r in rows for k in range(2))  # the corpus' windows
    state, losses, _ = train_hf.train(args, fs.Mesh.local(), corpus=c)
    assert len(losses) == 3 and all(math.isfinite(float(x)) for x in losses) and int(state.step) == 3


@pytest.mark.parametrize("optimizer", ["muon", "sgd", "lion", "adafactor"])
def test_each_optimizer_of_the_example_trains_and_muon_resumes_bitwise(tmp_path, optimizer):
    """``--optimizer``: the loss goes down at two ranks (synthetic data: no tokenizer); Muon's partition (Muon for
    the blocks' matrices, AdamW for the rest) saves, and a resumed run is the uninterrupted one bitwise."""
    flags = ("--optimizer", optimizer, "--data", "synthetic", "--sample-tokens", "0")
    run = tmp_path / "run"
    _ranks(run, tmp_path / "cache", 12, *flags, "--export", str(tmp_path / "straight.pt"))
    losses = [json.loads(line)["loss"] for line in open(run / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), (optimizer, losses)
    if optimizer != "muon":
        return
    _ranks(tmp_path / "resumed", tmp_path / "cache", 6, *flags)
    summary = _ranks(tmp_path / "resumed", tmp_path / "cache", 12, *flags, "--export", str(tmp_path / "resumed.pt"))
    assert summary["trained_now"] == 6, summary  # resumed from step 6's checkpoint
    got, ref = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt")
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
