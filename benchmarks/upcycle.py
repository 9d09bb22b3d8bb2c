"""Upcycling against its alternatives (issue 27): a Transformer pretrained on text, then continued on a mix with
retrieval in it (associative recall, the retrieval benchmark's task) three ways, every path the same steps:

  Transformer, continued     the pretrained Transformer trained on
  upcycled DIFF V1           the pretrained Transformer upcycled (diffjax.convert.upcycle, second map mirrored, lambda
                             warm-up over --lambda-warmup steps: it starts as the Transformer), trained on
  DIFF V1 from scratch       DIFF V1 of the upcycled model's shape (with its per-head norm), pretrained on the same
                             text for the same steps, trained on

then analysed as benchmarks/retrieval.py analyses (recall accuracy, held-out text loss, attention to the answer and
to the noise, the largest attention logit). Data, mix and analysis settings are benchmarks/configs/reproduction/retrieval.yaml's.

    python benchmarks/upcycle.py                                     # ~40 min on 2 CPU cores (one seed)
    python benchmarks/upcycle.py --results benchmarks/results/upcycle_cpu   # also writes .json and .md there

Everything lives under --out-dir (rerunning resumes; finished runs are not trained again).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import retrieval  # noqa: E402

from diffjax.convert.upcycle import upcycle_directory, upcycled_config  # noqa: E402
from diffjax.data import builtin_documents  # noqa: E402
from diffjax.data.segments import to_json_line  # noqa: E402
from diffjax.run_dir import RunDir  # noqa: E402
from diffjax.train.config import RunConfig, build_config, merge  # noqa: E402

PATHS = ("Transformer, continued", "upcycled DIFF V1", "DIFF V1 from scratch")
METRICS = {  # name: (what, higher is better)
    "recall": ("recall accuracy, all pair counts and depths", True),
    "recall_most_pairs": ("recall accuracy at the most pairs", True),
    "text_loss": ("held-out text loss (nats per byte)", False),
    "answer": ("attention to the answer", True),
    "noise": ("attention noise", False),
    "top_logit": ("largest attention logit magnitude", False),
}


def write_text_data(mix: dict, data_dir: Path) -> Path:
    """data_dir/text.jsonl: the mix's text alone (what the pretraining sees)."""
    path = data_dir / "text.jsonl"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "tmp.jsonl").write_text("".join(to_json_line(d) + "\n" for d in builtin_documents(mix["text_bytes"])))
        (data_dir / "tmp.jsonl").rename(path)
    return path


