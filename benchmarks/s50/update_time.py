"""The update's own time (``time/update``, median of 50 steps after 10) of a one-rank step of a GPT with many small
parameters (221: dim 64, 18 layers), where the update's Python, not its arithmetic, is the cost: fs.adamw,
gather_ahead(2) + bucket_reduce(25) + mixed_precision(), with and without donate (benchmarks/RESULTS.md, session
50: the runs' views against offsets into the unit's tensors). Prints the fshard checkout it imported, so that two
checkouts can be run in turn:

    PYTHONPATH=<worktree of C>:<worktree of C>/examples .venv/bin/python benchmarks/s50/update_time.py
    PYTHONPATH=examples .venv/bin/python benchmarks/s50/update_time.py
"""
import statistics
import warnings

import torch

import fshard as fs
from gpt import GPT, GPTConfig, loss_fn, synthetic_batches

warnings.simplefilter("ignore")
torch.set_num_threads(1)
cfg = GPTConfig(vocab=256, dim=64, n_layers=18, n_heads=4, seq=32)
out = {}
for donate in (True, False):
    torch.manual_seed(0)
    state = fs.init(GPT(cfg), fs.Mesh.local(), fs.adamw(lr=1e-3, weight_decay=0.1))
    batches = list(synthetic_batches(cfg, 2, 60, seed=0))
    with fs.compose(loss_fn, fs.gather_ahead(2), fs.bucket_reduce(25), fs.mixed_precision(), donate=donate) as step:
        ups = []
        for i, b in enumerate(batches):
            state, m = step(state, b)
            if i >= 10:
                ups.append(m["time/update"])
    out[donate] = statistics.median(ups) * 1e3
print(fs.__file__.split("/fshard/")[0], f"time/update ms: donate {out[True]:.2f}, no donate {out[False]:.2f}; "
      f"loss {float(m['loss']):.6f}")
