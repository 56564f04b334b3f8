"""The files of a checkpoint directory: its manifest, the rename that makes it visible, rotation, and the checks
that find a damaged file before DCP reads it.

A save writes into ``<path>.partial``, which rank 0 makes with a marker file (``fshard.partial``, a random token);
once DCP has written its metadata (last, after every rank's data), rank 0 writes ``fshard.json`` (the format, the
step, the layout, the series, and the size and CRC-32 of every file, which the ranks compute in shares) and
renames: ``<path>`` to ``<path>.old``, ``.partial`` to ``<path>``, fsync of the directory, ``.old`` removed. A
checkpoint is so visible only complete, and a save killed at any point leaves the previous one loadable:
``complete`` skips ``.partial`` and takes ``.old`` only where its base name is missing (killed between renames).

Nothing fshard did not write is deleted: a save refuses a ``<path>`` that exists and is neither an fshard checkpoint
nor an empty directory, and a ``.partial`` or ``.old`` without fshard's marker or manifest (``check_target``);
rotation deletes only complete checkpoints of the same series (``series``: the name with its numbers taken as
any number, recorded in the manifest), never the one just written; a failed save removes its own ``.partial``
(``discard``, by its token).
"""
from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import time
import uuid
import zlib
from pathlib import Path

import torch

from ..errors import CheckpointError

FORMAT = 1  # the manifest's format: fs.load refuses a newer one
MANIFEST = "fshard.json"
MARKER = "fshard.partial"  # in a .partial only: fshard made it (its token: which save)
_STATUS = ("ok", "missing", "truncated or extended", "corrupted (CRC-32 mismatch)")


def crc(p: Path) -> list[int]:
    """[size, CRC-32] of a file, read through memory maps of 16 MiB windows: no copy (zlib releases the GIL over
    each), and a mapped window counts in RSS only until it is unmapped."""
    value, size, window = 0, p.stat().st_size, 1 << 24
    with open(p, "rb") as f:
        for lo in range(0, size, window):
            with mmap.mmap(f.fileno(), min(window, size - lo), offset=lo, access=mmap.ACCESS_READ) as m:
                value = zlib.crc32(m, value)
    return [size, value]


def _write_json(p: Path, obj) -> None:
    with open(p, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest(path: Path) -> dict | None:
    """The manifest of a complete fshard checkpoint at ``path``, or None (not one: no ``.metadata``, no manifest,
    or one that is not fshard's)."""
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(m, dict) and isinstance(m.get("step"), int) and isinstance(m.get("format"), int)
          and isinstance(m.get("world_size"), int) and m["world_size"] >= 1 and isinstance(m.get("files"), dict))
    return m if ok and (path / ".metadata").is_file() else None


def series(name: str) -> str:
    """The series a checkpoint name belongs to: its runs of digits taken as any number (``step-00000009`` and
    ``step-00000010``: ``step-<n>``; ``step5b`` is ``step<n>b``, another series)."""
    return re.sub(r"\d+", "<n>", name)


def _in_series(p: Path, m: dict, pattern: str) -> bool:
    return m.get("series") == pattern and series(p.name.removesuffix(".old")) == pattern


def check_target(path: Path) -> None:
    """Refuse a save to ``path`` that would delete what fshard did not write."""
    tmp, old = path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")
    if path.exists() and manifest(path) is None and not (path.is_dir() and not any(path.iterdir())):
        what = (f"a directory holding {', '.join(sorted(p.name for p in path.iterdir())[:5])}"
                f"{', ...' if len(list(path.iterdir())) > 5 else ''}" if path.is_dir() else "a file")
        raise CheckpointError(f"fs.save: {path} exists and is not an fshard checkpoint ({what}); fs.save replaces "
                              "only a checkpoint it wrote, so nothing was written or deleted. Save into a new path, "
                              f"e.g. fs.save({str(path / 'step-00000100')!r}, state), or move {path} away.")
    if old.exists() and manifest(old) is None:
        raise CheckpointError(f"fs.save: {old} exists and is not an fshard checkpoint; a save to {path} would "
                              "delete it. Move it away, or save to another path.")
    if tmp.exists() and not (tmp / MARKER).is_file():
        raise CheckpointError(f"fs.save: {tmp} exists and was not made by fs.save (no {MARKER} in it); a save to "
                              f"{path} writes there first and would delete it. Move it away, or save to another "
                              "path.")


