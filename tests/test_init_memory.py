"""fs.init holds one unit at a time: peak RSS growth during init <= 1.1 x what the rank keeps + 2 x the largest
unit + 64 MiB, for a model built on the meta device and for one already on the CPU, with a weight tied across
units. Measured as VmHWM in a fresh subprocess (peak reset through /proc/self/clear_refs right before fs.init)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = r"""
import json, sys
import torch, torch.nn as nn
import fshard as fs

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

with torch.device(sys.argv[1]):  # 512 MiB of fp32: 32 units of Linear(2048, 2048)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(32)])
model[31].weight = model[0].weight  # tied across units: the root unit owns it
mesh = fs.Mesh(0, 2, "local", torch.device("cpu"))  # rank 0 of 2 (init needs no collective)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = status("VmRSS")
state = fs.init(model, mesh, fs.adamw())
peak = status("VmHWM")
nb = state.nbytes()
print(json.dumps({"growth": peak - before, "kept": nb["params"] + nb["opt_state"] + nb["buffers"],
                  "largest_unit": max(u.nbytes for u in state.spec.units), "units": len(state.spec.units)}))
"""


@pytest.mark.parametrize("where", ["meta", "cpu"])
def test_init_holds_one_unit_at_a_time(where):
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS here (/proc/self/clear_refs: {e})")
    out = subprocess.run([sys.executable, "-c", _PROBE, where], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    bound = 1.1 * m["kept"] + 2 * m["largest_unit"] + 64 * 2**20
    assert m["units"] == 33 and m["kept"] > 700 * 2**20  # 32 blocks and the root; 256 MiB of shard + moments x 2
    assert m["growth"] <= bound, (f"init grew the peak RSS by {m['growth'] / 2**20:.0f} MiB to keep "
                                  f"{m['kept'] / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)")
