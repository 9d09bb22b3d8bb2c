"""Train the tiny Transformer, DIFF V1, DIFF V2 and Shared DIFF on the same data for the same steps at matched
parameter counts, and print one table: parameters, final train and eval loss.

    python benchmarks/variants.py                 # the tiny config's model and data, 200 steps each (~6 min, 2 cores)
    python benchmarks/variants.py --steps 400     # the default run's length

Every model is configs/tiny.yaml's (d_model 128, 4 layers; DIFF with 4 differential heads of 16, the others
with 8 heads of 16) trained by train.py's `train()` with the same seed, data order and recipe. Parameter
counts are matched to DIFF V1's by each other variant's MLP width (mlp_dim, the one size free to move): V2's
doubled query projection costs MLP width, Shared DIFF's low-rank q / k gives it some. Train loss is the mean
over the last quarter of logged steps (single batches are noisy); eval loss is the run's final evaluation on
the held-out split. Writes benchmarks/results/variants_<platform>.json. One seed: differences of a few
hundredths of a nat are within run-to-run noise at this size.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from diffjax.config import ModelConfig  # noqa: E402
from diffjax.train import load_run_config, train  # noqa: E402

VARIANTS = {  # name: model overrides of configs/tiny.yaml
    "Transformer": {"attention": "standard", "num_heads": 8},
    "DIFF V1": {"attention": "diff", "num_heads": 4},
    "DIFF V2": {"attention": "diff_v2", "num_heads": 8},
    "Shared DIFF": {"attention": "shared_diff", "num_heads": 4},
}
REFERENCE = "DIFF V1"


def matched_mlp_dim(model: ModelConfig, target: int) -> int:
    """The mlp_dim whose parameter count is closest to `target` (each unit of width costs 3 d_model per layer)."""
    per_unit = 3 * model.d_model * model.num_layers
    return max(1, model.mlp_dim + round((target - model.param_count()) / per_unit))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--config", default="tiny", help="a shipped config's name or a YAML file")
    parser.add_argument("--run-root", default=str(REPO / "runs" / "variants"), help="run dirs, replaced each time")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/variants_<platform>.json)")
    args = parser.parse_args()

    common = [f"train.steps={args.steps}", "train.eval_every=0", f"checkpoint.every={args.steps}", "train.sample_tokens=0",
              "train.progress=lines", "parallel.data=1"]
    base = load_run_config(args.config, common).model
    target = base.replace(**VARIANTS[REFERENCE]).param_count()
    rows = []
    for name, fields in VARIANTS.items():
        model = base.replace(**fields)
        if name != REFERENCE:
            model = model.replace(mlp_dim=matched_mlp_dim(model, target))
        run_dir = Path(args.run_root) / name.lower().replace(" ", "-")
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = common + [f"train.run_dir={run_dir}"] + [f"model.{k}={v}" for k, v in fields.items()]
        overrides.append(f"model.mlp_dim={model.mlp_dim}")
        config = load_run_config(args.config, overrides)
        assert config.model.param_count() == model.param_count()
        print(f"== {name}: {model.param_count():,} params (mlp_dim {model.mlp_dim})", flush=True)
        start = time.perf_counter()
        result = train(config, log=lambda line: None)
        seconds = time.perf_counter() - start
        logged = sorted(result.losses)
        last_quarter = [result.losses[s] for s in logged if s > args.steps * 3 / 4]
        rows.append({
            "variant": name, "attention": model.attention, "params": model.param_count(), "mlp_dim": model.mlp_dim,
            "num_heads": model.num_heads, "head_dim": model.head_dim,
            "attention_options": model.attention_options and dataclasses.asdict(model.attention_options), "train_loss": sum(last_quarter) / len(last_quarter),
            "eval_loss": result.eval_losses[result.step], "seconds": round(seconds, 1),
        })
        print(f"   train {rows[-1]['train_loss']:.4f}  eval {rows[-1]['eval_loss']:.4f}  ({seconds:.0f} s)", flush=True)

    header = f"{'variant':<12} {'params':>9} {'mlp_dim':>7} {'heads x d':>9} {'train loss':>10} {'eval loss':>9} {'time':>6}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['variant']:<12} {r['params']:>9,} {r['mlp_dim']:>7} {r['num_heads']:>4} x {r['head_dim']:<2} "
                     f"{r['train_loss']:>10.4f} {r['eval_loss']:>9.4f} {r['seconds']:>5.0f}s")
    table = "\n".join(lines)
    print(f"\n{args.steps} steps of {config.train.batch_size} x {config.data.seq_len} tokens, nats per byte "
          f"(train: mean of the last quarter of logged steps; eval: final)\n{table}")
    platform = jax.default_backend()
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"variants_{platform}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "platform": platform, "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "config": args.config, "steps": args.steps, "rows": rows, "table": table,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
