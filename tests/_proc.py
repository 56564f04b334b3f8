"""A command run to its end under a timeout, its output (stdout and stderr together) returned: what the tests that
drive examples/ under torchrun share; and the example's ``main`` for ranks forked by tests/_dist.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile


_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def example_main(argv: list):
    """examples/train_gpt.py's ``main(argv)`` in this process: what ``run_ranks(example_main, n, argv)`` runs on
    ranks forked from the rank server, where a test needs the example's training and not its torchrun launch (three
    fresh interpreters a run). Returns the run's summary (rank 0's is the one that writes)."""
    if _EXAMPLES not in sys.path:
        sys.path.insert(0, _EXAMPLES)
    import train_gpt
    return train_gpt.main(argv)


def run_logged(cmd: list, *, timeout: float = 240, what: str = "", **popen) -> str:
    """``cmd``'s output; an AssertionError with its tail when it fails or runs past ``timeout`` seconds. It runs in a
    session of its own, and whatever ends the wait (its timeout, pytest-timeout's, Ctrl-C) kills the whole group:
    torchrun and its workers never outlive the test."""
    # its temporary files in a directory of its own, removed after it: torchrun makes a torchelastic_* directory in
    # the temporary directory at every launch and leaves it there (hundreds in /tmp after a few runs of the suite)
    tmp = tempfile.mkdtemp(prefix="fshard-cmd-")
    popen["env"] = {**(popen.get("env") or os.environ), "TMPDIR": tmp}
    try:
        return _run(cmd, timeout, what, popen)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list, timeout: float, what: str, popen: dict) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **popen)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"{what}no result within {timeout:.0f} s\n{log[-4000:]}") from None
    except BaseException:  # the test itself timed out or was interrupted
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, f"{what}{log[-4000:]}"
    return log
