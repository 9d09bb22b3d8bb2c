"""Train step of a 4-layer slice of Motif 3 at its published width on one GPU: tokens/s and MFU on active parameters.

    python benchmarks/motif3_step.py [--out motif3_step.json]      # a GPU (gpu_session.sh's motif3 phase)
    python benchmarks/motif3_step.py --tiny                         # CPU: the same path at motif3/small's width

The slice of `motif3/published` (each choice is printed and written to the JSON):
  layers      4 of 53, layer 0 global (YaRN) and 1-3 windowed: the published period of 4
  width       published: d_model 4096, GDLA with 80 query heads, 384 experts (top 8, 1 shared), mHC 4 streams,
              vocabulary 220,160
  MoE layers  dense layers first, as published (2 dense, then MoE), and as many MoE layers as the device holds: a MoE
              layer's 384 experts are 6.04B parameters, 45 GiB with their bf16 gradient and AdamW moments, so the
              memory plan (benchmarks/memory_plan.py's formula on this device's budget) keeps one on an 80 GB H100
              (dense_first_layers 3) and two on a 141 GB H200 (the published first 4 layers)
  dtypes      bf16 parameters and AdamW moments (published param_dtype), bf16 compute
  attention   impl auto: XLA on a GPU (no fused kernel takes GDLA's d 192 / dv 128); the global layer's T x T scores
              are its largest activation
  tokens      micro-batch 1 x seq 4096 per step, no accumulation (the trainer accumulates in fp32: 4 more bytes per
              parameter); if the compiled step does not fit, seq 2048
  remat       full (what the memory plan assumes); the recompute is not counted as useful FLOPs
  loss chunk  1024 tokens (4096 tokens' fp32 logits are 3.4 GiB)
  init        random: the router spreads tokens over the experts as at the start of training (zeros would tie every
              score and send every token to the same 8)
FLOPs: the trainer's convention (diffjax.train.metrics: 6 x the active matmul parameters + attention), MFU against the
device's dense bf16 peak; anchor: DeepSeek-V3 trained with Megatron-Core on H100s at ~35% MFU (at scale, with
expert parallelism). The LM head is half the slice's active matmul parameters (0.9B of 1.8B; 7% of the
whole model's 13B), and 4096 tokens give each expert ~85 rows: read the figure as this slice's, not Motif 3's.
The JSON also says how XLA lowered the experts' ragged dots (grouped GEMMs, or the dense rewrite over all 384).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_plan  # noqa: E402
from compile_time import write_json  # noqa: E402
from train_step import Bench, budget_bytes, describe, format_bytes, time_steps  # noqa: E402

from diffjax.config import ModelConfig  # noqa: E402
from diffjax.model.sizes import parameter_counts  # noqa: E402
from diffjax.train.config import load_run_config  # noqa: E402
from diffjax.train.metrics import matmul_params, peak_flops_per_device, training_flops_per_token  # noqa: E402

GiB = 2**30
LAYERS, REMAT, LOSS_CHUNK = 4, "full", 1024
ANCHOR_MFU = 0.35  # DeepSeek-V3 with Megatron-Core on H100s (issue 53's anchor)


def slice_config(base: ModelConfig, dense_first: int, layers: int = LAYERS) -> ModelConfig:
    """The first `layers` layers of `base` with `dense_first` dense layers, the global layers the period gives."""
    period = base.global_layers[1] - base.global_layers[0] if len(base.global_layers) > 1 else layers
    return base.replace(num_layers=layers, global_layers=[i for i in range(layers) if i % period == 0],
                        mlp_options=dataclasses.replace(base.mlp_options, dense_first_layers=dense_first),
                        remat=REMAT, scan_layers=True)


def plan(config: ModelConfig, seq_len: int, budget: float) -> dict:
    """memory_plan's full fine-tuning row for one device, one sequence (params, grads, moments, activations)."""
    params = memory_plan.abstract_params(config)
    return memory_plan.plan_row(config, params, memory_plan.Plan("slice", "this device", budget / GiB, {"data": 1},
                                                                 "full", 1, seq_len, margin=1.0,
                                                                 loss_chunk=LOSS_CHUNK))


def choose_slice(base: ModelConfig, seq_len: int, budget: float, log=print) -> tuple[ModelConfig, list[dict]]:
    """The slice with the most MoE layers whose plan fits `budget` (the plan counts the loss's logits and the
    activations compiled steps showed, compile_plan.md: no margin on top), dense layers first (never fewer than
    published), and every candidate's plan."""
    published = base.mlp_options.dense_first_layers
    rows, chosen = [], None
    for dense_first in range(min(published, LAYERS), LAYERS + 1):
        config = slice_config(base, dense_first)
        row = {"dense_first_layers": dense_first, "moe_layers": LAYERS - dense_first,
               **{k: v for k, v in plan(config, seq_len, budget).items() if k in memory_plan.COLUMNS + ("fits",)}}
        rows.append(row)
        log(f"  plan, {row['moe_layers']} MoE layer(s): " + ", ".join(
            f"{k} {format_bytes(row[k])}" for k in memory_plan.COLUMNS if k in row) + f"; fits: {row['fits']}")
        if chosen is None and row["fits"]:
            chosen = config
    return chosen or slice_config(base, LAYERS), rows


