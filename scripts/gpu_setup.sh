# Source this on a lent GPU machine (the device tool), from the repository root: it installs what the machine's
# image lacks into /tmp/site (optree from .whl/, tensornvme built against .gpu/tnv's liburing and libaio), puts the
# checkout on PYTHONPATH and builds fshard.ops with its CUDA kernel. Prepare here first (x86-64, Python 3.12 there):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl optree==0.20.0
#   pip download --no-deps --no-binary :all: -d .gpu tensornvme==0.1.0
#   mkdir -p .gpu/tnv/lib .gpu/tnv/include; cp /usr/lib/x86_64-linux-gnu/{liburing.a,libaio.a,libaio.so*} .gpu/tnv/lib
#   cp -r /usr/include/{liburing.h,liburing,libaio.h} .gpu/tnv/include
# and carry [".whl", ".gpu"]. Results of such runs: benchmarks/RESULTS.md, "GPU".
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/examples:$PWD
export FSHARD_OPS_CACHE=/tmp/fshard_ops MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
if [ -f .gpu/tensornvme-0.1.0.tar.gz ] && ! python3 -c "import tensornvme" 2>/dev/null; then
  mkdir -p /tmp/tnvhome/.tensornvme && cp -r .gpu/tnv/* /tmp/tnvhome/.tensornvme/
  tar xzf .gpu/tensornvme-0.1.0.tar.gz -C /tmp
  (cd /tmp/tensornvme-0.1.0 && HOME=/tmp/tnvhome python3 -m pip install -q --no-build-isolation --no-deps \
     --target /tmp/site . > /tmp/tnv_build.log 2>&1) || { echo "tensornvme build failed:"; tail -20 /tmp/tnv_build.log; }
fi
export LD_LIBRARY_PATH=/tmp/tnvhome/.tensornvme/lib:${LD_LIBRARY_PATH:-}
python3 - <<'PY'
import torch, fshard.ops as ops
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
info = ops.backend_info()
print("fshard.ops:", {k: info[k] for k in ("backend", "cpu_isa", "cuda", "error")})
try:
    import tensornvme  # noqa: F401
    print("tensornvme: ok")
except ImportError as e:
    print("tensornvme: missing", e)
PY
