#!/usr/bin/env bash
# The GPU issues' work on a lent Hopper GPU, in one prepared device call (NOTES.md "GPU session": first make .whl/,
# the trainer's wheels, and `echo /.gpu/ >> .git/info/exclude`):
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=570, carry=[".whl", ".gpu"])
# = the phases hlo sweep bench trainstep motif3 tests, in that order, within DEADLINE (default 540 s; the call's
# 570 leaves 30 for the bundle and the tool). Each phase's timeout is its limit (*_S, below) or what is left before
# DEADLINE if less; a phase with under 20 s left is skipped; so every finished phase's files come back.
# Phases (default limits; files in $OUT's session.tar.gz, the key ones also beside it):
# hlo        benchmarks/step_hlo.py (HLO_S 60): compile the 1.4B DIFF step (micro-batch 8, seq 4096, remat attention,
#            bf16, impl auto) and count its Mosaic GPU kernels per kernel, pass and layer in the optimized HLO; the
#            check: the forward kernel at most twice per layer   -> step_hlo.json/.md (key), hlo_step.txt.gz
# sweep      benchmarks/pallas_gpu_sweep.py (SWEEP_S 80): every Tuning its FORWARD_OPTIONS / BACKWARD_OPTIONS give
#            (the kernel variants are the script's: none listed here), each checked against the default Tuning and
#            the default against XLA, at T 8k       -> sweep.log (key), pallas_gpu_sweep.json, pallas_gpu_tuning.json
#            (copy pallas_gpu_tuning.json to diffjax/ops/ to make it what `auto` / the default Tuning uses)
# bench      benchmarks/attention.py at T 8k, --quick (BENCH_S 90): mgpu (jax's Mosaic GPU flash attention, fp16),
#            cudnn, pallas_gpu: the issue's targets               -> bench.log (key), attention_gpu.json
# trainstep  benchmarks/train_step.py (TRAINSTEP_S 70): the 1.4B DIFF and its twin at seq $SEQ (4096), remat $REMAT
#            (attention), micro-batch 8 (TRAINSTEP_ARGS="" searches the largest): tokens/s, MFU, peak memory
#                                        -> trainstep_<seq>_<remat>.log (key), train_step_gpu_<seq>_<remat>.json
# motif3     benchmarks/motif3_step.py (MOTIF3_S 150): a 4-layer slice of motif3/published at full width (384
#            experts, seq 4096, else 2048), as many MoE layers as the memory plan fits (one on an H100), bf16 params
#            and moments, remat full: tokens/s, MFU on active params (its docstring lists every choice)
#                                                                   -> motif3.log (key), motif3_step.json
# tests      pytest -m gpu (TESTS_S 560: what is left) through benchmarks/gpu_tests_plugin.py: by value (compiled
#            DIFF and single-map kernels, context path, tunings, dispatch, model, triton), 4 xdist workers, 150 s a
#            test; what this call's sweep proved is skipped  -> gpu_tests.tsv (key: outcome, seconds, test), .log
#            Resumable: a second call runs what the first did not reach, given its gpu_tests.tsv:
#              mkdir -p .gpu && cp FILES_AT/gpu_tests.tsv .gpu/tests_done.tsv   (TESTS_DONE names another file)
#              run(command="bash benchmarks/gpu_session.sh tests", timeout_s=600, carry=[".whl", ".gpu"])
# Not in the default call (name them): capture (CAPTURE_S 230: XProf profiles of the 1.4B twins' train steps 3-4 ->
# profile_<model>.json/.md by benchmarks/profile_table.py, profile_diff_vs_twin.md, the trace and HLO gzipped when
# under 8 MB; Nsight Compute of the three DIFF kernels -> ncu_summary.*; attention.py with the mgpu peer), ncu (NCU_S
# 180), train (train.py end to end, IMPL), decode (DECODE_S 400: benchmarks/generate.py against transformers).
# $OUT gets at most 8 files (the device tool brings back no more): gpu.txt (what ran where: device, jax, each phase's
# start, exit status and seconds), the key files of the first 6 phases run, and session.tar.gz (every file, logs
# included; without traces and HLO if it would pass 15 MiB). All phases write to $WORK; the bundle is remade after
# each phase, so a call cut off keeps the phases before. Commit the JSON to benchmarks/results/ and the figures to
# benchmarks/results/gpu_session_<date>.md.
# DRY_RUN=1: the CPU-sized version of every phase a CPU can run (tests/test_capture.py): hlo and trainstep on the tiny
# DIFF (impl xla), sweep at T 128 (xla for the kernels), bench at T 256 (mgpu prints its skip line), motif3 at
# motif3/small's width, tests (all skip without a GPU: the plugin's order, log and resume), capture on a tiny config
# with the synthetic ncu CSV; ncu, train and decode are skipped. Figures meaningless; JSON marked.
# The phases run on the image's jax (0.11.2 in 2026-11) or, where .whl-jax/ holds another's wheels (NOTES.md,
# "Supported JAX versions"), on that one; gpu.txt records which. No code differs between them.
set -u -o pipefail
OUT=${OUT:-/tmp/diffjax-gpu-out}
WORK=${WORK:-/tmp/diffjax-gpu-session}
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "${DRY_RUN:-}" ]; then export JAX_PLATFORMS=cpu; fi
PY=${PYTHON:-python3}
phases=${*:-hlo sweep bench trainstep motif3 tests}
if [ -d .whl ]; then  # wheels the device image lacks (the trainer's data and logging packages)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if [ -d .whl-jax ]; then  # a newer jax than the image's (jax, jaxlib, jax-cuda13-plugin, jax-cuda13-pjrt wheels)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-jax .whl-jax/*.whl \
    && export PYTHONPATH="/tmp/site-jax:$PYTHONPATH"
