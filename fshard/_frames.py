"""``dynamo_import_collected``: a block after which torch's first import of dynamo, if it happened inside the block,
leaves none of the block's frames behind.

Why: fshard does not import torch._dynamo (design/ARCHITECTURE.md, "What `import fshard` loads"), but torch does, at
the first call of one of its ``torch._disable_dynamo`` wrappers: its optimizers' functional steps,
``torch.utils.checkpoint``, an op on a meta tensor (a model's forward on the meta device in ``step.plan``, dropout or
layer norm; a failed step that reads an unbound parameter). The import runs ``torch.fx.wrap`` at the top level of
torch._dynamo.utils, which keeps ``inspect.currentframe()`` in a local: a frame that holds itself, and through
``f_back`` every frame of whatever imported it (a step's, holding the mesh, the model and the state) until a garbage
collection, which a process with the collector off never runs. So the calls that may import it (a step, an eval
pass: fshard/step/_envelope.py; ``step.plan``) collect once when it was imported inside them: once a process.

A leaf module under every package, as errors.py.
"""
from __future__ import annotations

import gc
import sys


class dynamo_import_collected:
    """``with dynamo_import_collected(): ...``: ``gc.collect()`` at the end of the block (also when it raises) if
    torch._dynamo was first imported inside it."""

    def __enter__(self) -> "dynamo_import_collected":
        self.loaded = "torch._dynamo" in sys.modules
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if not self.loaded and "torch._dynamo" in sys.modules:
            gc.collect()  # (the cycle is unreachable: only the frames the error still holds stay)
        return False
