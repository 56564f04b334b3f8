# Issue #43, for the next GPU session (prepared in session 26, not yet run): confirm session 26's fixes on the GPU
# machine's torch 2.11 / Python 3.12, with .whl and .gpu carried:   bash benchmarks/gpu/run43g.sh   (about 6 minutes)
# 1. the exit diagnosis of tests/_exit_runs.py's failing script, the GPU hidden (session 26: rank 1 kept its mesh
#    through a Python 3.12 generator cycle; fixed on main after that call) and tests/test_exit.py's cycle checks;
# 2. tests/test_cuda.py on the GPU beside the whole CPU suite with the GPU hidden (session 26: 809 passed, 1 failed).
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); BUDGET=${BUDGET:-360}
. scripts/gpu_setup.sh > $OUT/setup.log 2>&1; grep -v -i warning $OUT/setup.log | tail -3
echo "setup $(( $(date +%s) - T0 )) s"
CUDA_VISIBLE_DEVICES= timeout 90 python3 tests/_exit_runs.py fails 3 kept 1 > $OUT/exit_runs.log 2>&1; echo "exit runs rc $?"
grep -E "run [0-9]+:|rank [0-9]: after" $OUT/exit_runs.log | cut -c1-300
( timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider --timeout 100 tests/test_cuda.py > $OUT/cuda_tests.log 2>&1;
  echo "rc $?" >> $OUT/cuda_tests.log ) &
left=$(( BUDGET - ($(date +%s) - T0) )); [ "$left" -lt 60 ] && left=60; echo "suite budget $left s"
CUDA_VISIBLE_DEVICES= timeout $left python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 200 -rfE \
  --ignore=tests/test_cuda.py tests/ > $OUT/suite_cpu.log 2>&1
echo "suite rc $? $(( $(date +%s) - T0 )) s since start"
wait
tail -1 $OUT/suite_cpu.log; grep -E "^(FAILED|ERROR)" $OUT/suite_cpu.log | head -20; tail -2 $OUT/cuda_tests.log
