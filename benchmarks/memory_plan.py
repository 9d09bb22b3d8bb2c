"""Memory per device for a large model on a mesh: the plan for Motif 3 at its published size (issue 47).

    python benchmarks/memory_plan.py                        # the plan table -> benchmarks/results/memory_plan.md
    python benchmarks/memory_plan.py --check                # and the formula against compiled programs (8 CPU devices)

Per device, in bytes, from the abstract params (jax.eval_shape: nothing allocated) and diffjax's own sharding rules
(diffjax.sharding.logical_spec: the spec a parameter really gets on that mesh, a dimension the axes do not divide
staying whole), computed by diffjax.train.plan (what `diffjax-train --plan` reports for any config; this benchmark
adds Motif 3's own activation working set, LoRA and generation plans):
  params       each parameter's shard, in param_dtype
  grads        full fine-tuning: one shard-sized gradient (param_dtype), live through the optimizer update
  optimizer    AdamW's two moments: in param_dtype as diffjax configures optax (bf16 for Motif 3), and the fp32
               alternative (mu and nu in fp32 plus an fp32 master copy: 12 bytes a parameter) for comparison
  activations  diffjax.train.plan's estimate under the config's model.remat (what `diffjax-train --plan` says), its
               remat none, vocabulary-table and expert-dispatch terms read from steps compiled for TPUs
               (benchmarks/compile_plan.py)
  kv cache     generation: GDLA's latent cache (kv_lora_rank + the shared RoPE key per token per layer, 2 bytes
               each), windowed layers a ring of attention_window slots, against expanded heads (k and v of every
               kv head)
LoRA: the base is frozen (no grads, no moments); the adapters' own memory is a few MB and left out.

--check compiles the real train step of a reduced config of the same kinds on this machine's 8 CPU devices (tests'
XLA_FLAGS) for several meshes and compares the compiled program's argument bytes (the train state and the batch) with
this formula's params + moments for the same config and mesh: the formula is what a compiled program holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

if "--check" in sys.argv:  # the compiled programs need 8 devices; on a CPU, simulated ones (before jax loads)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffjax.mesh_axes import MESH_AXES  # noqa: E402
from diffjax.train import plan as train_plan  # noqa: E402
from diffjax.train.plan import abstract_params, compiled_memory, params_bytes, split_of  # noqa: E402

GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results" / "memory_plan.md"


@dataclasses.dataclass
class Plan:
    name: str
    hardware: str
    hbm_gib: float  # what a device may allocate (GiB)
    mesh: dict[str, int]
    mode: str  # "lora", "full" or "generate"
    batch: int  # global sequences per step (train) or per decode batch (generate)
    seq_len: int
    device: str = "h100"  # the diffjax.hardware name whose attention route the activations assume
    margin: float = 0.9  # the share of hbm_gib a plan may fill
    loss_chunk: int | None = None  # train.loss_chunk (None: diffjax's default)


def kv_cache_bytes(config, tokens: int, latent: bool) -> int:
    """Generation's cache for `tokens` positions of one sequence: global layers hold every position, windowed layers
    a ring of attention_window slots."""
    a = config.attention_options
    per_slot = (a.kv_lora_rank + a.qk_rope_head_dim) if latent else config.num_kv_heads * (config.head_dim + a.v_head_dim)
    global_layers = len(config.global_layers) if config.attention_window else config.num_layers
    window = min(tokens, config.attention_window or tokens)
    slots = global_layers * tokens + (config.num_layers - global_layers) * window
    return slots * per_slot * np.dtype(config.dtype).itemsize


def plan_row(config, params, plan: Plan) -> dict:
    sizes = plan.mesh
    shard = params_bytes(params, sizes)
    row = {"plan": plan.name, "hardware": plan.hardware, "devices": math.prod(sizes.values()),
           "mesh": " ".join(f"{k}={v}" for k, v in sizes.items() if v > 1), "params": shard}
    if plan.mode == "full":
        row["grads"], row["optimizer"] = shard, 2 * shard
        row["optimizer_fp32"] = 12 * shard // np.dtype(config.param_dtype).itemsize  # fp32 mu, nu and master copy
    if plan.mode in ("full", "lora"):  # diffjax.train.plan's activations estimate, as `diffjax-train --plan`'s
        local_seqs = plan.batch // split_of("batch", sizes)
        full = {**dict.fromkeys(MESH_AXES, 1), **sizes}
        widths = train_plan.widths(config, plan.seq_len, plan.device, full["context"])
        chunk = train_plan.resolve_loss_chunk(plan.loss_chunk, config.vocab_size)
        row["activations"] = sum(train_plan.activation_bytes(config, widths, full, local_seqs, plan.seq_len, chunk,
                                                             frozen_head=plan.mode == "lora").values())
    if plan.mode == "generate":
        local_seqs = plan.batch / split_of("batch", sizes)
        row["kv_cache"] = local_seqs * kv_cache_bytes(config, plan.seq_len, latent=True)
        row["kv_cache_expanded"] = local_seqs * kv_cache_bytes(config, plan.seq_len, latent=False)
    row["total"] = sum(row.get(key, 0) for key in ("params", "grads", "optimizer", "activations", "kv_cache"))
    row["fits"] = row["total"] <= plan.margin * plan.hbm_gib * GiB
    return row


# The plans: the smallest meshes whose per-device total fits the device's budget, in powers of two. The budget is
# diffjax.train.plan's, the one rule of `diffjax-train --plan`: a v5p's HBM as libtpu gives it to a program (95.74
# GiB; its compiler refuses more), an H100's XLA_PYTHON_CLIENT_MEM_FRACTION of 79.2 GiB (JAX's 75% default: 59.4).
V5P = ("TPU v5p", train_plan.device_budget("v5p", 1).bytes / GiB)
H100 = ("H100 80GB", train_plan.device_budget("h100", 1).bytes / GiB)
PLANS = (
    Plan("LoRA fine-tune, 4K", *V5P, {"expert": 16}, "lora", 16, 4096, "v5p", 1.0),
    Plan("LoRA fine-tune, 4K", *H100, {"expert": 16, "context": 2}, "lora", 16, 4096, "h100", 1.0),
    Plan("LoRA fine-tune, 32K", *H100, {"expert": 16, "context": 16}, "lora", 16, 32768, "h100", 1.0),
    Plan("full fine-tune, 4K", *V5P, {"expert": 16, "fsdp": 4}, "full", 64, 4096, "v5p", 1.0),
    Plan("full fine-tune, 4K", *V5P, {"expert": 16, "fsdp": 8}, "full", 128, 4096, "v5p", 1.0),
    Plan("full fine-tune, 4K", *H100, {"expert": 16, "fsdp": 8}, "full", 128, 4096, "h100", 1.0),
    Plan("full fine-tune, 4K", *H100, {"expert": 16, "fsdp": 8, "context": 2}, "full", 128, 4096, "h100", 1.0),
    Plan("generate, 32K", *V5P, {"expert": 8}, "generate", 8, 32768, "v5p", 1.0),
    Plan("generate, 32K", *H100, {"expert": 16}, "generate", 16, 32768, "h100", 1.0),
    Plan("generate, 256K", *H100, {"expert": 16}, "generate", 16, 262144, "h100", 1.0),
)
COLUMNS = ("params", "grads", "optimizer", "activations", "kv_cache", "total")


def table(rows: list[dict]) -> str:
    head = "| plan | hardware | devices | mesh | " + " | ".join(f"{c} GiB" for c in COLUMNS) + " | fits |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        cells = [f"{row[c] / GiB:.1f}" if c in row else "-" for c in COLUMNS]
        lines.append(f"| {row['plan']} | {row['hardware']} | {row['devices']} | {row['mesh']} | " + " | ".join(cells)
                     + f" | {'yes' if row['fits'] else 'NO'} |")
    return "\n".join(lines)


def extras(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        if "optimizer_fp32" in row:
            total = row["total"] - row["optimizer"] + row["optimizer_fp32"]
            lines.append(f"- {row['plan']} on {row['hardware']}: with fp32 moments and master weights the optimizer "
                         f"takes {row['optimizer_fp32'] / GiB:.1f} GiB, total {total / GiB:.1f} GiB per device")
        if "kv_cache_expanded" in row:
            lines.append(f"- {row['plan']} on {row['hardware']}: an expanded-head cache would take "
                         f"{row['kv_cache_expanded'] / GiB:.1f} GiB per device instead of {row['kv_cache'] / GiB:.1f}")
    return "\n".join(lines)


# --check: the formula's params + moments against what XLA compiles for the real train step, per device.
CHECK_OVERRIDES = ["model.mlp_options.num_experts=8", "model.d_model=64", "model.num_heads=8", "model.num_kv_heads=2",
                   "model.attention_options.num_noise_heads=2", "model.attention_impl=xla"]
CHECK_MESHES = ({"expert": 8}, {"expert": 4, "data": 2}, {"expert": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 8},
                {"expert": 2, "fsdp": 4})


def compiled_state_bytes(run_config, sizes: dict[str, int]) -> tuple[int, int]:
    """(compiled argument bytes per device of the train step, of which the batch) on this machine's devices."""
    figures = compiled_memory(run_config, {"data": 1, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1, **sizes},
                              run_config.train.batch_size // split_of("batch", sizes))
    return figures["arguments"], figures["batch"]


def check(config_name: str) -> str:
    from diffjax.train.config import load_run_config

    run_config = load_run_config(config_name, CHECK_OVERRIDES)
    params = abstract_params(run_config.model)
    lines = [f"`{config_name}` with {' '.join(CHECK_OVERRIDES)}, the real train step compiled on 8 CPU devices:", "",
             "| mesh | formula: params + 2 moments (bytes/device) | compiled arguments minus the batch | ratio |",
             "|---|---|---|---|"]
    for sizes in CHECK_MESHES:
        full = {"data": 1, **sizes}
        formula = 3 * params_bytes(params, full)  # params, mu and nu
        compiled, batch = compiled_state_bytes(run_config, sizes)
        mesh = " ".join(f"{k}={v}" for k, v in sizes.items())
        lines.append(f"| {mesh} | {formula:,} | {compiled - batch:,} | {(compiled - batch) / formula:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="motif3/published", help="a shipped config's name or a YAML file")
    parser.add_argument("--check", action="store_true", help="also compare with compiled programs (8 CPU devices)")
    parser.add_argument("--check-config", default="motif3/small")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from diffjax.model.sizes import describe_parameter_counts
    from diffjax.train.config import load_run_config

    config = load_run_config(args.config).model
    params = abstract_params(config)
    rows = [plan_row(config, params, plan) for plan in PLANS]
    text = [f"# Memory per device: `{args.config}` ({describe_parameter_counts(config)})", "",
            "`python benchmarks/memory_plan.py` (the formula of its docstring; GiB = 2^30 bytes; activations at the "
            f"config's remat ({config.remat}), one sequence per device; optimizer moments in param_dtype as configured; "
            "fits: within diffjax.train.plan's budget, the HBM libtpu gives a v5p program, 75% of an H100's 79.2 GiB). "
            "Checked against compiled steps in compile_plan.md: the H100 rows assume grouped GEMMs for the experts, "
            "which XLA's GPU compiler in jax 0.10.2 rewrites densely (far past any H100).",
            "", table(rows), "", extras(rows)]
    if args.check:
        text += ["", "## The formula against compiled programs", "", check(args.check_config)]
    report = "\n".join(text) + "\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)


if __name__ == "__main__":
    main()
