# Issue #43, for the next GPU session (prepared in session 29, not yet run): the update on the GPU with the stored
# chunks copied up and back (offload_state(update_on="device"), design/OFFLOAD.md "On a GPU"). With .whl and .gpu
# carried:   BUDGET=420 bash benchmarks/gpu/run43j.sh   (about 7 minutes; a second call, if time is left: run43i.sh)
# 1. tests/test_cuda.py's offload streaming test (its new device cases, local and NCCL meshes) and the copy-order test;
# 2. the 6.3B offload step: floors, fshard_device (moments on the host, master weights on the GPU, the update on the
#    GPU), fshard_device_params (moments and master weights on the host), fshard_moments (the same on the host's
#    cores, session 29's 1.93 s) and FSDP2 CPUOffloadPolicy, each in a process of its own, in this call.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); BUDGET=${BUDGET:-420}
. scripts/gpu_setup.sh > $OUT/setup.log 2>&1
grep -v -i warning $OUT/setup.log | tail -3; uptime
echo "setup $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m pytest -q -n 2 -p no:cacheprovider --timeout 115 tests/test_cuda.py \
  -k "host_update or comes_back" > $OUT/cuda_offload_tests.log 2>&1; echo "cuda offload tests rc $? $(( $(date +%s) - T0 )) s"
tail -1 $OUT/cuda_offload_tests.log; grep -E "^(FAILED|ERROR)|Error" $OUT/cuda_offload_tests.log | head -5
left=$(( BUDGET - ($(date +%s) - T0) - 5 )); echo "offload budget $left s"
timeout $left python3 benchmarks/offload_cuda.py --mode all --pin --timeout 100 --json $OUT/offload43j.json \
  --all-modes floors,fshard_device,fshard_device_params,fshard_moments,fsdp2 2>&1 | grep "^\[offload" | cut -c1-400
echo "call $(( $(date +%s) - T0 )) s"
