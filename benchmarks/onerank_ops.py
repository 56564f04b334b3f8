"""Data movement of one training step at world size 1 (issue #42): how many ``aten::copy_``, ``aten::cat``,
``aten::clone`` and casts (``aten::_to_copy``) one step issues, and the bytes they write, for plain torch and for
fshard. Counted with a ``TorchDispatchMode`` (every aten op below autograd, backward included), not timed: the
counts do not depend on the machine's load, so they can be compared between commits on a shared machine. With a
process group (``--mesh gloo``) the torch.distributed collectives a step issues are counted too.

    .venv/bin/python benchmarks/onerank_ops.py                        # 27.4M GPT, fp32 and bf16, Mesh.local()
    .venv/bin/python benchmarks/onerank_ops.py --tiny --mesh gloo     # a gloo process group of one rank

Configs: ``torch`` (the plain loop: AdamW(fused=True), zero_grad(set_to_none=True)), ``fshard`` (donate=False),
``fshard+donate``, ``+ahead+buckets+donate`` (gather_ahead(2), bucket_reduce(25)), and unless ``--no-bf16`` their
mixed-precision peers (torch under CPU autocast, fshard with ``fs.mixed_precision()``; ``+donate-copies``: with
``param_copies=False``, each gather casting the fp32 shard). Each config runs ``--warmup`` steps, then counts one.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpt import GPT, GPTConfig, loss_fn, synthetic_batches  # noqa: E402

WATCHED = ("aten.copy_.default", "aten.cat.default", "aten.clone.default", "aten._to_copy.default")


class Count(TorchDispatchMode):
    """Per watched op: calls and bytes written (its output's, for ``copy_`` its destination's)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in WATCHED:
            t = args[0] if name == "aten.copy_.default" else out
            self.calls[name] += 1
            self.bytes[name] += t.numel() * t.element_size()
        return out


COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce", "all_to_all_single")


class Collectives:
    """torch.distributed collectives issued while it is entered (with a process group: ``--mesh gloo``)."""

    def __enter__(self):
        import torch.distributed as dist
        self.calls, self._saved = 0, {n: getattr(dist, n) for n in COLLECTIVES}
        for n, f in self._saved.items():
            setattr(dist, n, self._counted(f))
        return self

    def _counted(self, f):
        def call(*args, **kwargs):
            self.calls += 1
            return f(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        import torch.distributed as dist
        for n, f in self._saved.items():
            setattr(dist, n, f)


def torch_loop(cfg, batches, bf16: bool):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
    return step


def fshard_loop(cfg, batches, bf16: bool, donate: bool, mesh_kind: str, ahead: bool = False,
                copies: bool = True):
    import fshard as fs

    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = fs.Mesh.local() if mesh_kind == "local" else fs.Mesh.from_env()
    state = fs.init(model, mesh, fs.adamw(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1))
    transforms = (fs.gather_ahead(2), fs.bucket_reduce(25)) if ahead else ()
    transforms += (fs.mixed_precision(param_copies=copies),) if bf16 else ()
    step_fn = fs.compose(loss_fn, *transforms, donate=donate)
    holder = {"state": state}

    def step(batch):
        holder["state"], _ = step_fn(holder["state"], batch)
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="GPTConfig.tiny() instead of the 27.4M GPT")
    p.add_argument("--mesh", choices=("local", "gloo"), default="local",
                   help="fs.Mesh.local() (no process group) or a gloo group of one rank (benchmarks/step.py's)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--no-bf16", action="store_true", help="fp32 only")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.mesh == "gloo":
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        import socket
        with socket.socket() as sock:  # a free port (other runs may share the machine)
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = GPTConfig.tiny() if args.tiny else GPTConfig()
    batches = list(synthetic_batches(cfg, args.batch_size, args.warmup + 1, 0))
    n = sum(p.numel() for p in GPT(cfg, device="meta").parameters())
    print(f"GPT {n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB fp32), batch {args.batch_size}, "
          f"mesh {args.mesh}")
    print(f"{'config':<27}" + "".join(f"{w.split('.')[1]:>22}" for w in WATCHED) + f"{'collectives':>14}   (calls / MiB written)")
    for bf16 in (False,) if args.no_bf16 else (False, True):
        configs = {"torch": lambda: torch_loop(cfg, batches, bf16)}
        configs["fshard"] = lambda: fshard_loop(cfg, batches, bf16, False, args.mesh)
        configs["fshard+donate"] = lambda: fshard_loop(cfg, batches, bf16, True, args.mesh)
        configs["+ahead+buckets+donate"] = lambda: fshard_loop(cfg, batches, bf16, True, args.mesh, ahead=True)
        if bf16:  # gathers that cast the fp32 shard (FSDP2's way) instead of sending the bf16 copies
            configs["+donate-copies"] = lambda: fshard_loop(cfg, batches, bf16, True, args.mesh, copies=False)
        for name, make in configs.items():
            step = make()
            for b in batches[:args.warmup]:
                step(b)
            with Count() as c, Collectives() as d:
                step(batches[args.warmup])
            label = name + (" bf16" if bf16 else "")
            print(f"{label:<27}" + "".join(f"{c.calls[w]:>10} / {c.bytes[w] / 2**20:>8.1f}" for w in WATCHED)
                  + f"{d.calls:>14}")


if __name__ == "__main__":
    main()
