"""Automatic restart and export (issue #21): examples/train_gpt.py under ``torchrun --max-restarts=2``, a rank killed
with SIGKILL mid-training, resumes from fs.latest(--checkpoint-dir) and ends with parameters bitwise equal to an
uninterrupted run's (parameters and moments offloaded to NVMe, saved in the background: the restart loads them back
into the store), leaving no store files behind (issue #37). The export it writes is
``fs.full_state_dict(state, rank0_only=True)``, which gathers to rank 0 only, unit by unit (memory measured)."""
from __future__ import annotations

import os
import sys

import torch

import fshard as fs
from _dist import run_ranks
from _memory import reset_peak as _reset_peak, status as _status
from _proc import example_main, run_logged

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10


def _train(tmp, name: str, *flags: str, restarts: int = 0):
    export = tmp / f"{name}.pt"
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={restarts}", os.path.join(_ROOT, "examples", "train_gpt.py"), "--tiny", "--steps",
           str(STEPS), "--threads", "1", "--log-every", "0", "--export", str(export),
           # synthetic data: no corpus to tokenize; the run's logs in a directory of its own (a shared one resumes)
           "--data", "synthetic", "--run-dir", str(tmp / f"{name}-run"), *flags]
    # torchrun's shared store keeps a dead rank's address across restarts (pytorch/pytorch#135712); torch's switch
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = run_logged(cmd, env=env, what=f"{name}: ")  # torchrun and its workers: none may outlive the test
    return torch.load(export), log


def test_a_killed_rank_restarts_from_the_latest_checkpoint_bitwise(tmp_path):
    # the uninterrupted run: the example's main on two ranks forked from the test's rank server (torchrun, three
    # fresh interpreters, is what the runs that restart need)
    run_ranks(example_main, 2, ["--tiny", "--steps", str(STEPS), "--threads", "1", "--log-every", "0", "--export",
                                str(tmp_path / "uninterrupted.pt"), "--data", "synthetic", "--run-dir",
                                str(tmp_path / "uninterrupted-run")])
    ref = torch.load(tmp_path / "uninterrupted.pt")
    # one run that restarts (a torchrun run with a restart costs 20-30 s here), with the most in it: parameters and
    # moments in an NVMe store, saves in the background (loading moments alone into a store: test_checkpoint_stored;
    # a resume after blocking saves: test_train_example's rerun). The kill before step 7 finds step 6 saved, or,
    # while step 6's asynchronous save still runs, step 3, the newest complete one (an incomplete save is never used)
    d, nvme = tmp_path / "ckpt", tmp_path / "nvme"
    got, log = _train(tmp_path, "restarted", "--checkpoint-dir", str(d), "--save-every", "3", "--fault-at", "7",
                      "--nvme-dir", str(nvme), "--offload-params", "--async-save", restarts=2)
    assert any(f"{d}/step-0000000{s} (step {s})" in log for s in (3, 6)), log[-3000:]
    assert sorted(p.name for p in d.iterdir()) == ["step-00000009", "step-00000010"]  # keep_last 2
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    # no store files outlive the run (issue #37): the killed rank's are removed by its restart's store, the peer
    # torchrun ended with SIGTERM removed its own, and the last run's closed
    left = {r: os.listdir(nvme / r) for r in os.listdir(nvme)}
    assert left == {"rank0": [], "rank1": []}, left


def _export(_):
    torch.manual_seed(0)
    # units of 36 MB: above glibc's largest dynamic mmap threshold (32 MiB), so each full-size buffer is mapped and
    # unmapped as it lives, as at real sizes; 4 MB ones are kept in malloc's per-thread arenas once freed, and the
    # peak RSS then varied from 5 to 8 units between runs of the same code
    model = torch.nn.Sequential(*[torch.nn.Linear(3072, 3072) for _ in range(4)])
    mesh = fs.Mesh.from_env()
    state = fs.init(model, mesh, fs.adamw())
    fs.full_state_dict(state, rank0_only=True)  # the first-use costs of gloo's gather are not measured
    before = _reset_peak()  # the peak RSS, from here
    sd = fs.full_state_dict(state, rank0_only=True)
    growth = _status("VmHWM:") - before
    ok = mesh.rank != 0 or all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    return len(sd), growth, ok


def test_full_state_dict_rank0_only_gathers_to_rank_0_unit_by_unit():
    (n0, grow0, ok0), (n1, grow1, _) = run_ranks(_export, 2, None)
    unit = 3072 * 3072 * 4 + 3072 * 4  # one Linear's parameters, fp32
    assert ok0 and n0 == 8 and n1 == 0
    # the dict (4 units) and the one flat buffer; gloo's gather on rank 0 receives into a temporary of its own (a
    # unit), freed before the unit's clones are made, so it adds nothing to the peak
    assert grow0 <= 5 * unit + 8 * 2**20, grow0
    assert grow1 <= 2 * 2**20, grow1  # no full parameter on the other ranks (all-gathered: 21 MB each)
