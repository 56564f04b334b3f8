"""Build and load the native kernels in ``ops/`` with torch.utils.cpp_extension.

One build per machine, whatever the checkout: the build directory is named by a key over the sources' contents,
the flags, the compiler, torch (version and location) and Python, and torch builds from a copy of the sources
inside it (``src/``), so the ``build.ninja`` torch writes there names the same paths for every checkout and a
second checkout finds it up to date instead of relinking. Cache root, first match wins: ``$FSHARD_OPS_CACHE``,
``$TORCH_EXTENSIONS_DIR/fshard``, ``~/.cache/fshard/ops``. Layout and the lock: design/OPS.md.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import stat
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from ..errors import BuildError, BuildLockError

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
               "torch_norm.cpp", "classic_cpu.cpp", "classic_scalar.cpp", "classic_avx2.cpp", "classic_avx512.cpp"]
CUDA_SOURCES = ["adamw_cuda.cu"]
HEADERS = ["adamw.h", "adamw_ops.h", "adamw_simd.h", "norm.h", "norm_simd.h", "classic.h", "classic_simd.h"]
CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"]  # FMAs only where written
LDFLAGS = ["-fopenmp"]
LOCK_NAME = "fshard.lock"
INPUTS_NAME = "inputs.json"  # what a build directory was made from: the reason a later build gives compares them


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


@dataclass(frozen=True)
class Inputs:
    """What one build is made of: the source bytes (read once, so the key and the copy agree) and the rest."""
    key: str
    files: Dict[str, bytes]
    described: dict  # per-file digests, torch, Python, compiler, flags: written to inputs.json

    @property
    def name(self) -> str:
        return f"fshard_ops_{self.key}"


def inputs(cuda: bool) -> Inputs:
    import torch

    files = {n: (SRC_DIR / n).read_bytes() for n in CPU_SOURCES + HEADERS + (CUDA_SOURCES if cuda else [])}
    described = {
        "sources": {n: hashlib.sha256(b).hexdigest()[:16] for n, b in files.items()},
        "torch": torch.__version__, "torch_dir": os.path.dirname(torch.__file__),  # its headers' paths
        "python": "%d.%d" % sys.version_info[:2], "cuda": cuda, "cxx": os.environ.get("CXX", "c++"),
        "flags": [CFLAGS, LDFLAGS],
    }
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]
    return Inputs(key, files, described)


def _hash(cuda: bool) -> str:
    return inputs(cuda).key


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


def _open_lock(path: Path) -> int:
    """The lock file's descriptor. Never follows a symbolic link (a link's target would be written: the pid goes
    into the file), never blocks on a FIFO, and refuses anything but a regular file with one name."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "it is a symbolic link, which fshard never follows" if e.errno == errno.ELOOP else e.strerror
        raise BuildLockError(f"fshard.ops: cannot open the build lock {path}: {why}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise BuildLockError(f"fshard.ops: the build lock {path} is not a regular file of its own (a FIFO, "
                             "device or hard link); remove it")
    return fd


@contextlib.contextmanager
def _exclusive(build_dir: Path):
    """Hold fshard's own lock on ``build_dir`` (flock: the kernel releases it when its process dies, however) while
    torch builds and loads there, and clear torch's lock file if one is left over. torch's lock (FileBaton, the file
    ``lock``) is a file that exists while a build runs; a build killed halfway leaves it, and every later load
    waits for it forever. Under fshard's lock no other fshard process is building, so a ``lock`` found is stale.
    Raises BuildLockError when the lock cannot be opened safely (see _open_lock)."""
    fd = _open_lock(build_dir / LOCK_NAME)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not (build_dir / f"{build_dir.name}.so").exists():  # else the holder only loads it: no news
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
                _say(f"fshard.ops: waiting for the build in process {holder} ({build_dir})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)  # a regular file of ours (checked above): who holds it, for a waiter's message
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        stale = build_dir / "lock"
        if stale.exists():
            _say(f"fshard.ops: removing {stale}, left by a build that was killed halfway (no build holds "
                 f"{LOCK_NAME}); building again")
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # drops the flock


def _say(line: str) -> None:
    """One line on stderr in one write, so that the lines of ranks starting together never run into each other."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _stage(build_dir: Path, got: Inputs) -> Path:
    """The sources torch builds from: ``build_dir/src``, written once per build directory (under the lock) and
    never rewritten while it holds the right bytes, so their mtimes, and with them ninja's view, stay put."""
    src = build_dir / "src"
    if src.is_dir() and all((src / n).is_file() and (src / n).read_bytes() == b for n, b in got.files.items()):
        return src
    tmp = build_dir / f"src.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for n, b in got.files.items():
        (tmp / n).write_bytes(b)
    shutil.rmtree(src, ignore_errors=True)
    os.rename(tmp, src)
    (build_dir / INPUTS_NAME).write_text(json.dumps(got.described, indent=1, sort_keys=True))
    return src


def _why(build_dir: Path, got: Inputs) -> str:
    """Why this build runs: compared with the newest other build in the same cache."""
    if (build_dir / INPUTS_NAME).exists() and (build_dir / "src").is_dir():
        return "an earlier build of these sources did not finish"
    others = []
    for p in build_dir.parent.glob(f"fshard_ops_*/{INPUTS_NAME}"):
        with contextlib.suppress(OSError, ValueError):
            if p.parent != build_dir:
                others.append((p.stat().st_mtime, p.parent.name, json.loads(p.read_text())))
    if not others:
        return f"no build in this cache yet ({build_dir.parent})"
    _, last, old = max(others, key=lambda o: o[0])
    new = got.described
    changes = []
    files = sorted(n for n in set(new["sources"]) | set(old.get("sources", {}))
                   if new["sources"].get(n) != old.get("sources", {}).get(n))
    if files:
        changes.append("the sources changed (" + ", ".join(files) + ")")
    for field, what in (("torch", "torch"), ("torch_dir", "torch's location"), ("python", "Python"),
                        ("cxx", "the compiler ($CXX)"), ("cuda", "CUDA"), ("flags", "the flags")):
        if old.get(field) != new[field]:
            changes.append(f"{what} changed ({old.get(field)} -> {new[field]})")
    return ("; ".join(changes) or "its inputs differ") + f" since the last build in this cache, {last}"


def _load_built(so: Path, name: str):
    """Import a built library as is (no ninja, no lock): what a read-only cache allows."""
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _unlocked(so: Path, name: str, why: BaseException):
    """Load without the lock when the library is there, with a warning; else a BuildError naming the path."""
    if not so.is_file():
        raise BuildError(f"{why}; no built library at {so} to load instead. Make {so.parent} writable by this user, "
                         "remove what is in the lock's way, or set FSHARD_OPS_CACHE to a writable directory") from why
    warnings.warn(f"{why}; loading the built library {so} without the lock (nothing is rebuilt). Make "
                  f"{so.parent} writable, or set FSHARD_OPS_CACHE to a writable directory", RuntimeWarning,
                  stacklevel=3)
    return _load_built(so, name)


def _if_read_only(so: Path, name: str, err: BuildError, cause: Optional[BaseException]):
    """The lock opened, but the sources or torch's baton cannot be written (a read-only build directory): load
    the built library without building, as when the lock cannot be opened. Any other failure is raised."""
    if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return _unlocked(so, name, err)
    raise err from cause


def _mark(so: Path) -> Optional[tuple]:
    with contextlib.suppress(OSError):
        st = os.stat(so)
        return st.st_ino, st.st_mtime_ns
    return None


def build(verbose: bool = False):
    """Compile (if needed) and import the extension; returns the module."""
    from torch.utils import cpp_extension

    check_toolchain()
    cuda = want_cuda()
    got = inputs(cuda)
    name = got.name
    build_dir = cache_root() / name
    so = build_dir / f"{name}.so"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _unlocked(so, name, BuildError(f"fshard.ops: cannot create the build directory {build_dir}: "
                                              f"{e.strerror or e}"))
    cflags = list(CFLAGS) + (["-DFSHARD_WITH_CUDA"] if cuda else [])
    t0 = time.perf_counter()
    try:
        with _exclusive(build_dir):
            before = _mark(so)
            if before is None:
                msg = (f"fshard.ops: building native AdamW kernels ({'CPU+CUDA' if cuda else 'CPU'}) into "
                       f"{build_dir}: {_why(build_dir, got)}. This happens once per source version and machine "
                       "and takes about half a minute")
                log.info(msg)
                _say(msg)
            try:
                src = _stage(build_dir, got)
                sources = [str(src / s) for s in CPU_SOURCES + (CUDA_SOURCES if cuda else [])]
                mod = cpp_extension.load(
                    name=name, sources=sources, extra_cflags=cflags, extra_ldflags=list(LDFLAGS),  # (torch appends)
                    extra_cuda_cflags=["-O3", "-DFSHARD_WITH_CUDA"] if cuda else None,
                    extra_include_paths=[str(src)], build_directory=str(build_dir), verbose=verbose,
                )
            except Exception as e:  # compiler errors surface as RuntimeError/CalledProcessError
                raise BuildError(f"fshard.ops: building {name} in {build_dir} failed: {e}") from e
            after = _mark(so)
    except BuildLockError as e:
        return _unlocked(so, name, e)
    except BuildError as e:
        return _if_read_only(so, name, e, e.__cause__)
    except OSError as e:  # the lock's own writes (a stale baton in a read-only directory)
        return _if_read_only(so, name, BuildError(f"fshard.ops: cannot build in {build_dir}: {e}"), e)
    if before is None:
        _say(f"fshard.ops: built in {time.perf_counter() - t0:.0f} s")
    elif after != before:
        _say(f"fshard.ops: ninja rebuilt {so} ({time.perf_counter() - t0:.0f} s): an input outside the sources "
             "changed (a header of torch or the system, or build.ninja was edited)")
    return mod
