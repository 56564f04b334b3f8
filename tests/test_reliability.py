"""Reliability (issue #24): misuse and faults, each an fshard error that names the fix, and never a hang.

The table below grows with the issue; each row is one case: what is done, the error type and a fragment of its
message (the fix it names), run under a timeout. Cases so far:

- A native build killed halfway leaves torch's lock file in the kernel cache; the next build must not wait for it
  forever (fshard/ops/_build.py: fshard's flock, released by the kernel when its holder dies, then the stale file
  cleared). End to end through ``fshard.ops`` in a fresh process, and the lock's three situations directly.
- ``FSHARD_TIMEOUT_S`` that is not a positive number is an ``ArgumentError`` naming the variable when a mesh is
  made, not a broken ``import fshard``; ``Mesh.from_env(timeout_s=...)`` is checked the same way.
- ``state.replace(...)`` checks what it is given against the state's spec: a fractional step, a shard one element
  short, a missing unit, a moment of the wrong dtype each name the field and the fix.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import fshard as fs
from models import Awkward


def _python(code: str, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


# --- the native build's lock ------------------------------------------------------------------------------------

def test_a_build_killed_halfway_leaves_no_lock_that_blocks_the_next():
    from fshard.ops import _build
    _build.build()  # built once (the suite's ops tests have built it already); BuildError without a compiler
    cuda = _build.want_cuda()
    d = _build.cache_root() / f"fshard_ops_{_build._hash(cuda)}"
    (d / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    out = _python("from fshard.ops import _build; _build.build(); print('loaded')", timeout=120)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]  # (the message: the test below)
    assert not (d / "lock").exists()


def test_the_build_lock_is_released_by_a_killed_holder_and_waited_for_while_held(tmp_path, capsys):
    from fshard.ops._build import _exclusive
    (tmp_path / "lock").write_text("")
    with _exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "left by a build that was killed halfway" in capsys.readouterr().err
    holder = ("import os, signal, sys, time; from pathlib import Path; from fshard.ops._build import _exclusive\n"
              "with _exclusive(Path(sys.argv[1])):\n"
              "    print('held', flush=True)\n"
              "    time.sleep(float(sys.argv[2]))\n"
              "    os.kill(os.getpid(), signal.SIGKILL) if sys.argv[3] == 'die' else None\n")
    dead = subprocess.run([sys.executable, "-c", holder, str(tmp_path), "0", "die"], capture_output=True, timeout=60)
    assert dead.returncode == -signal.SIGKILL
    t0 = time.monotonic()
    with _exclusive(tmp_path):  # the dead holder's flock went with it
        pass
    assert time.monotonic() - t0 < 5
    live = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path), "3", "live"], stdout=subprocess.PIPE,
                            text=True)
    assert live.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with _exclusive(tmp_path):  # waits for the live holder, then takes it
        waited = time.monotonic() - t0
    live.wait(timeout=60)
    assert waited > 1.0, waited


# --- timeouts -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan"])
def test_a_bad_timeout_variable_is_named_when_a_mesh_is_made(value):
    out = _python("import fshard as fs\n"
                  "try:\n    fs.Mesh.from_env()\nexcept fs.ArgumentError as e:\n    print('ERR', e)\n",
                  timeout=60, FSHARD_TIMEOUT_S=value, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="1")
    assert out.returncode == 0, out.stderr[-2000:]  # import fshard itself works
    assert "ERR" in out.stdout and "FSHARD_TIMEOUT_S" in out.stdout and repr(value) in out.stdout, out.stdout


def test_a_bad_timeout_argument_is_named():
    with pytest.raises(fs.ArgumentError, match="timeout_s must be a positive number of seconds"):
        fs.Mesh.from_env(timeout_s=-1)


# --- TrainState.replace -------------------------------------------------------------------------------------------

def _state():
    torch.manual_seed(0)
    return fs.init(Awkward(), fs.Mesh.from_env(), fs.adamw())


def _short(state):
    name = next(iter(state.params))
    return {**state.params, name: state.params[name][:-1]}


REPLACE = [  # (what is given, the message fragment)
    (lambda s: dict(step=torch.tensor(0.5)), r"step must be a 0-dim torch.int64 tensor.*torch.tensor\(n\)"),
    (lambda s: dict(step=3), r"step must be a 0-dim torch.int64 tensor"),
    (lambda s: dict(skipped=torch.zeros(2, dtype=torch.int64)), r"skipped must be a 0-dim torch.int64 tensor"),
    (lambda s: dict(params=_short(s)), r"params\['.*'\] has shape \(\d+,\).*\(\d+,\) elements.*the shard"),
    (lambda s: dict(params={k: v for k, v in list(s.params.items())[1:]}), r"params lacks unit"),
    (lambda s: dict(params={**s.params, "nope": torch.zeros(3)}), r"params has unit 'nope', which the model"),
    (lambda s: dict(params={k: v.double() for k, v in s.params.items()}), r"params\['.*'\] is torch.float64"),
    (lambda s: dict(opt_state={k: fs.AdamWState(v.count, v.exp_avg.half(), v.exp_avg_sq)
                               for k, v in s.opt_state.items()}), r"opt_state\['.*'\].exp_avg is torch.float16"),
    (lambda s: dict(buffers={}), r"buffers lacks 'shift'"),
]


@pytest.mark.parametrize("case", range(len(REPLACE)))
def test_replace_checks_what_it_is_given(case):
    state = _state()
    change, fragment = REPLACE[case]
    with pytest.raises(fs.ArgumentError, match=fragment):
        state.replace(**change(state))
    state.replace(step=torch.tensor(4), params=dict(state.params))  # right ones pass
