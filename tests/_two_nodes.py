"""One simulated node of tests/test_hsdp.py's two-agent test: run by its own torchrun agent (``--nnodes 2``, c10d
rendezvous on 127.0.0.1), two ranks a node. Trains the awkward model on ``fs.Mesh.from_env()``, whose default
on several nodes is one shard group a node (LOCAL_WORLD_SIZE ranks), replicated across the nodes, beside DDP +
torch.optim.AdamW on the same batches, saves to the checkpoint path both nodes share, and writes what it saw to ``OUT/rank<r>.json``."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fshard as fs  # noqa: E402
from models import oracle_model, oracle_step, param_diffs  # noqa: E402
from test_hsdp import HP, _full_state  # noqa: E402


def main(out: str, ckpt: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    mesh = fs.Mesh.from_env()  # the default: a shard group a node
    explicit = fs.Mesh.from_env(shard_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    model, loss_fn, batches = oracle_model("awkward", 3)
    ref = copy.deepcopy(model)
    ddp = DDP(ref, find_unused_parameters=True)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HP)
    state = fs.init(model, mesh, fs.adamw(**HP, impl="torch"))
    ours, theirs = [], []
    with fs.compose(loss_fn, fs.gather_ahead(1), fs.bucket_reduce(bucket_mb=0.0002)) as step:
        for b in batches(mesh.rank, mesh.world_size):
            state, m = step(state, b)
            ours.append(m["loss"])
            theirs.append(oracle_step(ddp, opt, loss_fn, b, mesh.world_size))
    diffs, _ = param_diffs(fs.full_params(state), ref)
    fs.save(ckpt, state)
    full = _full_state(fs, state)
    with open(os.path.join(out, f"rank{mesh.rank}.json"), "w") as f:
        json.dump({"mesh": repr(mesh), "explicit": repr(explicit).split(", ", 1)[1],
                   "node": int(os.environ["GROUP_RANK"]), "ours": ours, "theirs": theirs,
                   "diff": max(diffs.values()), "replica_bytes": m["comm/replica_bytes"],
                   "full": {k: v.hex() if isinstance(v, bytes) else v for k, v in full.items()}}, f)
    # _full_state's all_gathers are plain torch collectives on gloo: their tensors would be freed by gloo's thread at
    # interpreter exit (std::terminate, design/ARCHITECTURE.md "Exit and teardown"); a script that calls torch's own
    # collectives ends its process group itself
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
