import os
import subprocess
import sys

import pytest
from hypothesis import settings

# no test reaches the Hugging Face Hub (the HF models are built from configs); set before anything imports
# transformers, which reads it once, so that the ranks' forkserver can import transformers ahead (tests/_dist.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # the example GPT is a test model too
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile("ci", max_examples=100, deadline=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch
    torch.set_num_threads(1)  # many ranks share 2 cores: stay deterministic and avoid oversubscription


def _mount_tmpfs(path, options):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (mount -t tmpfs); run the suite as root to exercise this fault")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs -o {options} failed: {r.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs mount point (read-only, tiny...), unmounted after the test."""
    mounted = []

    def mount(options):
        path = tmp_path / f"mnt{len(mounted)}"
        path.mkdir()
        _mount_tmpfs(path, options)
        mounted.append(path)
        return path

    yield mount
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], check=False)
