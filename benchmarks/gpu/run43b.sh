# Issue #43, second call: set-up, the CUDA tests, the offload runs with stored parameters uploaded straight from
# a pinned CPUStore (floors, fshard, FSDP2 CPUOffloadPolicy), the one-rank 1B step against plain torch and FSDP2,
# and ncu on the CUDA AdamW kernel. From the repository root with .whl carried: bash benchmarks/gpu/run43b.sh
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/examples:$PWD FSHARD_OPS_CACHE=/tmp/fshard_ops MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi -L; uptime
t0=$(date +%s)
python3 -c "import torch, fshard.ops as o; i=o.backend_info(); print('torch', torch.__version__, {k: i[k] for k in ('backend','cpu_isa','cuda','error')})" 2>&1 | tail -2
echo "build $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -m pytest -q -n 4 -p no:cacheprovider --timeout 110 tests/test_cuda.py 2>&1 | tee $OUT/cuda_tests.log | grep -v Warning | tail -12
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout ${OFFLOAD_S:-300} python3 benchmarks/offload_cuda.py --mode all --pin --timeout ${MODE_S:-150} --json $OUT/offload43b.json 2>&1 | tee $OUT/offload43b.log | grep "^\[offload" | tail -16
echo "offload $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout ${STEP_S:-120} python3 benchmarks/step_cuda.py --steps 6 --configs plain,fshard_donate,fsdp2,fshard --rounds 1 --json $OUT/step43.json 2>&1 | tee $OUT/step43.log | grep -v Warning | tail -14
echo "step $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout ${NCU_S:-60} ncu --kernel-name adamw_kernel --launch-count 1 --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats python3 benchmarks/adam_cuda.py --once > $OUT/ncu_adamw.txt 2>&1; tail -45 $OUT/ncu_adamw.txt
echo "ncu $(( $(date +%s) - t0 )) s"
