"""benchmarks/paired.py with session 40's bucket_reduce beside today's, in the same processes (issue #42).

Session 41 changed how ``fs.bucket_reduce`` plans and allocates: units are bucketed whole (before, units were cut at
parameter boundaries, so a rank's shard could lie in two buckets and was concatenated after landing), and a landed
bucket's scratch serves the step's later buckets. This driver loads the module as it was at commit 63529a2 (``git
show``, into a temporary file imported as ``fshard.transforms._bucket_reduce_s40``: its relative imports resolve
against today's package) and registers two configs beside step.py's:

- ``old+donate``: gather_ahead(2) + that bucket_reduce(25), donate=True (= ``fshard+ahead+buckets+donate`` then);
- ``old+keep+donate``: the same with ``reshard_after_forward=False``.

Everything else is paired.py's (its flags, its table)::

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s41/paired_old.py --model 117m \\
        --configs ddp,old+donate,fshard+ahead+buckets+donate --pairs 8 --warmup 3

Needs the git history (run from a clone).
"""
import importlib.util
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/ (paired, step)

import paired  # noqa: E402
from step import fshard_runner, register  # noqa: E402

OLD = "63529a2"


def _old_module():
    src = subprocess.run(["git", "show", f"{OLD}:fshard/transforms/_bucket_reduce.py"], cwd=HERE, check=True,
                         capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    name = "fshard.transforms._bucket_reduce_s40"
    spec = importlib.util.spec_from_file_location(name, f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod


def _configs(keep: bool):
    import fshard as fs
    old = _old_module()

    class old_bucket_reduce(fs.bucket_reduce):
        def wrap_reduce(self, reduce):
            return old.BucketReduce(int(self.bucket_mb * 2**20), self.reduce_dtype, self.op, self.per_unit)

    return fs.gather_ahead(2, reshard_after_forward=not keep), old_bucket_reduce(25)


register("old+donate")(lambda ctx: fshard_runner(ctx, *_configs(keep=False), donate=True))
register("old+keep+donate")(lambda ctx: fshard_runner(ctx, *_configs(keep=True), donate=True))

if __name__ == "__main__":
    paired.main()
