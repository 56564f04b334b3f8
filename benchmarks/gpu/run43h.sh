# Issue #43, session 29's first call (the timed one; nothing else runs beside it). With .whl and .gpu carried:
#   bash benchmarks/gpu/run43h.sh   (about 5-6 minutes)
# 1. the 6.3B offload step on this machine: floors, fshard params=True, fshard with the master weights on the GPU
#    (fshard_moments), the same with half of the moments on the GPU (fshard_partial, --partial-fraction 0.5) and
#    FSDP2 CPUOffloadPolicy, each in a process of its own, one after the other;
# 2. the one-rank 1.04B step against plain torch and FSDP2 (session 21's set-up) on the code of today's main.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); BUDGET=${BUDGET:-330}
. scripts/gpu_setup.sh > $OUT/setup.log 2>&1
grep -v -i warning $OUT/setup.log | tail -3; nproc; free -g | head -2; uptime
echo "setup $(( $(date +%s) - T0 )) s"
timeout $(( BUDGET - 90 )) python3 benchmarks/offload_cuda.py --mode all --pin --partial-fraction 0.5 \
  --all-modes floors,fshard,fshard_moments,fshard_partial,fsdp2 --timeout 110 --json $OUT/offload43h.json 2>&1 \
  | grep "^\[offload" | cut -c1-400
echo "offload done $(( $(date +%s) - T0 )) s since start"
left=$(( BUDGET - ($(date +%s) - T0) - 5 )); echo "step budget $left s"
timeout $left python3 benchmarks/step_cuda.py --steps 6 --configs plain,fshard_donate,fsdp2,fshard --rounds 1 \
  --json $OUT/step43h.json > $OUT/step43h.log 2>&1; echo "step rc $?"
grep -v -i warn $OUT/step43h.log | tail -14
echo "call $(( $(date +%s) - T0 )) s"
