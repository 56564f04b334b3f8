# Issue #43, session 29's second call: the whole suite on the GPU machine (session 26: 809 passed, 1 failed, the
# exit script's mesh kept by a Python 3.12 generator cycle, fixed on main since and not rerun there). With .whl and
# .gpu carried:   BUDGET=... bash benchmarks/gpu/run43i.sh   (BUDGET seconds, 300-400)
# - tests/_exit_runs.py's three scripts with the GPU hidden (the diagnosis prints what holds a left mesh);
# - tests/test_cuda.py on the GPU, beside the whole CPU suite with the GPU hidden.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); BUDGET=${BUDGET:-360}
. scripts/gpu_setup.sh > $OUT/setup2.log 2>&1; grep -v -i warning $OUT/setup2.log | tail -2
echo "setup $(( $(date +%s) - T0 )) s"
( CUDA_VISIBLE_DEVICES= timeout 120 python3 tests/_exit_runs.py example 2 fails 4 kept 2 > $OUT/exit_runs.log 2>&1;
  echo "rc $?" >> $OUT/exit_runs.log ) &
( timeout 150 python3 -m pytest -q -n 3 -p no:cacheprovider --timeout 120 tests/test_cuda.py > $OUT/cuda_tests.log 2>&1;
  echo "rc $?" >> $OUT/cuda_tests.log ) &
left=$(( BUDGET - ($(date +%s) - T0) - 5 )); [ "$left" -lt 60 ] && left=60; echo "suite budget $left s"
CUDA_VISIBLE_DEVICES= timeout $left python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 200 -rfE \
  --ignore=tests/test_cuda.py tests/ > $OUT/suite_cpu.log 2>&1
echo "suite rc $? $(( $(date +%s) - T0 )) s since start"
wait
grep -E "run [0-9]+:|rank [0-9]: after|^rc" $OUT/exit_runs.log | cut -c1-300
tail -1 $OUT/suite_cpu.log; grep -E "^(FAILED|ERROR)" $OUT/suite_cpu.log | head -20; tail -3 $OUT/cuda_tests.log
