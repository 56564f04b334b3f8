#!/usr/bin/env bash
# Idempotent set-up: .venv, torch 2.13.0 (CPU wheel), Debian I/O libraries, tensornvme, fshard itself.
# Each step is skipped when its result is already there, so running this twice costs a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0
MATPLOTLIB_VERSION=3.11.2  # draws fs.timeline's PNG (imported only there); needs no torch
TRANSFORMERS_VERSION=5.23.0  # test dependency (tests/test_hf_*.py); torch is an optional extra, so 2.13.0 stays
TOKENIZERS_VERSION=0.23.3  # the example's BPE (examples/data.py); the version transformers installs with it
TENSORBOARD_VERSION=2.21.0  # torch.utils.tensorboard's writer (examples/train_gpt.py); it needs no torch

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$PWD/$VENV/bin/python"
pip_install() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }
# have DIST [VERSION]: the venv has that distribution installed (at VERSION, or VERSION+local such as torch's +cpu).
# Read from the installed metadata, not by importing it: importing torch, tensornvme and fshard to check they are
# there took 14 of this script's 17 s on every make test.
have() {
  "$VPY" - "$@" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
try:
    v = m.version(sys.argv[1])
except m.PackageNotFoundError:
    sys.exit(1)
want = sys.argv[2] if len(sys.argv) > 2 else None
sys.exit(0 if want is None or v == want or v.startswith(want + "+") else 1)
PY
}

# torch first and pinned: anything that later asks for "torch" must find 2.13.0 already satisfied, or pip
# would resolve the newest CUDA build (several GB).
if ! have torch "$TORCH_VERSION"; then
  echo "[bootstrap] installing torch==$TORCH_VERSION"
  if ls /opt/wheels/torch-${TORCH_VERSION}*.whl >/dev/null 2>&1; then
    pip_install --find-links /opt/wheels "torch==$TORCH_VERSION"
  else
    pip_install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
      || pip_install "torch==$TORCH_VERSION"
  fi
fi

if ! "$VPY" -c "import optree, hypothesis, pytest, tqdm, numpy, ninja, xdist, pytest_timeout" 2>/dev/null; then
  echo "[bootstrap] installing python dependencies"
  pip_install packaging setuptools wheel click ninja numpy optree hypothesis pytest pytest-xdist pytest-timeout tqdm
fi

# One pinned package: installed unless the venv already has exactly that version.
pinned() {  # pinned PACKAGE VERSION
  if ! have "$1" "$2"; then
    echo "[bootstrap] installing $1==$2"
    pip_install "$1==$2"
  fi
}
pinned matplotlib "$MATPLOTLIB_VERSION"
pinned transformers "$TRANSFORMERS_VERSION"  # without the [torch] extra: it would ask for accelerate
pinned tokenizers "$TOKENIZERS_VERSION"
pinned tensorboard "$TENSORBOARD_VERSION"

have_deb() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
if ! have_deb liburing-dev || ! have_deb libaio-dev; then
  echo "[bootstrap] installing liburing-dev libaio-dev"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q liburing-dev libaio-dev
fi

if ! have tensornvme; then
  echo "[bootstrap] building tensornvme (about a minute)"
  WITH_ROOT=1 LIBRARY_PATH=/usr/lib/x86_64-linux-gnu "$VPY" -m pip install --disable-pip-version-check -q \
    --no-build-isolation tensornvme
fi

# fshard editable from this checkout: found (not imported) from /, so that the checkout itself does not satisfy it,
# and where it points (a venv copied from another checkout, or left by a deleted one, points elsewhere)
if [ "$(cd / && "$VPY" -c "import importlib.util as u; s = u.find_spec('fshard'); print(s.origin if s else '')" \
      2>/dev/null)" != "$PWD/fshard/__init__.py" ]; then
  echo "[bootstrap] installing fshard (editable)"
  pip_install --no-build-isolation --no-deps -e .
fi

# The checkout's bytecode, written here once. Where PYTHONDONTWRITEBYTECODE is set (this kind of machine sets it),
# Python compiles fshard, the examples and the tests again in every fresh interpreter (0.4-0.9 s each, and the suite
# starts about 80: torchrun's ranks, probes); compileall writes __pycache__ (git-ignored) whatever that says, and
# skips what is up to date, so a second run only reads the files' times.
"$VPY" -m compileall -q fshard examples tests benchmarks >/dev/null
