"""What ``import fshard`` loads, and what torch's own later import of dynamo leaves behind (design/ARCHITECTURE.md,
"What `import fshard` loads, and when dynamo and DCP come"). Each check runs in a fresh interpreter: in the test
process, earlier tests have imported dynamo and DCP already, and the first import is what is tested."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _fresh(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


_LOADS = r"""
import sys, torch
import fshard as fs
heavy = ("torch._dynamo", "torch.distributed.checkpoint")
print([m for m in heavy if m in sys.modules], "torch.distributed.nn" in sys.modules)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
state = fs.init(m, fs.Mesh.local(), fs.adamw(impl="torch"), units=[m[0], m[1]])
with fs.compose(lambda mod, x: mod(x).sum()) as step:
    state, _ = step(state, torch.randn(2, 4))
print([m for m in heavy if m in sys.modules])
print(fs.save.__module__, [m for m in heavy if m in sys.modules])
"""


def test_import_fshard_loads_neither_dynamo_nor_dcp_and_fshards_own_step_does_not_either():
    """DCP loads at the first checkpoint name; fshard imports dynamo only under torch.compile (torch may import it
    itself: below). torch.distributed.nn is imported at once, before any process group exists, because it takes
    the default group as a default argument when it is imported."""
    assert _fresh(_LOADS) == ["[] True", "[]", "fshard.checkpoint._save ['torch.distributed.checkpoint']"]


_CYCLE = r"""
import gc, sys, weakref, torch
import fshard as fs
gc.disable()

def run(how):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Dropout(0.1),
                                torch.nn.Linear(8, 8))
    mesh = fs.Mesh.local()
    state = fs.init(model, mesh, fs.adamw(impl="torch"), units=[model[0], model[3]])

    def loss_fn(m, x):
        if how == "step":  # an op on a meta tensor: torch imports dynamo here, inside the step
            torch.empty(2, device="meta").normal_()
        return m(x).sum()

    with fs.compose(loss_fn) as step:
        if how == "plan":  # its forward on the meta device (layer norm, dropout) imports dynamo
            step.plan(state, torch.randn(4, 8))
        else:
            state, _ = step(state, torch.randn(4, 8))
    return weakref.ref(mesh), weakref.ref(model), weakref.ref(state)

mesh, model, state = run(sys.argv[1])
print("torch._dynamo" in sys.modules, [r() is None for r in (mesh, model, state)])
"""


@pytest.mark.parametrize("how", ["step", "plan"])
def test_torchs_first_import_of_dynamo_inside_a_call_keeps_nothing_alive_with_the_collector_off(how):
    """torch.fx.wrap, run by the import, keeps its own frame in a local, a cycle holding every frame of the call
    that imported dynamo; fshard/_frames.py collects it at the end of that call. Without it, the mesh, the model
    and the state outlive the call (checked by hand: True [False, False, False])."""
    assert _fresh(_CYCLE.replace("sys.argv[1]", repr(how))) == ["True [True, True, True]"]
