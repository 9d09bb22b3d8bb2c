#!/usr/bin/env bash
# The GPU issues' work on a lent Hopper GPU. Each device call runs at most 600 s, so phases in priority order, one
# prepared call (carry .whl: the trainer's wheels, NOTES.md "GPU session"):
#   run(command="bash benchmarks/gpu_session.sh tests capture sweep trainstep decode", timeout_s=600, carry=[".whl"])
# DEADLINE (default 585): seconds for all phases together; each phase's timeout is cut to what is left, and one that
# has under 20 s left is skipped, so the call ends inside its limit with every finished phase's files in $OUT.
# Default phase limits fit that call: tests 160 (TESTS_S), capture 230 (CAPTURE_S), sweep 70 (SWEEP_S), trainstep
# 60 (TRAINSTEP_S; micro-batch 8 only, TRAINSTEP_ARGS), decode what is left (~60 s; DECODE_S). The tests a cut
# leaves unrun, and a cut decode, take a second call: TESTS_S=560 bash benchmarks/gpu_session.sh tests (all 18 gpu
# tests need ~300 s); a call of its own gives any phase more the same way.
# DRY_RUN=1: the CPU-sized version, no GPU (CI: tests/test_capture.py): capture traces a tiny config and reduces it,
# reduces the synthetic benchmarks/testdata/ncu_details_example.csv, and prints the mgpu peer's skip line; sweep runs
# its plumbing at T = 128 with xla standing in for the kernels (figures meaningless, table marked dry_run); other
# phases are skipped.
# tests  the compiled kernels' forward and gradients against XLA (pytest -m gpu)    -> gpu_tests.log
# capture  (a) a profile of train steps 3-4 (train.profile_steps) of the 1.4B DIFF config and its twin, micro-batch
#          8, seq 4096, bf16, remat attention (builtin text, byte tokenizer, the 100,288 vocabulary), reduced on the
#          device by benchmarks/profile_table.py to the top 30 ops (category, ms / step, share, TFLOP/s or GB/s from
#          the step's optimized HLO)   -> profile_<model>.json/.md, profile_diff_vs_twin.md (categories side by
#          side), and (gzipped, when under 20 MB) the trace and the HLO for analysis on the CPU:
#          trace_<model>.xplane.pb.gz, hlo_<model>.txt.gz
#          (b) Nsight Compute of the three DIFF kernels (fwd, bwd_dq, bwd_dkdv; one causal fwd+bwd at T = 8k),
#          reduced by benchmarks/ncu_summary.py                           -> ncu_details.csv, ncu_summary.json/.md
#          (c) benchmarks/attention.py at T = 8k: cudnn, pallas_gpu and jax's Mosaic GPU flash attention (mgpu,
#          the single-map peer)                                             -> attention_capture.json, capture.log
# bench  benchmarks/attention.py at T = 8k: cudnn and pallas_gpu, the issue's targets -> attention_gpu.json, bench.log
# sweep  benchmarks/pallas_gpu_sweep.py: block sizes, stages, pingpong at T = 8k, and the best per shape class
#                                                    -> pallas_gpu_sweep.json, pallas_gpu_tuning.json, sweep.log
#        (copy pallas_gpu_tuning.json to diffjax/ops/ to make it what `auto` / the default Tuning uses)
# ncu    Nsight Compute: registers, occupancy, throughput of each kernel once          -> ncu.txt
# train  train.py end to end: the 1.4B DIFF config and its Transformer twin, seq 4096, micro-batch 1,
#        bf16, the paper's 100,288 vocabulary, attention_impl=$IMPL (default auto)    -> train_*.log, train_*.jsonl
#        (the trainer needs grain & co., which the image lacks: make .whl/ with the wheels first, see NOTES.md)
# decode benchmarks/generate.py: the paper's 1.4B DiffLlama, bf16, batch 1 and 8, prompt 64, 128 new tokens,
#        diffjax vs transformers eager and compiled (static cache, CUDA graphs) on the same GPU -> generate_gpu.json
# trainstep    benchmarks/train_step.py (imports the trainer: .whl/ too): the 1.4B DIFF and its twin at seq $SEQ
#              (4096), remat $REMAT (attention), micro-batch 8 (TRAINSTEP_ARGS="" searches the largest that fits):
#              tokens/s, MFU, peak memory
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
if [ -n "${DRY_RUN:-}" ]; then export JAX_PLATFORMS=cpu; fi
PY=${PYTHON:-python3}
phases=${*:-tests capture sweep trainstep decode}
if [ -d .whl ]; then  # wheels the device image lacks (the trainer's data and logging packages)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if [ -d .whl-jax ]; then  # a newer jax than the image's (jax, jaxlib, jax-cuda13-plugin, jax-cuda13-pjrt wheels)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-jax .whl-jax/*.whl \
    && export PYTHONPATH="/tmp/site-jax:$PYTHONPATH"
