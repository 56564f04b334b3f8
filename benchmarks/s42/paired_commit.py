"""benchmarks/paired.py with a whole older fshard beside today's, in the same processes (issue #42).

paired.py runs its configs in one set of processes, so it cannot take step.py's ``--baseline DIR`` (a second
``fshard`` cannot be imported under the same name). This driver extracts commit ``--commit``'s ``fshard/`` and
``ops/`` (``git archive``) into a temporary directory as the package ``fshard_base`` and registers, for every fshard
config X of step.py, ``base:X``: X built while ``import fshard`` yields the copy. fshard imports itself relatively,
except the package's lazy attributes (``import_module("fshard.ops")``; the code a step runs needs only ``ops``, not
``testing``), so the copy's ``ops`` is imported under its own name first; its native kernels build from its own
``ops/`` into a cache entry of their own. A build that imports any ``fshard.*`` module while the copy stands in for
``fshard`` is refused, so neither side ever runs the other's modules. A step function keeps the modules it was built
from, so ``base:X`` steps the old code and X today's, pair by pair.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s42/paired_commit.py --commit 992e49a \\
        --world-size 1 --configs torch,base:fshard+donate,fshard+donate --pairs 30 --warmup 3

Everything else is paired.py's (its flags, its table). Needs the git history (run from a clone). A config whose
builder needs an API the old commit lacks fails at construction, naming it.
"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/ (paired, step)

import paired  # noqa: E402
import step  # noqa: E402

NAME = "fshard_base"
ENV = "FSHARD_PAIRED_BASE"  # the extracted directory, for the ranks (spawned: they import this file afresh)


def _extract(commit: str, where: str) -> None:
    """Into ``where``: ``fshard_base/`` (commit's fshard/) and ``ops/`` (its native sources)."""
    archive = subprocess.run(["git", "archive", commit, "fshard", "ops"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    os.rename(os.path.join(where, "fshard"), os.path.join(where, NAME))


def _base_builder(builder):
    def build(ctx):
        import importlib

        import fshard as today  # today's package and its modules are loaded before the swap, under their names
        base = importlib.import_module(NAME)
        importlib.import_module(f"{NAME}.ops")  # else the copy's `from .. import ops` loads "fshard.ops" by name
        loaded = {k for k in sys.modules if k == "fshard" or k.startswith("fshard.")}
        sys.modules["fshard"] = base  # the builder's `import fshard as fs` (and its transforms') get the copy
        try:
            return builder(ctx)
        finally:
            sys.modules["fshard"] = today
            mixed = sorted(k for k in sys.modules if (k == "fshard" or k.startswith("fshard.")) and k not in loaded)
            for k in mixed:
                del sys.modules[k]
            if mixed:
                raise RuntimeError(f"[paired_commit.py] building base: imported {mixed} by today's name while "
                                   "the copy stood in for fshard: the two would share them")
    return build


_today_builder = step._builder


def _builder(name: str):
    """step.py's builder, except that ``base:X`` builds X against the old commit's copy (step.py's own base:
    needs a process of its own)."""
    if step._is_base(name):
        return _base_builder(step.CONFIGS[name[len(step.BASE):]])
    return _today_builder(name)


_today_names = step._config_names


def _config_names(args):
    """step.py's check of the names, which wants a baseline for base: configs: the extracted copy is it."""
    args.baseline = args.baseline or os.environ.get(ENV)
    return _today_names(args)


# paired.worker looks both up at call time, in the ranks too (spawned, they import this file as __mp_main__)
step._builder, step._config_names = _builder, _config_names
if os.environ.get(ENV):
    sys.path.insert(0, os.environ[ENV])


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--commit" not in argv:
        raise SystemExit("paired_commit.py: --commit COMMIT is required (the fshard to run as base:X)")
    i = argv.index("--commit")
    commit = argv[i + 1]
    del argv[i:i + 2]
    if os.environ.get("FSHARD_OPS_SRC"):
        raise SystemExit("paired_commit.py: unset FSHARD_OPS_SRC (it would give both sides the same native sources)")
    where = tempfile.mkdtemp(prefix="fshard-base-")
    try:
        try:
            _extract(commit, where)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"paired_commit.py: cannot extract {commit}: {(e.stderr or b'').decode().strip()}")
        os.environ[ENV] = where
        sys.path.insert(0, where)
        print(f"[paired_commit.py] base: = fshard at {commit} (from {where})", flush=True)
        paired.main(argv)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
