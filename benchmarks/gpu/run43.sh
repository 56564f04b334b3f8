# Issue #43 on a lent GPU machine, one call: set-up, the CUDA tests, the offload runs (floors, fshard with moments
# and master weights on the host, FSDP2 CPUOffloadPolicy). Run from the repository root with .whl carried:
#   bash benchmarks/gpu/run43.sh          (files land in $OUT)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/examples:$PWD FSHARD_OPS_CACHE=/tmp/fshard_ops MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi -L; nproc; free -g | head -2; uptime
t0=$(date +%s)
python3 -c "import torch, fshard.ops as o; i=o.backend_info(); print('torch', torch.__version__, {k: i[k] for k in ('backend','cpu_isa','cuda','error')})" 2>&1 | tail -3
echo "build $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${TESTS_S:-170} python3 -m pytest -q -n 4 -p no:cacheprovider --timeout 160 tests/test_cuda.py 2>&1 | tee $OUT/cuda_tests.log | tail -25
echo "tests $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${OFFLOAD_S:-400} python3 benchmarks/offload_cuda.py --mode all --timeout ${MODE_S:-180} --json $OUT/offload43.json 2>&1 | tee $OUT/offload43.log | grep -v Warning | tail -40
echo "offload $(( $(date +%s) - t0 )) s"
