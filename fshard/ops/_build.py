"""Build and load the native kernels in ``ops/`` with torch.utils.cpp_extension.

The sources are compiled once with ninja into a per-user cache keyed by a hash of
the sources, the flags and the torch version, so an edit to any source rebuilds
and two checkouts never share a stale .so. Cache root, first match wins:
``$FSHARD_OPS_CACHE``, ``$TORCH_EXTENSIONS_DIR/fshard``, ``~/.cache/fshard/ops``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from .._errors import FshardError

log = logging.getLogger("fshard.ops")


def _src_dir() -> Path:
    """The C++/CUDA sources: $FSHARD_OPS_SRC, else ``ops/`` at the repository root (a checkout or an editable
    install), else the copy a wheel carries as the package ``fshard.ops.csrc`` (pyproject.toml maps it to ops/)."""
    if os.environ.get("FSHARD_OPS_SRC"):
        return Path(os.environ["FSHARD_OPS_SRC"])
    checkout = Path(__file__).resolve().parents[2] / "ops"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "csrc"


SRC_DIR = _src_dir()
CPU_SOURCES = ["bindings.cpp", "adamw_cpu.cpp", "adamw_scalar.cpp", "adamw_avx2.cpp", "adamw_avx512.cpp",
               "norm_cpu.cpp", "norm_avx2.cpp", "norm_avx512.cpp",
               "torch_norm.cpp"]
CUDA_SOURCES = ["adamw_cuda.cu"]
HEADERS = ["adamw.h", "adamw_ops.h", "adamw_simd.h", "norm.h", "norm_simd.h"]
CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"]  # FMAs only where written
LDFLAGS = ["-fopenmp"]


class BuildError(FshardError, RuntimeError):
    """The native ops could not be built (no compiler, no ninja, compile error)."""


def cache_root() -> Path:
    if os.environ.get("FSHARD_OPS_CACHE"):
        return Path(os.environ["FSHARD_OPS_CACHE"])
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "fshard"
    return Path.home() / ".cache" / "fshard" / "ops"


def want_cuda() -> bool:
    """Build the .cu only where a CUDA toolkit and a CUDA torch are both present."""
    import torch
    from torch.utils import cpp_extension

    if os.environ.get("FSHARD_OPS_NO_CUDA"):
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _hash(cuda: bool) -> str:
    import torch

    h = hashlib.sha256()
    for name in CPU_SOURCES + HEADERS + (CUDA_SOURCES if cuda else []):
        h.update(name.encode())
        h.update((SRC_DIR / name).read_bytes())
    h.update(repr((CFLAGS, LDFLAGS, cuda, torch.__version__, sys.version_info[:2])).encode())
    return h.hexdigest()[:12]


def check_toolchain() -> None:
    """Raise BuildError naming the missing compiler or ninja."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(
            f"fshard.ops: C++ compiler {cxx!r} not found on PATH (from $CXX, default 'c++'). "
            "Install g++ (e.g. apt-get install g++) or set CXX to a compiler, then retry. Without a build, "
            "fshard.ops.adamw_ runs the several-pass torch reference instead (with a warning), unless "
            "FSHARD_OPS_REQUIRE_NATIVE=1 makes that an error."
        )
    if not cpp_extension.is_ninja_available():
        raise BuildError("fshard.ops: ninja not found; pip install ninja (torch JIT builds need it).")
    for name in CPU_SOURCES + HEADERS:
        if not (SRC_DIR / name).is_file():
            raise BuildError(f"fshard.ops: source {SRC_DIR / name} is missing; run from a checkout or set "
                             "FSHARD_OPS_SRC to the ops/ source directory.")


@contextlib.contextmanager
def _exclusive(build_dir: Path):
    """Hold fshard's own lock on ``build_dir`` (flock: the kernel releases it when its process dies, however) while
    torch builds and loads there, and clear torch's lock file if one is left over. torch's lock (FileBaton, the file
    ``lock``) is a file that exists while a build runs; a build killed halfway leaves it, and every later load
    waits for it forever. Under fshard's lock no other fshard process is building, so a ``lock`` found is stale."""
    with open(build_dir / "fshard.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            print(f"fshard.ops: waiting for the build in process {f.read().strip() or '?'} ({build_dir})",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        stale = build_dir / "lock"
        if stale.exists():
            print(f"fshard.ops: removing {stale}, left by a build that was killed halfway (no build holds "
                  "fshard.lock); building again", file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(verbose: bool = False):
    """Compile (if needed) and import the extension; returns the module."""
    from torch.utils import cpp_extension

    check_toolchain()
    cuda = want_cuda()
    key = _hash(cuda)
    name = f"fshard_ops_{key}"
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not (build_dir / f"{name}.so").exists()
    if fresh:
        msg = (f"fshard.ops: building native AdamW kernels ({'CPU+CUDA' if cuda else 'CPU'}) into "
               f"{build_dir}; this happens once per source version and takes about a minute")
        log.info(msg)
        print(msg, file=sys.stderr, flush=True)
    sources = [str(SRC_DIR / s) for s in CPU_SOURCES]
    cflags = list(CFLAGS)
    if cuda:
        sources += [str(SRC_DIR / s) for s in CUDA_SOURCES]
        cflags.append("-DFSHARD_WITH_CUDA")
    t0 = time.perf_counter()
    with _exclusive(build_dir):
        try:
            mod = cpp_extension.load(
                name=name, sources=sources, extra_cflags=cflags, extra_ldflags=list(LDFLAGS),  # (torch appends)
                extra_cuda_cflags=["-O3", "-DFSHARD_WITH_CUDA"] if cuda else None,
                extra_include_paths=[str(SRC_DIR)], build_directory=str(build_dir), verbose=verbose,
            )
        except Exception as e:  # compiler errors surface as RuntimeError/CalledProcessError
            raise BuildError(f"fshard.ops: building {name} in {build_dir} failed: {e}") from e
    if fresh:
        print(f"fshard.ops: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return mod
