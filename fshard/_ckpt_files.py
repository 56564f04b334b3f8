"""The files of a checkpoint directory: its manifest, the rename that makes it visible, rotation, and the checks
that find a damaged file before DCP reads it.

A save writes into ``<path>.partial``; once DCP has written its metadata (last, after every rank's data), rank 0
writes ``fshard.json`` (the step, the layout, and the size and CRC-32 of every file, which the ranks compute in
shares) and renames: ``<path>`` to ``<path>.old``, ``.partial`` to ``<path>``, fsync of the directory, ``.old``
removed. A checkpoint is so visible only complete, and a save killed at any point leaves the previous one loadable:
``_complete`` skips ``.partial`` and takes ``.old`` only where its base name is missing (killed between renames).
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import time
import zlib
from pathlib import Path

import torch.distributed as dist

from ._errors import CheckpointError

FORMAT = 1
MANIFEST = "fshard.json"


def barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


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


def prepare(tmp: Path, rank: int, group) -> None:
    """Rank 0 empties ``tmp`` (a save killed earlier may have left it); every rank waits for it."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(group)


def commit(tmp: Path, path: Path, layout: dict, rank: int, world_size: int, group, keep_last: int | None) -> None:
    """Collective: the manifest (each rank sums a share of the files), then rank 0 renames ``tmp`` to ``path``
    (module docstring) and rotates; every rank returns once ``path`` is visible."""
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    mine = {n: crc(tmp / n) for n in files[rank::world_size]}
    sums = [mine]
    if group is not None:
        sums = [None] * world_size
        dist.all_gather_object(sums, mine, group=group)
    if rank == 0:
        manifest = {**layout, "time": time.time(), "files": {k: v for d in sums for k, v in d.items()}}
        _write_json(tmp / MANIFEST, manifest)
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last is not None:
            for p in complete(path.parent)[:-keep_last]:
                shutil.rmtree(p, ignore_errors=True)
    barrier(group)


def manifest(path: Path) -> dict | None:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if (path / ".metadata").is_file() and isinstance(m, dict) and "step" in m else None


def complete(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (by step, then time)."""
    found = []
    for p in Path(directory).iterdir() if Path(directory).is_dir() else []:
        if p.name.endswith(".old") and p.with_name(p.name[:-4]).exists():
            continue  # the replaced version of a checkpoint that exists (a save killed between its two renames
        m = manifest(p) if p.is_dir() and not p.name.endswith(".partial") else None  # leaves only the .old)
        if m is not None:
            found.append((m["step"], m.get("time", 0.0), p))
    return [p for *_, p in sorted(found)]


def latest(directory) -> str | None:
    """The newest complete checkpoint (the highest step) that ``fs.save`` wrote into ``directory``, or None. A save
    still in progress, or one killed, is never returned."""
    found = complete(Path(directory))
    return str(found[-1]) if found else None


def verify(path: Path, mesh) -> dict:
    """The manifest, after each rank checked a share of the files' sizes and CRCs; raises naming a bad file."""
    m = manifest(path)
    if m is None:
        raise CheckpointError(f"fs.load: {path} is not a complete fshard checkpoint (no .metadata or {MANIFEST}); "
                              f"a save that was interrupted leaves <path>.partial instead. fs.latest(directory) "
                              "finds the newest complete one.")
    names = sorted(m["files"])
    bad = []
    for n in names[mesh.rank::mesh.world_size]:
        try:
            got = crc(path / n)
        except OSError as e:
            bad.append(f"{path / n}: {e.strerror}")
            continue
        if got != m["files"][n]:
            what = "truncated or extended" if got[0] != m["files"][n][0] else "corrupted (CRC-32 mismatch)"
            bad.append(f"{path / n}: {what}, {got[0]:,} bytes against {m['files'][n][0]:,} written")
    if mesh.group is not None:
        every = [None] * mesh.world_size
        dist.all_gather_object(every, bad, group=mesh.group)
        bad = [b for r in every for b in r]
    if bad:
        raise CheckpointError("fs.load: damaged checkpoint file(s): " + "; ".join(bad) + ". Load an earlier "
                              "checkpoint (fs.latest skips none that are complete; pass another path).")
    return m