fi

if [ -z "${DRY_RUN:-}" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$WORK/gpu.txt"
fi
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$WORK/gpu.txt"

DEADLINE=${DEADLINE:-${DRY_RUN:+3000}}  # a dry run on a loaded CPU takes its time: 4x each limit
DEADLINE=${DEADLINE:-540} SLOWER=${DRY_RUN:+4}
cap() {  # cap SECONDS [END]: the limit (x4 in a dry run), or what is left before END (default DEADLINE) if less
  local left=$(( ${2:-$DEADLINE} - SECONDS )) limit=$(( $1 * ${SLOWER:-1} ))
  echo $(( limit < left ? limit : left ))
}

KEY=(gpu.txt)  # $OUT's files besides session.tar.gz: gpu.txt, then each phase's key file (the first 6 phases')
bundle() {  # $OUT <- gpu.txt, the key files, session.tar.gz of $WORK (traces and HLO left out past 15 MiB)
  local f kept=0 tar=/tmp/diffjax-session.tar.gz
  for f in "${KEY[@]}" session.tar.gz; do rm -f "$OUT/$f"; done
  for f in "${KEY[@]}"; do
    if [ -f "$WORK/$f" ] && [ "$kept" -lt 7 ]; then cp "$WORK/$f" "$OUT/"; kept=$((kept + 1)); fi
  done
  tar -czf "$tar" -C "$WORK" .
  if [ "$(stat -c %s "$tar")" -gt 15728640 ]; then
    echo "session.tar.gz without traces and HLO (over 15 MiB with them)" | tee -a "$WORK/gpu.txt"
    tar -czf "$tar" -C "$WORK" --exclude "*.xplane.pb.gz" --exclude "*.txt.gz" .
  fi
  mv "$tar" "$OUT/session.tar.gz"
}

# capture's train runs: the 1.4B twins as benchmarks/train_step.py measures them (micro-batch 8, seq 4096, remat
# attention) on the builtin text with the byte tokenizer (no download; the paper's 100,288 vocabulary stays)
if [ -z "${DRY_RUN:-}" ]; then
  CAPTURE_MODEL=(model.dtype=bfloat16 model.remat=attention model.attention_impl="${IMPL:-auto}" model.max_seq_len=4096
                 data.seq_len=4096 train.batch_size=8 train.micro_batch_per_device=8)
  # no CUDA graphs while tracing: each kernel then runs under its own HLO op's annotation (the table's attribution)
  CAPTURE_XLA_FLAGS=${CAPTURE_XLA_FLAGS---xla_gpu_enable_command_buffer=}
  ATTENTION=(--impls mgpu,cudnn,pallas_gpu --lengths 8192) TESTS_WORKERS=${TESTS_WORKERS:-4}
else
  CAPTURE_MODEL=(model.d_model=64 model.num_layers=2 model.num_heads=2 model.vocab_size=512 model.max_seq_len=64
                 model.remat=attention data.seq_len=64 train.batch_size=2 train.micro_batch_per_device=2)
  ATTENTION=(--impls xla,mgpu --lengths 256) TESTS_WORKERS=${TESTS_WORKERS:-2}
fi

keep_small() {  # keep_small FILE DEST.gz: FILE gzipped into $WORK when that is under 8 MB
  [ -f "$1" ] || return 0
  gzip -c "$1" > "$2"
  if [ "$(stat -c %s "$2")" -gt 8000000 ]; then rm -f "$2"; echo "not kept (over 8 MB gzipped): $1"; fi
}

capture_trace() {  # capture_trace MODEL SECONDS END: train steps 3-4 profiled, reduced to $WORK/profile_MODEL.*
  local model=$1 run=/tmp/capture-$1 dump=/tmp/capture-$1-hlo log="$WORK/capture_$1.log" limit start pid
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
  $PY benchmarks/profile_table.py "$run/tensorboard" --hlo-dump "$dump" --steps 2 --out "$WORK/profile_$model.json" \
    --title "$model: train steps 3-4, ${CAPTURE_MODEL[*]}" 2>&1 | tail -48
  keep_small "$(find "$run" -name "*.xplane.pb" | head -1)" "$WORK/trace_$model.xplane.pb.gz"
  keep_small "$(ls -S "$dump"/*train_step*after_optimizations.txt 2>/dev/null | head -1)" "$WORK/hlo_$model.txt.gz"
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

capture_ncu() {  # capture_ncu SECONDS [END]: Nsight Compute of the three kernels -> $WORK/ncu_summary.*
  local csv=benchmarks/testdata/ncu_details_example.csv metrics=""
  if [ -z "${DRY_RUN:-}" ]; then
    csv="$WORK/ncu_details.csv"
    ncu --query-metrics --chip gh100 > /tmp/ncu_query.txt 2>&1 \
      && metrics=$($PY benchmarks/ncu_summary.py --pick-metrics /tmp/ncu_query.txt)  # this ncu's tensor-pipe / stall names
    timeout "$(cap "$1" "${2:-$DEADLINE}")" ncu --csv --page details --clock-control none \
      --kernel-name regex:diffjax_mgpu_ --launch-count 3 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats ${metrics:+--metrics "$metrics"} $PY -c "$NCU_DRIVER" \
      > "$csv" 2> "$WORK/ncu.log"
  fi
  $PY benchmarks/ncu_summary.py "$csv" --kernel diffjax_mgpu --out "$WORK/ncu_summary.json" || tail -5 "$WORK/ncu.log"
}

capture() {  # (a) profile tables of the twins' train step, (b) ncu of the DIFF kernels, (c) the single-map peers
  local end=$((SECONDS + $(cap "${CAPTURE_S:-230}")))
  capture_trace diff-1.4b 75 "$end"
  capture_trace transformer-1.4b 75 "$end"
  $PY benchmarks/profile_table.py --compare "$WORK/profile_diff-1.4b.json" "$WORK/profile_transformer-1.4b.json" \
    --out "$WORK/profile_diff_vs_twin.md"
  capture_ncu 40 "$end"
  timeout "$(cap 120 "$end")" $PY benchmarks/attention.py "${ATTENTION[@]}" --quick --no-memory \
    --out "$WORK/attention_capture.json"
}

# the files of the gpu-marked tests (tests/test_capture.py collects the same)
GPU_TEST_FILES="tests/test_ops_pallas_gpu.py tests/test_ops_gpu_paths.py tests/test_model_attention_impl.py tests/test_attention_passes.py"

tests_phase() {  # the gpu tests by value, resumable, through benchmarks/gpu_tests_plugin.py
  local done=${TESTS_DONE:-.gpu/tests_done.tsv} args
  args=(-q -m gpu -p no:cacheprovider -p gpu_tests_plugin --gpu-log "$WORK/gpu_tests.tsv" --gpu-evidence "$WORK"
        --durations=0 -rs)
  if [ -f "$done" ]; then args+=(--gpu-done "$done"); echo "tests: resuming after the $(wc -l < "$done") in $done"; fi
  $PY -c "import xdist" 2>/dev/null && args+=(-n "$TESTS_WORKERS" --dist load)
  $PY -c "import pytest_timeout" 2>/dev/null && args+=(--timeout "${TEST_TIMEOUT:-150}")
  PYTHONPATH="$PYTHONPATH:$PWD/benchmarks" timeout "$(cap "${TESTS_S:-560}")" $PY -m pytest "${args[@]}" $GPU_TEST_FILES
}

for phase in $phases; do
  if [ $((DEADLINE - SECONDS)) -lt 20 ]; then echo "skipped $phase: the deadline has passed" | tee -a "$WORK/gpu.txt"; continue; fi
  if [ -n "${DRY_RUN:-}" ] && [[ $phase =~ ^(ncu|train|decode)$ ]]; then echo "skipped $phase: needs a GPU (DRY_RUN)"; continue; fi
  echo "== $phase at ${SECONDS}s" | tee -a "$WORK/gpu.txt"
  start=$SECONDS
  case $phase in
    hlo)
      KEY+=(step_hlo.md)
      timeout "$(cap "${HLO_S:-60}")" $PY benchmarks/step_hlo.py ${DRY_RUN:+--tiny} --out "$WORK/step_hlo.json" \
        --keep-hlo "$WORK/hlo_step.txt.gz" 2>&1 | tee "$WORK/hlo.log" ;;
    sweep)
      KEY+=(sweep.log)
      timeout "$(cap "${SWEEP_S:-80}")" $PY benchmarks/pallas_gpu_sweep.py ${DRY_RUN:+--dry-run} --out "$WORK/pallas_gpu_sweep.json" \
        --table "$WORK/pallas_gpu_tuning.json" 2>&1 | tee "$WORK/sweep.log" ;;
    bench)
      KEY+=(bench.log)
      timeout "$(cap "${BENCH_S:-90}")" $PY benchmarks/attention.py "${ATTENTION[@]}" --quick --no-memory \
        --out "$WORK/attention_gpu.json" 2>&1 | tee "$WORK/bench.log" ;;
    trainstep)
      KEY+=("trainstep_${SEQ:-4096}_${REMAT:-attention}.log")
      timeout "$(cap "${TRAINSTEP_S:-70}")" $PY benchmarks/train_step.py --seq-lens "${SEQ:-4096}" --remat "${REMAT:-attention}" \
        ${DRY_RUN:+--tiny} ${TRAINSTEP_ARGS---micro-batches 8 --steps 3 --warmup 1} \
        --out "$WORK/train_step_gpu_${SEQ:-4096}_${REMAT:-attention}.json" 2>&1 | tee "$WORK/trainstep_${SEQ:-4096}_${REMAT:-attention}.log" ;;
    motif3)
      KEY+=(motif3.log)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${MOTIF3_MEM_FRACTION:-.95} timeout "$(cap "${MOTIF3_S:-150}")" \
        $PY benchmarks/motif3_step.py ${DRY_RUN:+--tiny} --out "$WORK/motif3_step.json" 2>&1 | tee "$WORK/motif3.log" ;;
    tests)
      KEY+=(gpu_tests.tsv)
      tests_phase 2>&1 | tee "$WORK/gpu_tests.log" ;;
    capture)
      KEY+=(capture.log)
      capture 2>&1 | tee "$WORK/capture.log" ;;
    ncu)
      KEY+=(ncu.txt)
      capture_ncu "${NCU_S:-180}" 2>&1 | tee "$WORK/ncu.txt" ;;
    train)
      KEY+=(train_diff-1.4b.log)
      for model in diff-1.4b transformer-1.4b; do
        rm -rf "/tmp/run-$model"
        timeout "$(cap 280)" $PY train.py --config "paper/$model" train.run_dir="/tmp/run-$model" \
          model.attention_impl="${IMPL:-auto}" model.dtype=bfloat16 model.remat=minimal model.scan_layers=true \
          model.vocab_size=100288 data.seq_len=4096 train.batch_size=1 train.steps=40 train.log_every=10 \
          train.eval_every=0 train.sample_tokens=0 train.tensorboard=false train.progress=lines \
          checkpoint.every=100000 checkpoint.keep=1 2>&1 | tee "$WORK/train_$model.log"
        cp "/tmp/run-$model/metrics.jsonl" "$WORK/train_$model.jsonl" 2>/dev/null
        rm -rf "/tmp/run-$model"
      done ;;
    decode)
      KEY+=(decode.log)
      timeout "$(cap "${DECODE_S:-400}")" $PY benchmarks/generate.py --model 1.4b --dtypes bfloat16 --batches 1,8 --prompts 64 \
        --new-tokens 128 --repeats 3 --peers eager,compiled --out "$WORK/generate_gpu.json" 2>&1 | tee "$WORK/decode.log" ;;
    *) echo "unknown phase $phase (hlo, sweep, bench, trainstep, motif3, tests, capture, ncu, train, decode)"; exit 2 ;;
  esac
  echo "== $phase: exit status ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$WORK/gpu.txt"
  bundle
done
bundle
ls -la "$OUT"
