"""Compile time and compiled memory of the train step against depth: layers scanned vs unrolled, per remat policy.

    python benchmarks/compile_time.py                          # 24 layers, d_model 512, batch 8 x 512 tokens
    python benchmarks/compile_time.py --quick                  # d_model 256, batch 4 x 256 tokens
    python benchmarks/compile_time.py --quick --layers 4,12,24,48 --remat none
    python benchmarks/compile_time.py --init configs/paper/*.yaml   # the train-state init only

For every (layers, scan_layers, remat) it lowers and compiles the jitted train step (AdamW, one device) and
reports the wall time of `.lower()` and of `.compile()`, and XLA's compiled memory analysis (temp bytes:
activations kept for the backward pass plus scratch). Ratios are against the unrolled, no-remat step
of the same depth measured in the same run. Writes runs/benchmarks/compile_<platform>.json (or --out).
With --init, lowers and compiles the jitted train-state init of each config file instead (what
train.py runs first; nothing is allocated) and writes runs/benchmarks/compile_init_<platform>.json (or --out).
The dated record is benchmarks/results/compile_cpu.json and compile_init_cpu.json (compile_time.md): a run
replaces it only when asked to, e.g. `--out benchmarks/results/compile_cpu.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform as py_platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffjax.config import ModelConfig  # noqa: E402
from diffjax.train.mesh import ParallelConfig, make_mesh  # noqa: E402
from diffjax.train.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from diffjax.train.config import load_run_config  # noqa: E402
from diffjax.train.step import setup_sharded_state, sharded_init  # noqa: E402


def measure(model_config: ModelConfig, batch: int, seq_len: int) -> dict:
    mesh = make_mesh(ParallelConfig(data=1), jax.devices()[:1])
    tx, schedule = make_optimizer(OptimizerConfig(), 100)
    training, state = setup_sharded_state(model_config, tx, 0, mesh)
    step = training.jit_train_step(tx, schedule, model_config)
    tokens = jax.ShapeDtypeStruct((1, batch, seq_len), np.int32, sharding=training.step_batch_sharding)
    batch_spec = {"tokens": tokens, "segment_ids": tokens, "positions": tokens}
    start = time.perf_counter()
    lowered = step.lower(state, batch_spec)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    memory = compiled.memory_analysis()
    return {
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "hlo_chars": len(lowered.as_text()),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
    }


def measure_init(config_path: Path) -> dict:
    config = load_run_config(config_path)
    tx, _ = make_optimizer(config.optim, config.train.steps)
    _, init = sharded_init(config.model, tx, make_mesh(ParallelConfig(data=1), jax.devices()[:1]))
    start = time.perf_counter()
    lowered = init.lower(jax.random.key(0))
    lowered_at = time.perf_counter()
    lowered.compile()
    compiled_at = time.perf_counter()
    return {"config": str(config_path), "params": config.model.param_count(), "lower_s": lowered_at - start,
            "compile_s": compiled_at - lowered_at, "hlo_chars": len(lowered.as_text())}


def write_json(out: Path, figures: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform, "jax": jax.__version__,
        "python": py_platform.python_version(), "date": datetime.date.today().isoformat(), **figures,
    }, indent=1))
    print(f"wrote {out}")


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="d_model 256, batch 4 x 256 tokens")
    parser.add_argument("--layers", type=int_list, default=[24], help="comma-separated depths, e.g. 4,12,24,48")
    parser.add_argument("--scan", choices=("both", "true", "false"), default="both")
    parser.add_argument("--remat", default="none,minimal,full", help="comma-separated remat policies")
    parser.add_argument("--init", type=Path, nargs="+", default=None, help="config files: time the train-state init")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON to write (default: runs/benchmarks/compile[_init]_<platform>.json, git-ignored)")
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    results = Path(__file__).resolve().parents[1] / "runs" / "benchmarks"  # not the tracked record in results/
    if args.init:
        rows = []
        for config_path in args.init:
            rows.append(measure_init(config_path))
            row = rows[-1]
            print(f"  {config_path}: {row['params'] / 1e9:.2f}B params, init lower {row['lower_s']:5.2f} s"
                  f"  compile {row['compile_s']:5.2f} s  hlo {row['hlo_chars'] / 1e3:.0f} k chars", flush=True)
        write_json(args.out or results / f"compile_init_{platform}.json", {"rows": rows})
        return
    d_model, batch, seq_len = (256, 4, 256) if args.quick else (512, 8, 512)
    scans = {"both": (False, True), "true": (True,), "false": (False,)}[args.scan]
    remats = args.remat.split(",")
    base = ModelConfig(vocab_size=1024, d_model=d_model, num_layers=args.layers[0], num_heads=4, max_seq_len=seq_len,
                       dtype="bfloat16")
    print(f"{platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}: DIFF d_model {d_model}, "
          f"layers {args.layers}, batch {batch} x {seq_len} tokens, bfloat16 compute, AdamW")
    rows = []
    for layers in args.layers:
        for scan in scans:
            for remat in remats:
                figures = measure(base.replace(num_layers=layers, scan_layers=scan, remat=remat), batch, seq_len)
                rows.append({"layers": layers, "scan_layers": scan, "remat": remat, **figures})
                print(f"  layers={layers:<3} scan={scan!s:<5} remat={remat:<7} lower {figures['lower_s']:6.2f} s"
                      f"  compile {figures['compile_s']:6.2f} s  temp {figures['temp_bytes'] / 2**20:8.1f} MiB"
                      f"  hlo {figures['hlo_chars'] / 1e3:7.0f} k chars", flush=True)
    references = {row["layers"]: row for row in rows if not row["scan_layers"] and row["remat"] == "none"}
    if references:
        print("\nratios against the unrolled, no-remat step of the same depth:")
    for row in rows:
        reference = references.get(row["layers"])
        if reference is None:
            continue
        total = (row["lower_s"] + row["compile_s"]) / (reference["lower_s"] + reference["compile_s"])
        row["time_ratio"], row["temp_ratio"] = total, row["temp_bytes"] / reference["temp_bytes"]
        print(f"  layers={row['layers']:<3} scan={row['scan_layers']!s:<5} remat={row['remat']:<7} "
              f"lower+compile x{total:5.2f}   temp x{row['temp_ratio']:5.2f}")
    write_json(args.out or results / f"compile_{platform}.json",
               {"model": base.to_dict(), "batch": batch, "seq_len": seq_len, "rows": rows})


if __name__ == "__main__":
    main()
