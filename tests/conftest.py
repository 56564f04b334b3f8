import os
import sys

import pytest
from hypothesis import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # the example GPT is a test model too
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile("ci", max_examples=100, deadline=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch
    torch.set_num_threads(1)  # many ranks share 2 cores: stay deterministic and avoid oversubscription
