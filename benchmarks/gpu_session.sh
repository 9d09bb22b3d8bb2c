#!/usr/bin/env bash
# Issue 6 on a lent Hopper GPU, in one device call (the device tool's `run`, command
# `bash benchmarks/gpu_session.sh`, timeout_s 600): the compiled kernel's tests against XLA, then
# the attention benchmark at T = 8k against cuDNN, then a short Nsight Compute look at the kernels.
# Everything lands in $OUT (the device tool brings it back): gpu.txt, gpu_tests.log,
# attention_gpu.json, bench.log, ncu.txt. Commit attention_gpu.json to benchmarks/results/ and
# the test figures to NOTES.md. The device image has jax (CUDA), flax, optax, orbax and pytest;
# nothing is installed here.
set -u -o pipefail
OUT=${OUT:-/tmp/diffjax-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

# 1. Correctness: forward and all gradients against the XLA reference (tests/test_ops_pallas_gpu.py).
timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_pallas_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"

# 2. Speed: diff vs cuDNN standard attention vs the two-call cuDNN composition (the targets).
timeout 240 $PY benchmarks/attention.py --impls cudnn,pallas_gpu --lengths 8192 --no-memory \
  --out "$OUT/attention_gpu.json" 2>&1 | tee "$OUT/bench.log"

# 3. What limits the kernels: registers/spills, occupancy and pipe utilisation of each kernel once.
if command -v ncu >/dev/null; then
  timeout 100 ncu --clock-control none --kernel-name regex:diffjax_mgpu --launch-count 3 \
    --section LaunchStats --section Occupancy --section SpeedOfLight \
    $PY benchmarks/attention.py --impls pallas_gpu --lengths 8192 --quick --no-memory --out /tmp/ncu_run.json \
    > "$OUT/ncu.txt" 2>&1
  grep -E "diffjax_mgpu|Registers Per Thread|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Duration" "$OUT/ncu.txt" | head -40
fi
