# Issue #43, session 25, second call: the CUDA tests after this session's offload changes (a unit's runs in one
# kernel call; the next unit's copies down while the worker updates this one), the native ops' error messages with
# the GPU hidden and visible, what keeps a mesh alive in _exit_runs' failing script on torch 2.11, then the 6.3B
# offload step (moments and master weights in pinned host memory) against FSDP2 CPUOffloadPolicy in the same call
# (the floors: call 1, benchmarks/gpu/s25/floors43c.json). From the repository root with .whl (optree) carried:
# bash benchmarks/gpu/run43d.sh
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); BUDGET=${BUDGET:-270}
. scripts/gpu_setup.sh > /tmp/setup.log 2>&1; grep -v -i warning /tmp/setup.log | tail -3
echo "setup $(( $(date +%s) - T0 )) s"; t0=$(date +%s)
( CUDA_VISIBLE_DEVICES= timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_ops.py -k errors_name > /tmp/ops_hidden.log 2>&1; echo "rc $?" >> /tmp/ops_hidden.log ) &
( timeout 60 python3 tests/_exit_runs.py fails 2 > $OUT/exit_fails.log 2>&1; echo "rc $?" >> $OUT/exit_fails.log ) &
( timeout 80 python3 -m pytest -q -n 2 -p no:cacheprovider tests/test_ops.py -k "cuda or errors_name" > /tmp/ops_gpu.log 2>&1; echo "rc $?" >> /tmp/ops_gpu.log ) &
timeout 90 python3 -m pytest -q -n 4 -p no:cacheprovider --timeout 85 tests/test_cuda.py > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc $? $(( $(date +%s) - t0 )) s"
wait
tail -1 $OUT/cuda_tests.log; grep -E "^(FAILED|ERROR)" $OUT/cuda_tests.log | head; tail -2 /tmp/ops_hidden.log; tail -2 /tmp/ops_gpu.log; grep -v -i warn $OUT/exit_fails.log | tail -5
left=$(( BUDGET - ($(date +%s) - T0) )); echo "offload budget $left s"
timeout $left python3 benchmarks/offload_cuda.py --mode all --all-modes fshard,fsdp2 --pin --timeout $(( left / 2 + 15 )) \
  --timeline $OUT/timeline43d.png --json $OUT/offload43d.json 2>&1 | grep "^\[offload"
echo "offload $(( $(date +%s) - T0 )) s since start"
