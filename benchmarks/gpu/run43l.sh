# Issue #43, session 50, third call: tests/test_cuda.py again after the fixes of this session (the ranks' forkserver
# no longer preloads torch.utils.cpp_extension on a CUDA build, which poisoned every forked rank's CUDA; the one-rank
# copy count as the slot gradients make it), and the CPU tests that failed on torch 2.11 (test_pool, the one-rank
# process group), with the GPU hidden. With .whl and .gpu carried:  bash benchmarks/gpu/run43l.sh   (about 3 minutes)
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s)
. scripts/gpu_setup.sh > $OUT/setup3.log 2>&1; grep -v -i warning $OUT/setup3.log | tail -2
echo "setup $(( $(date +%s) - T0 )) s"
( CUDA_VISIBLE_DEVICES= timeout 100 python3 -m pytest -q -n 2 -p no:cacheprovider --timeout 90 tests/test_pool.py \
  "tests/test_one_rank.py::test_a_one_rank_process_group_issues_no_collective" > $OUT/cpu_fixed.log 2>&1;
  echo "rc $?" >> $OUT/cpu_fixed.log ) &
timeout 150 python3 -m pytest -q -n 4 -p no:cacheprovider --timeout 140 -rfE tests/test_cuda.py > $OUT/cuda_tests3.log 2>&1
echo "cuda tests rc $? $(( $(date +%s) - T0 )) s"; wait
tail -1 $OUT/cuda_tests3.log; grep -E "^(FAILED|ERROR)" $OUT/cuda_tests3.log | head; tail -2 $OUT/cpu_fixed.log
echo "call $(( $(date +%s) - T0 )) s"
