"""Run a function on N local ranks (processes) over gloo, as torchrun would, and collect what each returns."""
from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, timeout_s):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FSHARD_TIMEOUT_S=str(timeout_s))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = TIMEOUT_S, collective_timeout_s: float = 60):
    """fn(*args) on every rank (after env set-up; fn calls fs.Mesh.from_env()). Returns results in rank order;
    raises with the rank's traceback if any rank failed, and fails (never hangs) after ``timeout_s``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, collective_timeout_s),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout_s)
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]
