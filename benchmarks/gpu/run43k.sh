# Issue #43, session 50, first call: the update split between the GPU and the host's cores
# (offload_state(update_on=<share>)) against the update all on the GPU and FSDP2's CPUOffloadPolicy, in one call, each
# mode a process of its own; then the one-rank 1B step again on today's main. With .whl and .gpu carried:
#   BUDGET=480 bash benchmarks/gpu/run43k.sh      (then run43i.sh: the whole suite)
# 1. tests/test_cuda.py's host-update test (its split cases, local and NCCL meshes) and the copy-order test;
# 2. the 6.3B offload step: floors, fshard_device (moments on the host, master weights on the GPU, the update on the
#    GPU), fshard_split40 and fshard_split60 (40% / 60% of the units so, the rest on the host's cores meanwhile),
#    fsdp2; 3. step_cuda.py's one-rank 1B step (plain, fshard donate, FSDP2, fshard) with what time is left.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); BUDGET=${BUDGET:-480}
. scripts/gpu_setup.sh > $OUT/setup.log 2>&1
grep -v -i warning $OUT/setup.log | tail -3; nproc; free -g | head -2; uptime
echo "setup $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m pytest -q -n 2 -p no:cacheprovider --timeout 140 tests/test_cuda.py \
  -k "host_update or comes_back" > $OUT/cuda_offload_tests.log 2>&1; echo "cuda offload tests rc $? $(( $(date +%s) - T0 )) s"
tail -1 $OUT/cuda_offload_tests.log; grep -E "^(FAILED|ERROR)|Error" $OUT/cuda_offload_tests.log | head -5
left=$(( BUDGET - ($(date +%s) - T0) - 100 )); echo "offload budget $left s"
mkdir -p /tmp/o
timeout $left python3 benchmarks/offload_cuda.py --mode all --pin --timeout 100 --json /tmp/o/offload43k.json \
  --all-modes floors,fshard_device,fshard_split40,fsdp2,fshard_split60 2>&1 | grep "^\[offload" | cut -c1-600 \
  | tee $OUT/offload43k.log
tar czf $OUT/offload43k.tgz -C /tmp/o .
echo "offload done $(( $(date +%s) - T0 )) s"
left=$(( BUDGET - ($(date +%s) - T0) - 5 )); echo "step budget $left s"
[ "$left" -gt 40 ] && { timeout $left python3 benchmarks/step_cuda.py --steps 6 --configs plain,fshard_donate,fsdp2,fshard \
  --rounds 1 --json $OUT/step43k.json > $OUT/step43k.log 2>&1; echo "step rc $?"; grep -v -i warn $OUT/step43k.log | tail -9; }
echo "call $(( $(date +%s) - T0 )) s"
