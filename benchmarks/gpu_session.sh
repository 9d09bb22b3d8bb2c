#!/usr/bin/env bash
# Issue 6 on a lent Hopper GPU. Each device call runs at most 600 s, so the work comes in phases:
#   run(command="bash benchmarks/gpu_session.sh tests bench", timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh sweep ncu", timeout_s=600)
# tests  the compiled kernels' forward and gradients against XLA (pytest -m gpu)    -> gpu_tests.log
# bench  benchmarks/attention.py at T = 8k: cudnn and pallas_gpu, the targets -> attention_gpu.json, bench.log
# sweep  benchmarks/pallas_gpu_sweep.py: block sizes, stages, pingpong at T = 8k       -> pallas_gpu_sweep.json, sweep.log
# ncu    Nsight Compute: registers, occupancy, throughput of each kernel once          -> ncu.txt
# Everything lands in $OUT, which the device tool brings back (gpu.txt says what ran where). Commit
# the JSON to benchmarks/results/ and the figures to NOTES.md. The device image has jax (CUDA),
# flax, optax, orbax, pyyaml and pytest: nothing is installed here.
set -u -o pipefail
OUT=${OUT:-/tmp/diffjax-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
phases=${*:-tests bench}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/gpu.txt"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

for phase in $phases; do
  case $phase in
    tests)
      timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_pallas_gpu.py tests/test_model_attention_impl.py 2>&1 | tee "$OUT/gpu_tests.log" ;;
    bench)
      timeout 280 $PY benchmarks/attention.py --impls cudnn,pallas_gpu --lengths 8192 --no-memory \
        --out "$OUT/attention_gpu.json" 2>&1 | tee "$OUT/bench.log" ;;
    sweep)
      timeout 400 $PY benchmarks/pallas_gpu_sweep.py --T 8192 --out "$OUT/pallas_gpu_sweep.json" 2>&1 | tee "$OUT/sweep.log" ;;
    ncu)
      timeout 180 ncu --clock-control none --kernel-name regex:diffjax_mgpu --launch-count 3 \
        --section LaunchStats --section Occupancy --section SpeedOfLight \
        $PY benchmarks/attention.py --impls pallas_gpu --lengths 8192 --quick --no-memory --out /tmp/ncu_run.json \
        > "$OUT/ncu.txt" 2>&1
      grep -E "diffjax_mgpu|Registers Per Thread|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Duration" "$OUT/ncu.txt" | head -40 ;;
    *) echo "unknown phase $phase (tests, bench, sweep, ncu)"; exit 2 ;;
  esac
done