fi

if [ -z "${DRY_RUN:-}" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/gpu.txt"
fi
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

DEADLINE=${DEADLINE:-${DRY_RUN:+3000}}  # a dry run on a loaded CPU takes its time: 4x each limit
DEADLINE=${DEADLINE:-585} SLOWER=${DRY_RUN:+4}
cap() {  # cap SECONDS [END]: the limit (x4 in a dry run), or what is left before END (default DEADLINE) if less
  local left=$(( ${2:-$DEADLINE} - SECONDS )) limit=$(( $1 * ${SLOWER:-1} ))
  echo $(( limit < left ? limit : left ))
}

# capture's train runs: the 1.4B twins as benchmarks/train_step.py measures them (micro-batch 8, seq 4096, remat
# attention) on the builtin text with the byte tokenizer (no download; the paper's 100,288 vocabulary stays)
if [ -z "${DRY_RUN:-}" ]; then
  CAPTURE_MODEL=(model.dtype=bfloat16 model.remat=attention model.attention_impl="${IMPL:-auto}" model.max_seq_len=4096
                 data.seq_len=4096 train.batch_size=8 train.micro_batch_per_device=8)
  # no CUDA graphs while tracing: each kernel then runs under its own HLO op's annotation (the table's attribution)
  CAPTURE_XLA_FLAGS=${CAPTURE_XLA_FLAGS---xla_gpu_enable_command_buffer=}
else
  CAPTURE_MODEL=(model.d_model=64 model.num_layers=2 model.num_heads=2 model.vocab_size=512 model.max_seq_len=64
                 model.remat=attention data.seq_len=64 train.batch_size=2 train.micro_batch_per_device=2)
fi

keep_small() {  # keep_small FILE DEST.gz: FILE gzipped into $OUT when that is under 20 MB
  [ -f "$1" ] || return 0
  gzip -c "$1" > "$2"
  if [ "$(stat -c %s "$2")" -gt 20000000 ]; then rm -f "$2"; echo "not kept (over 20 MB gzipped): $1"; fi
}

capture_trace() {  # capture_trace MODEL SECONDS END: train steps 3-4 profiled, reduced to $OUT/profile_MODEL.*
  local model=$1 run=/tmp/capture-$1 dump=/tmp/capture-$1-hlo log="$OUT/capture_$1.log" limit start pid
  limit=$(cap "$2" "$3") start=$SECONDS
  rm -rf "$run" "$dump"
  XLA_FLAGS="${XLA_FLAGS:-} ${CAPTURE_XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=train_step" \
    $PY train.py --config "paper/$model" train.run_dir="$run" "${CAPTURE_MODEL[@]}" data.source=builtin \
    data.tokenizer.kind=byte train.batch_tokens=null train.steps=4 'train.profile_steps=[3,4]' train.log_every=1 \
    train.eval_every=0 train.sample_tokens=0 train.progress=lines checkpoint.every=100000 > "$log" 2>&1 &
  pid=$!
  # the trace is written once the trainer logs it: stop there (the last step's checkpoint, 19 GB of a 1.4B's AdamW
  # state, and the final eval are not needed)
  until grep -q "profile of steps" "$log" || ! kill -0 "$pid" 2>/dev/null || [ $((SECONDS - start)) -ge "$limit" ]; do
    sleep 1
  done
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  grep -E "^(model|step|profile)" "$log" | tail -4
  grep -q "profile of steps" "$log" || tail -15 "$log"  # why not (an error, or the time limit)
  $PY benchmarks/profile_table.py "$run/tensorboard" --hlo-dump "$dump" --steps 2 --out "$OUT/profile_$model.json" \
    --title "$model: train steps 3-4, ${CAPTURE_MODEL[*]}" 2>&1 | tail -42
  keep_small "$(find "$run" -name "*.xplane.pb" | head -1)" "$OUT/trace_$model.xplane.pb.gz"
  keep_small "$(ls -S "$dump"/*train_step*after_optimizations.txt 2>/dev/null | head -1)" "$OUT/hlo_$model.txt.gz"
  rm -rf "$run" "$dump"
}

# one causal fwd+bwd of the fused DIFF kernels at T = 8k: each of the three kernels launched once
NCU_DRIVER='import jax, jax.numpy as jnp
from diffjax import ops
ks, (B, T, H) = jax.random.split(jax.random.key(0), 3), (2, 8192, 8)
q, k = (jax.random.normal(key, (B, T, H, 2, 128), jnp.bfloat16) for key in ks[:2])
v, lam = jax.random.normal(ks[2], (B, T, H, 256), jnp.bfloat16), jnp.full((B, T, H), 0.5, jnp.float32)
loss = lambda *a: jnp.sum(ops.diff_attention(*a, causal=True, impl="pallas_gpu").astype(jnp.float32))
jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, lam))'

