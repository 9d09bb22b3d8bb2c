"""Per-device memory of the train step against the context axis: does a long sequence fit once it is split?

    python benchmarks/context_memory.py                        # paper/diff-3b-64k (configs/), T = 65,536
    python benchmarks/context_memory.py --quick                # d_model 512, 4 layers: a minute on a laptop
    python benchmarks/context_memory.py --contexts 1,8 --seq-len 131072 --remat minimal

Nothing is allocated: on 8 simulated CPU devices (or the real ones, with --devices 0) the jitted train step of
the config is lowered and compiled for abstract state and batch, and XLA's memory analysis gives each device's
bytes: arguments (its shard of params, AdamW state and batch) + temporaries (activations kept for the backward
pass, scratch) + outputs - donated aliases. For context C the mesh is fsdp = devices / C x context = C, one
sequence per fsdp shard, so the params and optimizer state are split 8 ways in every row (fsdp x context) and
each device holds T / C tokens of activations. Then, per context, the sequence length is doubled while the step
fits the budget (default 80 GiB: an H100's 80 GB, less what CUDA and XLA keep): the largest that fits.

XLA CPU's buffer assignment stands in for the accelerator's; the figures are what the program needs, not what a
GPU allocator would add. Writes benchmarks/results/context_memory_<platform>.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform as py_platform
import sys
import time
from pathlib import Path

GiB = 1 << 30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="paper/diff-3b-64k", help="a shipped config's name or a YAML file")
    parser.add_argument("--contexts", default="1,2,4,8")
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--max-seq-len", type=int, default=1 << 20, help="stop doubling here")
    parser.add_argument("--remat", default="full", help="model.remat (a 64K run keeps only each block's input)")
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (0: the real ones)")
    parser.add_argument("--quick", action="store_true", help="d_model 512, 4 layers, 4 heads, vocab 32768")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def run_config(args):
    """The run config (scanned, args.remat; --quick: a small model) and its model config, long enough for every
    length tried."""
    from diffjax.train.config import load_run_config

    overrides = [f"model.remat={args.remat}", "model.scan_layers=true", "train.init_from=null"]
    if args.quick:
        overrides += ["model.d_model=512", "model.num_layers=4", "model.num_heads=4", "model.mlp_dim=1536",
                      "model.vocab_size=32768"]
    config = load_run_config(Path(args.config), overrides)
    return config, config.model.replace(max_seq_len=max(config.model.max_seq_len, args.max_seq_len))


def per_device_bytes(config, model, devices, budget: float, context: int, seq_len: int) -> dict:
    """XLA's memory analysis of the compiled train step on the mesh fsdp = devices / context x context, one
    sequence of seq_len per fsdp shard, for abstract state and batch (nothing is allocated)."""
    import jax
    import numpy as np

    from diffjax.train.mesh import ParallelConfig, make_mesh
    from diffjax.train.optimizer import make_optimizer
    from diffjax.train.step import sharded_init

    mesh = make_mesh(ParallelConfig(data=1, fsdp=len(devices) // context, context=context), devices)
    tx, schedule = make_optimizer(config.optim, config.train.steps)
    training, init = sharded_init(model, tx, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         jax.eval_shape(init, jax.random.key(0)), training.state_shardings)
    rows = mesh.shape["fsdp"]  # one sequence per batch shard
    tokens = jax.ShapeDtypeStruct((1, rows, seq_len), np.int32, sharding=training.step_batch_sharding)
    start = time.perf_counter()
    step = training.jit_train_step(tx, schedule, model)
    memory = step.lower(state, {"tokens": tokens, "segment_ids": tokens, "positions": tokens}).compile().memory_analysis()
    total = (memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes)
    return {"context": context, "fsdp": mesh.shape["fsdp"], "seq_len": seq_len, "tokens_per_device": rows * seq_len // len(devices),
            "argument_gib": memory.argument_size_in_bytes / GiB, "temp_gib": memory.temp_size_in_bytes / GiB,
            "total_gib": total / GiB, "fits": total <= budget, "compile_s": time.perf_counter() - start}


def measure(rows: list[dict], probe, first_seq_len: int, context: int, seq_len: int) -> dict:
    """probe(context, seq_len)'s row, appended to rows and printed (with its total against the first row at
    first_seq_len)."""
    row = probe(context, seq_len)
    rows.append(row)
    first = next(r for r in rows if r["seq_len"] == first_seq_len)
    ratio = row["total_gib"] / first["total_gib"] if row["seq_len"] == first_seq_len else float("nan")
    print(f"{context:>7} {row['fsdp']:>4} {seq_len:>8} {row['tokens_per_device']:>10} {row['argument_gib']:>9.2f} "
          f"{row['temp_gib']:>9.2f} {row['total_gib']:>9.2f} {ratio:>7.2f} {str(row['fits']):>5} "
          f"{row['compile_s']:>9.1f}", flush=True)
    return row


def search_lengths(measure_at, context: int, seq_len: int, max_seq_len: int) -> None:
    """From seq_len, double while the step fits (halve until it does), between 4096 and max_seq_len."""
    factor = 2 if measure_at(context, seq_len)["fits"] else 0.5
    while 4096 <= int(seq_len * factor) <= max_seq_len:
        seq_len = int(seq_len * factor)
        if measure_at(context, seq_len)["fits"] != (factor == 2):
            break


def main() -> None:
    args = parse_args()
    if args.devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"

    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    config, model = run_config(args)
    devices = jax.devices()
    print(f"{args.config} ({'quick: ' if args.quick else ''}d_model {model.d_model}, {model.num_layers} layers, "
          f"{model.num_heads} heads, {model.param_count() / 1e9:.2f}B params), remat {args.remat}, scanned, "
          f"{len(devices)} {devices[0].platform} devices, budget {args.budget_gib:g} GiB per device")
    print(f"{'context':>7} {'fsdp':>4} {'T':>8} {'tokens/dev':>10} {'args GiB':>9} {'temp GiB':>9} {'total GiB':>9} "
          f"{'vs C=1':>7} {'fits':>5} {'compile s':>9}")
    rows, largest = [], {}
    probe = functools.partial(per_device_bytes, config, model, devices, args.budget_gib * GiB)
    for context in [int(c) for c in args.contexts.split(",")]:
        search_lengths(functools.partial(measure, rows, probe, args.seq_len), context, args.seq_len, args.max_seq_len)
        largest[context] = max((r["seq_len"] for r in rows if r["context"] == context and r["fits"]), default=None)
    print("largest power-of-two multiple of T that fits, per context: "
          + ", ".join(f"C={c}: {largest.get(c, 'none')}" for c in sorted({r['context'] for r in rows})))
    out = Path(args.out or Path(__file__).parent / "results" / f"context_memory_{devices[0].platform}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__, "python": py_platform.python_version(), "config": args.config, "quick": args.quick,
        "remat": args.remat, "devices": len(devices), "platform": devices[0].platform, "budget_gib": args.budget_gib,
        "rows": rows, "largest_fitting_seq_len": largest,
    }, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