def ragged_dot_lowering(hlo_text: str, config: ModelConfig, tokens: int) -> dict:
    """How XLA compiled the experts' ragged dots: grouped GEMMs (cuDNN / cuBLAS) or the dense rewrite, which
    broadcasts the routed rows to every expert ([experts, rows, ...] operands)."""
    o = config.mlp_options
    return {"ragged_dot_instructions": hlo_text.count(" ragged-dot("),
            "cudnn_fusions": hlo_text.count("__cudnn$fusion"), "cublas_grouped_gemms": hlo_text.count("groupedMatmul"),
            "dense_rewrite_shapes": hlo_text.count(f"[{o.num_experts},{tokens * o.top_k},")}


def measure(config: ModelConfig, seq_len: int, budget: float, args) -> dict:
    """Compile (memory first), then time the step if it fits."""
    total, active = parameter_counts(config)
    row = {"seq_len": seq_len, "micro_batch": 1, "params": total, "active_params": active,
           "matmul_params": matmul_params(config), "lm_head_params": config.d_model * config.vocab_size,
           "model_config": config.to_dict()}
    bench = Bench(config, args.loss_chunk)
    compiled, figures = bench.compile(1, seq_len)
    row.update(memory=figures, loss_chunk=bench.loss_chunk,
               ragged_dot=ragged_dot_lowering(compiled.as_text() or "", config, seq_len))
    print(f"  seq {seq_len}: {describe(figures)}; ragged dots: {row['ragged_dot']}", flush=True)
    row["fits"] = figures.get("total_bytes", 0) <= budget
    if not row["fits"]:
        print(f"  seq {seq_len}: does not fit the budget of {format_bytes(budget)}", flush=True)
        return row
    start = time.perf_counter()
    try:
        state = bench.make_state("random")
        jax.block_until_ready(state)
        row["init_s"] = time.perf_counter() - start
        seconds, _ = time_steps(bench, compiled, state, 1, seq_len, args.warmup, args.steps)
    except jax.errors.JaxRuntimeError as error:  # the analysis said it fits, the allocator disagreed
        if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
            raise
        row.update(fits=False, error=str(error)[:300])
        print(f"  seq {seq_len}: out of memory when run", flush=True)
        return row
    stats = jax.devices()[0].memory_stats() or {}
    flops = training_flops_per_token(config, seq_len) * seq_len / seconds
    peak = peak_flops_per_device(jax.devices()[0].device_kind)
    row.update(step_s=seconds, tokens_per_s=seq_len / seconds, tflops_per_device=flops / 1e12,
               mfu=flops / peak if peak else None, peak_bytes_in_use=stats.get("peak_bytes_in_use"))
    print(f"  seq {seq_len}: {row['tokens_per_s']:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s"
          + (f", MFU {100 * row['mfu']:.1f}% (anchor: DeepSeek-V3 ~{100 * ANCHOR_MFU:.0f}%)" if peak else "")
          + (f", peak memory {format_bytes(stats['peak_bytes_in_use'])}" if "peak_bytes_in_use" in stats else ""),
          flush=True)
    return row


def base_config(tiny: bool) -> ModelConfig:
    """published, or (--tiny) motif3/small's width with published's layer pattern and bf16 params (the CPU dry run)."""
    if not tiny:
        return load_run_config("motif3/published").model
    small = load_run_config("motif3/small").model
    return small.replace(num_layers=2 * LAYERS, global_layers=[0, LAYERS], dtype="bfloat16", param_dtype="bfloat16",
                         mlp_options=dataclasses.replace(small.mlp_options, dense_first_layers=2), max_seq_len=128)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="4096,2048", help="tried in order until the compiled step fits")
    parser.add_argument("--loss-chunk", type=int, default=LOSS_CHUNK)
    parser.add_argument("--budget-gib", type=float, default=None, help="default: the device's memory limit")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="CPU: motif3/small's width, seq 64")
    parser.add_argument("--out", type=Path, default=Path("motif3_step.json"))
    args = parser.parse_args(argv)
    seq_lens = [64] if args.tiny else [int(s) for s in args.seq_lens.split(",")]
    args.loss_chunk = 32 if args.tiny else args.loss_chunk
    device, budget = jax.devices()[0], budget_bytes(args.budget_gib)
    print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}; budget {format_bytes(budget)}; "
          f"slice of motif3/{'small (dry run)' if args.tiny else 'published'}: {LAYERS} layers, remat {REMAT}, "
          f"loss chunk {args.loss_chunk}, micro-batch 1, bf16 params and moments", flush=True)
    config, plans = choose_slice(base_config(args.tiny), seq_lens[0], budget)
    total, active = parameter_counts(config)
    print(f"chosen: {config.mlp_options.dense_first_layers} dense + {LAYERS - config.mlp_options.dense_first_layers} "
          f"MoE layers, global layers {list(config.global_layers)}: {total:,} params, {active:,} active", flush=True)
    rows = []
    for seq_len in seq_lens:
        rows.append(measure(config, seq_len, budget, args))
        write_json(args.out, {"budget_bytes": budget, "choices": {"layers": LAYERS, "remat": REMAT,
                              "dense_first_layers": config.mlp_options.dense_first_layers,
                              "loss_chunk": args.loss_chunk, "micro_batch": 1,
                              "dtypes": "bf16 params, moments, compute",
                              "init": "random", "anchor_mfu": ANCHOR_MFU},
                              "plans": plans, "rows": rows, "tiny": args.tiny})
        if rows[-1]["fits"]:
            break


if __name__ == "__main__":
    main()
