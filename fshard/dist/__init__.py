"""Ranks and their collectives: ``Mesh``, the step's ``Comm``, how ranks agree (the check before each collective,
the descriptors every rank raises with), and ``Call``, a collective call outside a step.

Its public names, listed in ``__all__``; the modules behind them are private."""
# torch.distributed.nn's functions take group=group.WORLD as a default argument, evaluated at its import: imported
# after init_process_group (by DCP at the first fs.save, or by dynamo), it would hold the default group, and gloo's
# threads, past destroy_process_group() (the example's ranks then exit 3: tests/test_exit.py). Imported here, before
# any group exists (6 ms).
import torch.distributed.nn  # noqa: F401

from ._mesh import Mesh

__all__ = ["Mesh"]
