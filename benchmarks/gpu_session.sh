#!/usr/bin/env bash
# Issue 6 on a lent Hopper GPU. Each device call runs at most 600 s, so the work comes in phases:
#   run(command="bash benchmarks/gpu_session.sh tests bench", timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh sweep ncu", timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh train", timeout_s=600, carry=[".whl"])
#   run(command="bash benchmarks/gpu_session.sh trainstep", timeout_s=600, carry=[".whl"])   (then REMAT=minimal, SEQ=2048)
# With a short lease, one call: DEADLINE=520 bash benchmarks/gpu_session.sh tests bench decode trainstep
# (DEADLINE: seconds for all phases together; each phase's timeout is cut to what is left, and one that has under
# 20 s left is skipped, so the call ends inside its limit with every finished phase's files in $OUT.)
# tests  the compiled kernels' forward and gradients against XLA (pytest -m gpu)    -> gpu_tests.log
# bench  benchmarks/attention.py at T = 8k: cudnn and pallas_gpu, the targets -> attention_gpu.json, bench.log
# sweep  benchmarks/pallas_gpu_sweep.py: block sizes, stages, pingpong at T = 8k       -> pallas_gpu_sweep.json, sweep.log
# ncu    Nsight Compute: registers, occupancy, throughput of each kernel once          -> ncu.txt
# train  train.py end to end: the 1.4B DIFF config and its Transformer twin, seq 4096, micro-batch 1,
#        bf16, the paper's 100,288 vocabulary, attention_impl=$IMPL (default auto)    -> train_*.log, train_*.jsonl
#        (the trainer needs grain & co., which the image lacks: make .whl/ with the wheels first, see NOTES.md)
# decode benchmarks/generate.py: the paper's 1.4B DiffLlama, bf16, batch 1 and 8, prompt 64, 128 new tokens,
#        diffjax vs transformers eager and compiled (static cache, CUDA graphs) on the same GPU -> generate_gpu.json
# trainstep    benchmarks/train_step.py (imports the trainer: .whl/ too): the 1.4B DIFF and its twin at seq $SEQ
#              (4096), remat $REMAT (attention): largest micro-batch, tokens/s, MFU, peak memory
#                                                               -> train_step_gpu_<seq>_<remat>.json, trainstep_*.log
# The phases run on the image's jax (0.11.2 in 2026-11) or, where .whl-jax/ holds the wheels of another
# (NOTES.md, "Supported JAX versions"), on that one; gpu.txt records which. No code differs between them.
# Everything lands in $OUT, which the device tool brings back (gpu.txt says what ran where). Commit
# the JSON to benchmarks/results/ and the figures to benchmarks/results/gpu_session_<date>.md. The device
# image has jax (CUDA), flax, optax, orbax, pyyaml and pytest: nothing is installed here.
set -u -o pipefail
OUT=${OUT:-/tmp/diffjax-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
phases=${*:-tests bench}
if [ -d .whl ]; then  # wheels the device image lacks (the trainer's data and logging packages)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if [ -d .whl-jax ]; then  # a newer jax than the image's (jax, jaxlib, jax-cuda13-plugin, jax-cuda13-pjrt wheels)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-jax .whl-jax/*.whl \
    && export PYTHONPATH="/tmp/site-jax:$PYTHONPATH"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/gpu.txt"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

DEADLINE=${DEADLINE:-100000}
cap() {  # cap SECONDS: the phase's own limit, or what is left of DEADLINE if less
  local left=$((DEADLINE - SECONDS))
  echo $(( $1 < left ? $1 : left ))
}

for phase in $phases; do
  if [ $((DEADLINE - SECONDS)) -lt 20 ]; then echo "skipped $phase: the deadline has passed" | tee -a "$OUT/gpu.txt"; continue; fi
  echo "== $phase at ${SECONDS}s" | tee -a "$OUT/gpu.txt"
  case $phase in
    tests)
      timeout "$(cap ${TESTS_S:-300})" $PY -m pytest -q -m gpu -p no:cacheprovider --durations=0 tests/test_ops_pallas_gpu.py tests/test_ops_gpu_paths.py tests/test_model_attention_impl.py 2>&1 | tee "$OUT/gpu_tests.log" ;;
    bench)
      timeout "$(cap ${BENCH_S:-280})" $PY benchmarks/attention.py --impls cudnn,pallas_gpu --lengths 8192 --no-memory \
        --out "$OUT/attention_gpu.json" 2>&1 | tee "$OUT/bench.log" ;;
    sweep)
      timeout "$(cap 400)" $PY benchmarks/pallas_gpu_sweep.py --T 8192 --out "$OUT/pallas_gpu_sweep.json" 2>&1 | tee "$OUT/sweep.log" ;;
    ncu)
      timeout 180 ncu --clock-control none --kernel-name regex:diffjax_mgpu --launch-count 3 \
        --section LaunchStats --section Occupancy --section SpeedOfLight \
        $PY benchmarks/attention.py --impls pallas_gpu --lengths 8192 --quick --no-memory --out /tmp/ncu_run.json \
        > "$OUT/ncu.txt" 2>&1
      grep -E "diffjax_mgpu|Registers Per Thread|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Duration" "$OUT/ncu.txt" | head -40 ;;
    train)
      for model in diff-1.4b transformer-1.4b; do
        rm -rf "/tmp/run-$model"
        timeout "$(cap 280)" $PY train.py --config "paper/$model" train.run_dir="/tmp/run-$model" \
          model.attention_impl="${IMPL:-auto}" model.dtype=bfloat16 model.remat=minimal model.scan_layers=true \
          model.vocab_size=100288 data.seq_len=4096 train.batch_size=1 train.steps=40 train.log_every=10 \
          train.eval_every=0 train.sample_tokens=0 train.tensorboard=false train.progress=lines \
          checkpoint.every=100000 checkpoint.keep=1 2>&1 | tee "$OUT/train_$model.log"
        cp "/tmp/run-$model/metrics.jsonl" "$OUT/train_$model.jsonl" 2>/dev/null
        rm -rf "/tmp/run-$model"
      done ;;
    decode)
      timeout "$(cap ${DECODE_S:-400})" $PY benchmarks/generate.py --model 1.4b --dtypes bfloat16 --batches 1,8 --prompts 64 \
        --new-tokens 128 --repeats 3 --peers eager,compiled --out "$OUT/generate_gpu.json" 2>&1 | tee "$OUT/decode.log" ;;
    trainstep)
      timeout "$(cap 560)" $PY benchmarks/train_step.py --seq-lens "${SEQ:-4096}" --remat "${REMAT:-attention}" --steps 5 ${TRAINSTEP_ARGS:-} \
        --out "$OUT/train_step_gpu_${SEQ:-4096}_${REMAT:-attention}.json" 2>&1 | tee "$OUT/trainstep_${SEQ:-4096}_${REMAT:-attention}.log" ;;
    *) echo "unknown phase $phase (tests, bench, sweep, ncu, train, decode, trainstep)"; exit 2 ;;
  esac
done