capture_ncu() {  # capture_ncu SECONDS [END]: Nsight Compute of the three kernels -> $OUT/ncu_summary.*
  local csv=benchmarks/testdata/ncu_details_example.csv metrics=""
  if [ -z "${DRY_RUN:-}" ]; then
    csv="$OUT/ncu_details.csv"
    ncu --query-metrics --chip gh100 > /tmp/ncu_query.txt 2>&1 \
      && metrics=$($PY benchmarks/ncu_summary.py --pick-metrics /tmp/ncu_query.txt)  # this ncu's tensor-pipe / stall names
    timeout "$(cap "$1" "${2:-$DEADLINE}")" ncu --csv --page details --clock-control none \
      --kernel-name regex:diffjax_mgpu_ --launch-count 3 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats ${metrics:+--metrics "$metrics"} $PY -c "$NCU_DRIVER" \
      > "$csv" 2> "$OUT/ncu.log"
  fi
  $PY benchmarks/ncu_summary.py "$csv" --kernel diffjax_mgpu --out "$OUT/ncu_summary.json" || tail -5 "$OUT/ncu.log"
}

capture() {  # (a) profile tables of the twins' train step, (b) ncu of the DIFF kernels, (c) the single-map peers
  local end=$((SECONDS + $(cap "${CAPTURE_S:-230}")))
  capture_trace diff-1.4b 75 "$end"
  capture_trace transformer-1.4b 75 "$end"
  $PY benchmarks/profile_table.py --compare "$OUT/profile_diff-1.4b.json" "$OUT/profile_transformer-1.4b.json" \
    --out "$OUT/profile_diff_vs_twin.md"
  capture_ncu 40 "$end"
  if [ -z "${DRY_RUN:-}" ]; then
    timeout "$(cap 120 "$end")" $PY benchmarks/attention.py --impls mgpu,cudnn,pallas_gpu --lengths 8192 --quick \
      --no-memory --out "$OUT/attention_capture.json" 2>&1 | tee "$OUT/capture_attention.log"
  else
    $PY benchmarks/attention.py --impls mgpu --lengths 256 --quick --no-memory --out "$OUT/attention_capture.json"
  fi
}

for phase in $phases; do
  if [ $((DEADLINE - SECONDS)) -lt 20 ]; then echo "skipped $phase: the deadline has passed" | tee -a "$OUT/gpu.txt"; continue; fi
  if [ -n "${DRY_RUN:-}" ] && [[ ! $phase =~ ^(capture|sweep)$ ]]; then echo "skipped $phase: needs a GPU (DRY_RUN)"; continue; fi
  echo "== $phase at ${SECONDS}s" | tee -a "$OUT/gpu.txt"
  case $phase in
    tests)
      timeout "$(cap ${TESTS_S:-160})" $PY -m pytest -q -m gpu -p no:cacheprovider --durations=0 tests/test_ops_pallas_gpu.py tests/test_ops_gpu_paths.py tests/test_model_attention_impl.py 2>&1 | tee "$OUT/gpu_tests.log" ;;
    capture)
      capture 2>&1 | tee "$OUT/capture.log" ;;
    bench)
      timeout "$(cap ${BENCH_S:-280})" $PY benchmarks/attention.py --impls cudnn,pallas_gpu --lengths 8192 --no-memory \
        --out "$OUT/attention_gpu.json" 2>&1 | tee "$OUT/bench.log" ;;
    sweep)
      timeout "$(cap ${SWEEP_S:-70})" $PY benchmarks/pallas_gpu_sweep.py ${DRY_RUN:+--dry-run} --out "$OUT/pallas_gpu_sweep.json" \
        --table "$OUT/pallas_gpu_tuning.json" 2>&1 | tee "$OUT/sweep.log" ;;
    ncu)
      capture_ncu 180 2>&1 | tee "$OUT/ncu.txt" ;;
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
      timeout "$(cap ${TRAINSTEP_S:-60})" $PY benchmarks/train_step.py --seq-lens "${SEQ:-4096}" --remat "${REMAT:-attention}" \
        ${TRAINSTEP_ARGS---micro-batches 8 --steps 3 --warmup 1} \
        --out "$OUT/train_step_gpu_${SEQ:-4096}_${REMAT:-attention}.json" 2>&1 | tee "$OUT/trainstep_${SEQ:-4096}_${REMAT:-attention}.log" ;;
    *) echo "unknown phase $phase (tests, capture, bench, sweep, ncu, train, decode, trainstep)"; exit 2 ;;
  esac
done