def stage_config(values: dict, model: dict, data_path: Path, run_dir: Path, steps: int, seed: int, **sections) -> RunConfig:
    base = merge(values["run"], {"data": {"source": "jsonl", "paths": [str(data_path)], "tokenizer": {"kind": "byte"}}})
    update = {"model": model, "train": {"seed": seed, "run_dir": str(run_dir), "steps": steps},
              "checkpoint": {"every": steps, "keep": 1}}
    return build_config(RunConfig, merge(merge(base, update), sections))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/reproduction/upcycle"))
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--continue-steps", type=int, default=1000)
    parser.add_argument("--lambda-warmup", type=int, default=200, help="the upcycled model's optim.lambda_warmup_steps")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at once, one CPU thread each")
    parser.add_argument("--results", type=Path, help="also write <results>.json and <results>.md")
    args = parser.parse_args(argv)
    values = retrieval.read_config(retrieval.DEFAULT_CONFIG)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out_dir
    mix_path = retrieval.write_data(values["mix"], out / "data", values["run"]["data"]["seq_len"])
    text_path = write_text_data(values["mix"], out / "data")

    transformer = {"vocab_size": 257, **values["run"]["model"], "attention": "standard", "num_heads": 4}
    pretrain_base = build_config(RunConfig, merge(values["run"], {"model": transformer})).model
    diff_model = upcycled_config(pretrain_base, "diff").replace(subln=True).to_dict()
    start = time.time()
    pretrains = {}
    for seed in seeds:
        pretrains["Transformer", seed] = stage_config(values, transformer, text_path, out / f"pretrain-transformer-seed{seed}",
                                                      args.pretrain_steps, seed)
        pretrains["DIFF", seed] = stage_config(values, diff_model, text_path, out / f"pretrain-diff-seed{seed}",
                                               args.pretrain_steps, seed)
    seconds = retrieval.train_all(pretrains, args.jobs)

    continued = {}
    for seed in seeds:
        upcycled = out / f"upcycled-seed{seed}"
        if not RunDir(upcycled).steps():
            upcycle_directory(pretrains["Transformer", seed].train.run_dir, upcycled, kind="diff",
                              lambda_warmup_steps=args.lambda_warmup, seed=seed, overwrite=True)
        upcycled_model = yaml.safe_load(RunDir(upcycled).config_file.read_text())["model"]
        for label, model, source, extra in (
                (PATHS[0], transformer, pretrains["Transformer", seed].train.run_dir, {}),
                (PATHS[1], upcycled_model, str(upcycled), {"optim": {"lambda_warmup_steps": args.lambda_warmup}}),
                (PATHS[2], diff_model, pretrains["DIFF", seed].train.run_dir, {})):
            name = label.lower().replace(",", "").replace(" ", "-")
            continued[label, seed] = stage_config(values, model, mix_path, out / f"{name}-seed{seed}", args.continue_steps,
                                                  seed, train={"init_from": source}, **extra)
    seconds.update(retrieval.train_all(continued, args.jobs))
    training = time.time() - start

    figures = {}
    for (label, seed), config in continued.items():
        figures[label, seed] = retrieval.analyse(config, label, values["analysis"], values["mix"],
                                                 out / "data" / "held_out.jsonl")
        print(f"{label} seed {seed}: recall {figures[label, seed]['recall']:.3f}, "
              f"text loss {figures[label, seed]['text_loss']:.3f}", flush=True)
    summary = {label: {name: {"mean": float(np.mean([figures[label, s][name] for s in seeds])),
                              "std": float(np.std([figures[label, s][name] for s in seeds]))} for name in METRICS}
               for label in PATHS}
    for label in PATHS:
        summary[label]["params"] = figures[label, seeds[0]]["params"]
    chance = 10.0 ** -values["mix"]["value_digits"]
    setup = (f"d_model {transformer['d_model']}, {transformer['num_layers']} layers; pretraining {args.pretrain_steps} steps "
             f"on text, then {args.continue_steps} steps on the recall + text mix, {values['run']['train']['batch_size']} x "
             f"{values['run']['data']['seq_len']} tokens a step; lambda warm-up {args.lambda_warmup} steps for the upcycled "
             f"model; seeds {seeds}; training {training:.0f} s with {args.jobs} at once; recall chance {chance:g}")
    cell = lambda m: f"{m['mean']:.3f} ± {m['std']:.3f}" if len(seeds) > 1 else f"{m['mean']:.3f}"  # noqa: E731
    lines = ["# Upcycling a Transformer to DIFF against continuing it and DIFF from scratch", "", setup, ""]
    lines += retrieval._table(["metric", *(f"{label} ({summary[label]['params'] / 1e3:.0f}K)" for label in PATHS)],
                              [[f"{what} {'↑' if better else '↓'}", *(cell(summary[label][name]) for label in PATHS)]
                               for name, (what, better) in METRICS.items()])
    report = "\n".join(lines) + "\n"
    print(report)
    (out / "report.md").write_text(report)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        result = {"date": datetime.date.today().isoformat(), "setup": setup, "summary": summary,
                  "figures": {f"{label} seed {seed}": f for (label, seed), f in figures.items()},
                  "train_seconds": {f"{label} seed {seed}": s for (label, seed), s in seconds.items()}}
        args.results.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        args.results.with_suffix(".md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
