# Issue #43, for the next GPU session (prepared in session 50, not yet run). With .whl and .gpu carried:
#   BUDGET=480 bash benchmarks/gpu/run43m.sh      (about 8 minutes; then run43i.sh if time is left)
# 1. tests/test_cuda.py whole (its split cases now run the one-thread split_update; the forkserver fix of 8338d50),
#    and benchmarks/gpu/memory43.py: where test_offload_frees_the_moments_from_gpu_memory's bytes are;
# 2. the 6.3B offload step: floors, fshard_device, fshard_split50 (the parts in turn on one
#    thread), fsdp2, fshard_device_d4 (depth 4: the device update ran at 0.71 of the link's probe at depth 2), each
#    a process of its own (session 50: the two-thread split 0.66x/0.70x FSDP2, the device update 0.55x);
# 3. step_cuda.py's one-rank 1B step with a trace of fshard's steps (session 50: 1.047x / 1.082x plain torch).
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); BUDGET=${BUDGET:-480}
. scripts/gpu_setup.sh > $OUT/setup.log 2>&1
grep -v -i warning $OUT/setup.log | tail -3; nproc; uptime
echo "setup $(( $(date +%s) - T0 )) s"
( timeout 60 python3 benchmarks/gpu/memory43.py > $OUT/memory43.log 2>&1; echo "rc $?" >> $OUT/memory43.log ) &
timeout 150 python3 -m pytest -q -n 4 -p no:cacheprovider --timeout 140 -rfE tests/test_cuda.py > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc $? $(( $(date +%s) - T0 )) s"; wait
tail -1 $OUT/cuda_tests.log; grep -E "^(FAILED|ERROR)" $OUT/cuda_tests.log | head -5; grep "^\[memory43\]" $OUT/memory43.log
left=$(( BUDGET - ($(date +%s) - T0) - 90 )); echo "offload budget $left s"
mkdir -p /tmp/o
timeout $left python3 benchmarks/offload_cuda.py --mode all --pin --timeout 100 --json /tmp/o/offload43m.json \
  --all-modes floors,fshard_device,fshard_split50,fsdp2,fshard_device_d4 2>&1 | grep "^\[offload" | cut -c1-600 \
  | tee $OUT/offload43m.log
tar czf $OUT/offload43m.tgz -C /tmp/o .
echo "offload done $(( $(date +%s) - T0 )) s"
left=$(( BUDGET - ($(date +%s) - T0) - 5 )); echo "step budget $left s"
[ "$left" -gt 40 ] && { timeout $left python3 benchmarks/step_cuda.py --steps 6 --configs plain,fshard_donate,fsdp2,fshard \
  --rounds 1 --trace /tmp/trace --json $OUT/step43m.json > $OUT/step43m.log 2>&1; echo "step rc $?";
  tar czf $OUT/trace43m.tgz -C /tmp trace 2>/dev/null; grep -v -i warn $OUT/step43m.log | tail -9; }
echo "call $(( $(date +%s) - T0 )) s"
