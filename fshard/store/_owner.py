"""Store directories die with their process: an owner record in each, a sweep of the dead ones, and SIGTERM.

Each NVMeStore works in its own ``fshard-store-<pid>-XXXXXXXX`` directory and writes ``owner.json`` into it at once:
its pid, the process's start time (field 22 of /proc/<pid>/stat, in clock ticks since boot), the boot id, the pid
namespace, the host name and the user id. A new store sweeps its parent directory: a directory is removed only when
its record is valid, names the pid in the directory's name, was written on this host, in this boot, in this pid
namespace and by this user (the directory is this user's too), and no process with that pid and that start time
runs (a zombie counts as gone: its files are closed). A reused pid has another start time, so it does not keep a
dead owner's directory alive, and a live owner is never mistaken for a dead one. Everything else is left alone: a
directory without a valid record (fshard did not make it, or its owner died before writing it), one of another
machine on a shared filesystem, of another container, or of a boot before this one (there the owner cannot be
told apart from a live process of another machine with the same name). The sweep prints one line naming what it
removed and the bytes it freed.

SIGTERM: the default action kills a process without running atexit, so finalizers never remove its store. While a
store is open, a process whose SIGTERM disposition is the default gets ``TermCleanup`` as its handler (installed
from the main thread only; a handler of the user's, or SIG_IGN, is left as it is). It removes the process's open
store directories and then dies by SIGTERM as before: the default disposition is put back and the signal sent
again, so the exit status is still "killed by signal 15", which is what torchrun and shells read. The handler is
taken out again when the last store closes. Design notes: design/STORE.md, "Cleanup".
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import threading
from typing import Dict, List, Optional

log = logging.getLogger("fshard.store")

PREFIX = "fshard-store-"
OWNER_NAME = "owner.json"
_FIELDS = {"pid": int, "start": int, "boot": str, "pidns": str, "host": str, "uid": int}


def _read(path: str, limit: int = 4096) -> Optional[str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def start_time(pid: int) -> Optional[int]:
    """The start time of process `pid` (clock ticks after boot), or None when no such process runs (or a zombie)."""
    text = _read(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name, in parentheses, may hold spaces and parentheses
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # fields[0] is field 3 (state), fields[19] field 22
        return None
    return int(fields[19])


def this_process() -> Dict[str, object]:
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {"pid": os.getpid(), "start": start_time(os.getpid()) or 0,
            "boot": (_read("/proc/sys/kernel/random/boot_id") or "").strip(), "pidns": pidns,
            "host": socket.gethostname(), "uid": os.geteuid()}


def write_owner(directory: str) -> None:
    """Record this process as `directory`'s owner (written whole, then renamed into place: never half a record)."""
    tmp = os.path.join(directory, OWNER_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(this_process(), f)
    os.rename(tmp, os.path.join(directory, OWNER_NAME))


def owner_of(directory: str) -> Optional[dict]:
    """The owner record in `directory`, or None when there is none or it is not one fshard wrote."""
    text = _read(os.path.join(directory, OWNER_NAME))
    try:
        rec = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(rec, dict) or any(type(rec.get(k)) is not t for k, t in _FIELDS.items()):
        return None
    return rec


def owner_gone(rec: dict, me: Optional[dict] = None) -> bool:
    """Whether the process `rec` names is certainly gone. False for a record of another host, boot, pid namespace
    or user: its process cannot be looked up from here."""
    me = me or this_process()
    if any(rec[k] != me[k] for k in ("host", "boot", "pidns", "uid")) or not me["boot"]:
        return False
    if not rec["start"]:  # its owner could not read its own start time (this_process's 0): no proof either way
        return False
    return start_time(rec["pid"]) != rec["start"]


def _empty(directory: str) -> int:
    """Truncate the files in `directory` to 0 bytes; returns the bytes they held. A dead process's io_uring ring
    keeps its files referenced until the kernel's deferred teardown runs, and an unlinked file's blocks stay in
    use until then; truncated, they come back at once (as _layout's discard does for a live slot). Only a regular
    file with one name is truncated: a hard link's other name (a file fshard did not write) keeps its bytes."""
    total = 0
    with os.scandir(directory) as entries:
        listed = list(entries)
    for e in listed:
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            fd = os.open(e.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    total += st.st_blocks * 512
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        except OSError:
            pass
    return total


def _flat(directory: str) -> bool:
    with os.scandir(directory) as entries:
        return not any(e.is_dir(follow_symlinks=False) for e in entries)


def _remove(directory: str) -> None:
    """Remove a store directory: its files, then itself (sweep leaves one that is not flat alone). A file already
    gone is fine: two new stores may sweep at once."""
    with os.scandir(directory) as entries:
        listed = list(entries)
    for e in listed:
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def sweep(parent: str, own: Optional[str] = None) -> List[str]:
    """Remove the store directories in `parent` whose owner process is gone (see the module docstring); one line
    on stderr names them and the bytes freed. Returns the names removed. Never raises: a store still opens."""
    me, removed, freed = this_process(), [], 0
    try:
        with os.scandir(parent) as listed:
            # own by name: mkdtemp's path may be absolute where `parent` is not (Python >= 3.12)
            mine = os.path.basename(own) if own else None
            entries = [e for e in listed if e.name.startswith(PREFIX) and e.name != mine]
    except OSError as e:
        log.warning("fshard.store: cannot list %s to remove dead processes' stores: %s", parent, e)
        return removed
    for e in entries:
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != me["uid"]:
                continue
            rec = owner_of(e.path)
            if rec is None or not e.name.startswith(f"{PREFIX}{rec['pid']}-") or not owner_gone(rec, me):
                continue
            if not _flat(e.path):  # a store writes no subdirectory: someone else's work is in it, all left as it is
                log.info("fshard.store: left %s: it holds a directory, which no store writes", e.path)
                continue
            n = _empty(e.path)
            _remove(e.path)
        except OSError as err:  # another sweeper got there first, or no permission: not this store's concern
            log.info("fshard.store: left %s: %s", e.path, err)
            continue
        removed.append(f"{e.name} (pid {rec['pid']})")
        freed += n
    if removed:
        msg = (f"fshard.store: removed {len(removed)} store director{'y' if len(removed) == 1 else 'ies'} of dead "
               f"processes in {parent}, {_size(freed)} freed: {', '.join(removed)}")
        log.info(msg)
        print(msg, file=sys.stderr, flush=True)
    return removed


class TermCleanup:
    """The SIGTERM handler of a process with open stores: remove their directories, then die by SIGTERM."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child inherits the handler, not the stores
        self.directories: Dict[str, None] = {}

    def __call__(self, signum, frame) -> None:
        if os.getpid() == self.pid:
            for d in list(self.directories):
                shutil.rmtree(d, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the default action now: the status says "killed by SIGTERM"
        os._exit(128 + signal.SIGTERM)  # not reached


def guard(directory: str) -> Optional[TermCleanup]:
    """Have SIGTERM remove `directory` too, where fshard may: see the module docstring. The handler to give
    `unguard`, or None when SIGTERM is someone else's (or this is not the main thread and none is installed)."""
    h = signal.getsignal(signal.SIGTERM)
    if not (isinstance(h, TermCleanup) and h.pid == os.getpid()):
        fresh = h is signal.SIG_DFL or isinstance(h, TermCleanup)  # (one inherited over fork holds no stores)
        if not fresh or threading.current_thread() is not threading.main_thread():
            return None
        h = TermCleanup()
        signal.signal(signal.SIGTERM, h)
    h.directories[directory] = None
    return h


def unguard(h: Optional[TermCleanup], directory: str) -> None:
    """`directory` is gone; the last one out (in the main thread) puts the default SIGTERM disposition back."""
    if h is None:
        return
    h.directories.pop(directory, None)
    if (not h.directories and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is h):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