def start(tmp: Path) -> str:
    """Rank 0: a fresh ``tmp`` with a new marker (a ``.partial`` a killed save left, with fshard's marker, is
    removed first: ``check_target`` refused any other)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mine = uuid.uuid4().hex
    (tmp / MARKER).write_text(json.dumps({"token": mine}))  # (no fsync: a save killed before its commit is redone)
    return mine


def token(tmp: Path) -> str:
    """The token in ``tmp``'s marker (which save made it); every rank must read the same one."""
    try:
        return json.loads((tmp / MARKER).read_text())["token"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def discard(tmp: Path, mine: str) -> None:
    """Rank 0, after a failed save: remove ``tmp`` if it is still this save's. Renamed away first, at once: the
    other ranks may already be checking the target of their next save (``check_target``) and must never see a
    ``.partial`` half removed, without its marker."""
    if mine and token(tmp) == mine:
        gone = tmp.with_name(f".{tmp.name}.{mine}.removed")
        try:
            tmp.rename(gone)
        except OSError:
            return
        shutil.rmtree(gone, ignore_errors=True)


def data_files(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name not in (MARKER, MANIFEST))


def crc_share(d: Path, names: list[str], rank: int, world_size: int, expect: dict | None = None) -> torch.Tensor:
    """This rank's share of [size, CRC-32] for each file (zero elsewhere, so a sum over ranks has them all); with
    ``expect`` (a manifest's files), [status, size] instead (``_STATUS``: 0 where the file is as written)."""
    out = torch.zeros(2 * len(names), dtype=torch.int64)
    for i in range(rank, len(names), world_size):
        if expect is None:
            out[2 * i:2 * i + 2] = torch.tensor(crc(d / names[i]))
            continue
        try:
            got = crc(d / names[i])
        except OSError:
            out[2 * i] = 1
            continue
        if got != list(expect[names[i]]):
            out[2 * i:2 * i + 2] = torch.tensor([2 if got[0] != expect[names[i]][0] else 3, got[0]])
    return out


def commit(tmp: Path, path: Path, layout: dict, names: list[str], sums: torch.Tensor, mine: str,
           keep_last: int | None) -> None:
    """Rank 0: the manifest, then the renames (module docstring), then rotation."""
    if token(tmp) != mine:
        raise CheckpointError(f"fs.save: {tmp} was replaced while this save wrote it: another process saves to "
                              f"{path} at the same time. Give each save its own path.")
    files = {n: sums[2 * i:2 * i + 2].tolist() for i, n in enumerate(names)}
    old = path.with_name(path.name + ".old")
    try:
        _write_json(tmp / MANIFEST, {**layout, "series": series(path.name), "time": time.time(), "files": files})
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)  # (check_target: an fshard checkpoint, or nothing)
            path.rename(old)
        tmp.rename(path)
        (path / MARKER).unlink()  # (after the rename: a .partial is never seen without its marker)
    except OSError as e:
        if old.exists() and not path.exists():
            old.rename(path)  # (the rename of tmp failed: the previous one back)
        raise CheckpointError(f"fs.save: committing {tmp} failed ({e.strerror or e}); {path} is unchanged.") from e
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        pattern = series(path.name)
        others = [p for p in complete(path.parent) if p != path and _in_series(p, manifest(p), pattern)]
        for p in others[:max(0, len(others) - (keep_last - 1))]:
            shutil.rmtree(p, ignore_errors=True)  # (a failure to delete leaves a complete checkpoint, no error)


def complete(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first: by the time their save committed (the manifest's,
    rank 0's clock), then by step."""
    found = []
    for p in Path(directory).iterdir() if Path(directory).is_dir() else []:
        if p.name.endswith(".old") and p.with_name(p.name[:-4]).exists():
            continue  # the replaced version of a checkpoint that exists (a save killed between its two renames
        m = manifest(p) if p.is_dir() and not p.name.endswith(".partial") else None  # leaves only the .old)
        if m is not None:
            found.append((float(m.get("time", 0.0)), m["step"], p))
    return [p for *_, p in sorted(found)]


def latest(directory, *, mesh=None) -> str | None:
    """The checkpoint that ``fs.save`` committed last into ``directory`` (its manifest's time; equal times: the
    higher step), or None. A save still in progress, or one killed, is never returned; nor is anything that is not
    an fshard checkpoint. ``mesh=``: a collective: every rank gets the same answer, or every rank raises (ranks
    that see different checkpoints: the directory is not on a filesystem every rank shares)."""
    def scan():
        found = complete(Path(directory))
        return str(found[-1]) if found else None
    if mesh is None:
        return scan()
    from ..dist._call import Call
    return Call(mesh, "fs.latest").run(f"the scan of {directory}", scan, same=lambda r: r, differ=(
        "Every rank must see the same checkpoints: put the directory on a filesystem every rank shares, and call "
        "fs.latest after the saves that write into it have returned."))


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint at ``path``; raises if there is none, or if its format is newer than this
    fshard reads."""
    m = manifest(path)
    if m is None:
        raise CheckpointError(f"fs.load: {path} is not a complete fshard checkpoint (no .metadata or {MANIFEST}); "
                              f"a save that was interrupted leaves <path>.partial instead. fs.latest(directory) "
                              "finds the newest complete one.")
    if m["format"] > FORMAT:
        raise CheckpointError(f"fs.load: {path} is in checkpoint format {m['format']}, newer than this fshard "
                              f"reads (format {FORMAT} and older); upgrade fshard to load it.")
    return m


def check_files(path: Path, m: dict, call) -> None:
    """Each rank checks a share of the manifest's files (size and CRC); one all-reduce of the statuses, so every
    rank raises the same ``CheckpointError`` naming each bad file. (That the list is whole, ``.metadata`` and every
    data file in it, fshard/checkpoint/_read.py's ``check_consistent`` checks once the metadata is read.)"""
    names = sorted(m["files"])
    mesh = call.mesh
    status = call.all_reduce(call.run("its file checks", lambda: crc_share(path, names, mesh.rank, mesh.world_size,
                                                                            m["files"])),
                             f"the file checks of {path}").tolist()
    bad = [f"{path / n}: {_STATUS[status[2 * i]]}" + (f", {status[2 * i + 1]:,} bytes against "
                                                         f"{m['files'][n][0]:,} written" if status[2 * i] > 1 else "")
           for i, n in enumerate(names) if status[2 * i]]
    if bad:
        raise CheckpointError("fs.load: damaged checkpoint file(s): " + "; ".join(bad) + ". Load an earlier "
                              "checkpoint (fs.latest skips none that are complete; pass another path).")
