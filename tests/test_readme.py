"""The README's samples come from the code (issue #38): its `--plan` sample is what that command prints (every byte
figure exactly; the predicted RSS, which depends on the process, masked), its timeline and restart samples have the
structure of what the example prints, and every command it gives writes under `runs/` or outside the checkout."""
from __future__ import annotations

import os
import re
import sys

from _proc import run_logged

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(_ROOT, "README.md")).read()


def _command(marker: str) -> list[str]:
    """The README's indented command containing ``marker`` (with its continuation lines), as arguments."""
    lines = README.splitlines()
    i = next(i for i, line in enumerate(lines) if marker in line and line.startswith("    "))
    while i > 0 and lines[i - 1].rstrip().endswith("\\"):
        i -= 1
    cmd = []
    while True:
        cmd.append(lines[i].strip().rstrip("\\"))
        if not lines[i].rstrip().endswith("\\"):
            return " ".join(cmd).split()
        i += 1


def _block_after(marker: str) -> list[str]:
    """The lines of the first fenced block after the README line containing ``marker``."""
    rest = README[README.index(marker):]
    start = rest.index("```\n") + 4
    return rest[start:rest.index("```", start)].rstrip("\n").splitlines()


def _example(args: list[str], tmp_path) -> str:
    """examples/train_gpt.py under torchrun with the README's arguments, its run directory moved to ``tmp_path``."""
    args = [a for a in args if not a.startswith("TORCH_DISABLE")]
    i = args.index("examples/train_gpt.py")
    torchrun = args[:i]
    flags = args[i + 1:]
    if "--run-dir" in flags:
        flags[flags.index("--run-dir") + 1] = str(tmp_path / "run")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), *torchrun[1:],
           os.path.join(_ROOT, "examples", "train_gpt.py"), *flags]
    return run_logged(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=_ROOT)


_RSS = "peak RSS of this process, predicted"


def test_the_plan_sample_is_what_the_command_prints(tmp_path):
    args = _command("--plan")
    assert "--run-dir" in args and args[args.index("--run-dir") + 1].startswith("runs/")
    log = _example(args, tmp_path).splitlines()
    start = next(i for i, line in enumerate(log) if line.startswith("fshard step plan:"))
    end = next(i for i in range(start, len(log)) if log[i].startswith("DDP with fp32 AdamW"))
    printed, sample = log[start:end + 1], _block_after("--plan --steps")
    mask = lambda lines: [re.sub(r"\d[\d.]* (MiB|GiB)", "N MiB", x) if _RSS in x else x for x in lines]  # noqa
    assert mask(sample) == mask(printed), "\n".join(printed)
    assert any(_RSS in x for x in sample)


def test_the_timeline_command_writes_under_runs_and_its_line_is_the_examples(tmp_path):
    args = " ".join(_command("--timeline")).replace('"$(mktemp -d)"', "MKTEMP").split()
    path = args[args.index("--timeline") + 1]
    assert path.startswith("runs/") and "docs/" not in " ".join(args)
    sample = _block_after("--timeline runs/")
    pattern = r"timeline of step (\d+): (\S+) \((\d+\.\d{3}) s, overlap (\d+)%\)"
    assert len(sample) == 1 and re.fullmatch(pattern, sample[0]) and path in sample[0], sample
    # the same flags on the tiny GPT for 2 steps (the 27.4M one takes minutes here): the line it prints
    subs = {"--steps": "2", "--nvme-dir": str(tmp_path / "nvme"), "--timeline": str(tmp_path / "t.png")}
    flags = [subs.get(args[i - 1], a) if i else a for i, a in enumerate(args)] + ["--tiny", "--threads", "1"]
    log = _example(flags, tmp_path)
    assert re.search(pattern.replace("(\\S+)", re.escape(str(tmp_path / "t.png"))), log), log[-3000:]
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_the_restart_sample_resumes_where_the_command_saves():
    args = _command("--fault-at")
    flags = " ".join(args)
    assert "--run-dir runs/" in flags and "--export runs/" in flags
    sample = "\n".join(_block_after("--export runs/restart/model.pt"))
    fault = int(args[args.index("--fault-at") + 1])
    every = int(args[args.index("--save-every") + 1])
    saved = fault // every * every
    assert f"resumed from runs/restart/ckpt/step-{saved:08d} (step {saved})" in sample, sample
    assert re.search(r"validation loss \d+\.\d{3} \(unigram baseline \d+\.\d{3}\)$", sample), sample


def test_every_command_writes_under_runs_or_outside_the_checkout():
    commands = [" ".join(_command(m)) for m in ("--plan", "--timeline", "--fault-at", "train_hf.py")]
    for c in commands:
        for flag in ("--run-dir", "--export", "--timeline", "--nvme-dir", "--checkpoint-dir"):
            for value in re.findall(rf"{flag} (\S+)", c):
                assert value.startswith(("runs/", '"$(mktemp')), (flag, value, c)
    make = open(os.path.join(_ROOT, "Makefile")).read()
    assert "--run-dir runs/gpt" in make and "mktemp" not in make.split("train:")[1].split("\n\n")[0]
    assert "/runs/" in open(os.path.join(_ROOT, ".gitignore")).read().split()
