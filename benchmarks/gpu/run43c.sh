# Issue #43, session 25, first call: the whole suite on the GPU machine (torch 2.11 there; the CPU tests with the
# GPU hidden, tests/test_cuda.py on it, at once), then the host update's probe (offload_cuda.py --mode floors).
# From the repository root with .whl (optree, transformers and tokenizers at the pins of pyproject.toml) and .gpu
# (tensornvme's sdist, liburing, libaio) carried: bash benchmarks/gpu/run43c.sh
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi -L; nproc; free -g | head -2; t0=$(date +%s)
. scripts/gpu_setup.sh > /tmp/setup.log 2>&1; grep -v -i warning /tmp/setup.log | tail -6
CUDA_VISIBLE_DEVICES= python3 -c "import fshard.ops as o; print('cpu-only build', o.backend_info()['backend'])" 2>&1 | tail -1
python3 -c "import transformers, tokenizers, hypothesis; print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'hypothesis', hypothesis.__version__)"
echo "setup $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
( timeout ${CUDA_S:-150} python3 -m pytest -q -n 4 -p no:cacheprovider --timeout 140 tests/test_cuda.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc $? after $(( $(date +%s) - t0 )) s" >> $OUT/cuda_tests.log ) &
CUDA_VISIBLE_DEVICES= timeout ${SUITE_S:-300} python3 -m pytest -v -n ${WORKERS:-12} -p no:cacheprovider --timeout 250 \
  --ignore=tests/test_cuda.py -rfE tests/ > $OUT/suite_cpu.log 2>&1
echo "cpu suite rc $? after $(( $(date +%s) - t0 )) s"
wait
grep -E "passed|failed|error" $OUT/suite_cpu.log | tail -3
grep -E "^(FAILED|ERROR)" $OUT/suite_cpu.log | head -40
tail -4 $OUT/cuda_tests.log
t0=$(date +%s)
timeout ${PROBE_S:-90} python3 benchmarks/offload_cuda.py --mode floors --json $OUT/floors43c.json 2>&1 | grep "^\[offload"
echo "floors $(( $(date +%s) - t0 )) s"
