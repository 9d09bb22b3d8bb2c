"""The retrieval reproduction (issue 25): the Transformer, DIFF V1, DIFF V2 and Shared DIFF at matched parameter
counts, several seeds each, trained by train.py on associative recall (diffjax.analysis.recall: the loss on the
answers alone) mixed with text, then compared with the paper's analyses, each claim given a verdict.

    python benchmarks/retrieval.py                     # benchmarks/configs/reproduction/retrieval.yaml (~1 h on 2 CPU cores)
    python benchmarks/retrieval.py --results benchmarks/results/retrieval_cpu   # also writes .json and .md there

Per model and seed: recall accuracy by pairs in context (more pairs = a longer context with more distractors) and
by depth of the first asked pair; held-out text loss; attention to the answer and to the noise (Table 3, on the
examples with the most pairs); the largest attention logit and hidden state (Table 5, on held-out text); recall
accuracy and text loss with the attention logits quantized to `analysis.bits` (Figure 8). Everything lives under
`out_dir`: data/, one train.py run directory per model and seed (rerunning resumes; a finished run is not trained
again), their logs, and report.md.

A verdict compares each DIFF kind with the Transformer over seeds: "reproduced" when every DIFF seed is better than
every Transformer seed, "reversed" when every one is worse, else "too close to call" (with 3 seeds a side, an
ordering this complete happens by chance once in 20 for either direction). A model whose recall accuracy is not
at least 3x chance (every seed) has not learned the task: its retrieval claims get "not learned" (the outlier and
text-loss claims do not depend on it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from variants import matched_mlp_dim  # noqa: E402

from diffjax.analysis import attention_scores, common, outliers, quantization, recall  # noqa: E402
from diffjax.analysis.probe import make_probe  # noqa: E402
from diffjax.data import builtin_documents, builtin_held_out  # noqa: E402
from diffjax.data.segments import to_json_line  # noqa: E402
from diffjax.run_dir import RunDir  # noqa: E402
from diffjax.tokenizers import ByteTokenizer  # noqa: E402
from diffjax.train.config import RunConfig, build_config, merge  # noqa: E402

DEFAULT_CONFIG = REPO / "benchmarks" / "configs" / "reproduction" / "retrieval.yaml"
SECTIONS = {"out_dir", "models", "reference", "seeds", "jobs", "run", "mix", "analysis"}
MIX_KEYS = {"recall_examples", "pair_counts", "max_queries", "key_letters", "value_digits", "text_bytes",
            "held_out_bytes", "seed"}
ANALYSIS_KEYS = {"pair_counts", "num_queries", "samples", "text_tokens", "bits", "batch_size"}
BASELINE = "Transformer"
LEARNED = 3.0  # times chance: below this a model has not learned the task
# The paper's figures (3B models, 4K contexts; arXiv 2410.05258), beside which ours are printed.
PAPER = {
    "recall": "Table 2, N=6 R=2: Transformer 0.55, DIFF 0.85",
    "recall_most_pairs": "Table 2: the gap grows with the needles, 0.00 at N=1 to 0.30 at N=6 R=2",
    "answer": "Table 3: Transformer 0.03-0.09, DIFF 0.27-0.40",
    "noise": "Table 3: Transformer 0.49-0.54, DIFF 0.01-0.02",
    "top_logit": "Table 5: Transformer 318.0, DIFF 38.8",
    "top_hidden": "Table 5: Transformer 3608.6, DIFF 1688.2",
    "recall_quantized": "Figure 8 (HellaSwag): 4-bit DIFF ~25 points above 4-bit Transformer",
    "text_loss": "Figure 3: DIFF matches a Transformer of ~1.5x its size",
}
# metric: (what it measures, True when higher is better, meaningful only once the task is learned)
METRICS = {
    "recall": ("recall accuracy, all pair counts and depths", True, True),
    "recall_most_pairs": ("recall accuracy at the most pairs (most distractors)", True, True),
    "answer": ("attention to the answer", True, True),
    "noise": ("attention noise", False, True),
    "top_logit": ("largest attention logit magnitude", False, False),
    "top_hidden": ("largest hidden state magnitude", False, False),
    "recall_quantized": ("recall accuracy, attention logits quantized", True, True),
    "text_loss": ("held-out text loss (nats per byte)", False, False),
}


def read_config(path: Path) -> dict:
    values = yaml.safe_load(path.read_text()) or {}
    for where, found, allowed in (("sections", set(values), SECTIONS), ("mix keys", set(values.get("mix") or {}), MIX_KEYS),
                                  ("analysis keys", set(values.get("analysis") or {}), ANALYSIS_KEYS)):
        if found - allowed or (where == "sections" and allowed - found - {"out_dir"}):
            raise ValueError(f"{path}: {where} {sorted(found)} must be {sorted(allowed)} (out_dir optional)")
    if values["reference"] not in values["models"] or BASELINE not in values["models"]:
        raise ValueError(f"{path}: models must include the reference {values['reference']!r} and {BASELINE!r}")
    return values


def write_data(mix: dict, data_dir: Path, seq_len: int) -> Path:
    """data_dir/mix.jsonl (recall examples as segments documents, text documents) and held_out.jsonl (text)."""
    path = data_dir / "mix.jsonl"
    if path.exists():
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    documents = recall.training_documents(
        ByteTokenizer(), mix["recall_examples"], pair_counts=mix["pair_counts"], max_queries=mix["max_queries"],
        key_letters=mix["key_letters"], value_digits=mix["value_digits"], seed=mix["seed"])
    longest = max(sum(len(text.encode()) for text, _ in document) for document in documents)
    if longest + 1 > seq_len:
        raise ValueError(f"a recall example takes {longest} tokens + eos, more than data.seq_len {seq_len}: "
                         "lower mix.pair_counts or mix.max_queries")
    texts = builtin_documents(mix["text_bytes"])
    held_out = builtin_held_out(mix["text_bytes"], mix["held_out_bytes"])
    for name, lines in (("held_out.jsonl", held_out), ("mix.jsonl", documents + texts)):  # mix.jsonl last: done
        (data_dir / "tmp.jsonl").write_text("".join(to_json_line(line) + "\n" for line in lines))
        (data_dir / "tmp.jsonl").rename(data_dir / name)
    print(f"data: {len(documents)} recall examples, {len(texts)} text documents ({mix['text_bytes']} bytes) -> {path}",
          flush=True)
    return path


def run_configs(values: dict, data_path: Path, out_dir: Path) -> dict[tuple[str, int], RunConfig]:
    """(label, seed) -> the run's config; every model's mlp_dim matches the reference's parameter count."""
    base = merge(values["run"], {"data": {"source": "jsonl", "paths": [str(data_path)], "tokenizer": {"kind": "byte"}}})
    base["model"] = {"vocab_size": ByteTokenizer.vocab_size, **base["model"]}

    def config(label, seed, mlp_dim=None):
        model = {**base["model"], **values["models"][label], **({"mlp_dim": mlp_dim} if mlp_dim else {})}
        run_dir = out_dir / f"{label.lower().replace(' ', '-')}-seed{seed}"
        return build_config(RunConfig, merge(base, {"model": model, "train": {"seed": seed, "run_dir": str(run_dir)}}))

    target = config(values["reference"], 0).model.param_count()
    configs = {}
    for label in values["models"]:
        mlp_dim = None if label == values["reference"] else matched_mlp_dim(config(label, 0).model, target)
        configs.update({(label, seed): config(label, seed, mlp_dim) for seed in values["seeds"]})
    return configs


def finished(config: RunConfig) -> bool:
    return config.train.steps in RunDir(config.train.run_dir).steps()


def train_all(configs: dict, jobs: int) -> dict[tuple[str, int], float]:
    """Trains every unfinished run with train.py, `jobs` at once (one CPU thread each when jobs > 1); returns
    each run's seconds (0 for those already finished)."""
    env = dict(os.environ)
    if jobs > 1:
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    pending = [key for key, config in configs.items() if not finished(config)]
    running, seconds = {}, {key: 0.0 for key in configs}
    while pending or running:
        while pending and len(running) < jobs:
            key = pending.pop(0)
            run_dir = Path(configs[key].train.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir.parent / f"{run_dir.name}.yaml").write_text(yaml.safe_dump(configs[key].to_dict(), sort_keys=False))
            log = open(run_dir.parent / f"{run_dir.name}.log", "a")
            command = [sys.executable, str(REPO / "train.py"), "--config", str(run_dir.parent / f"{run_dir.name}.yaml")]
            running[key] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log, time.time())
            print(f"training {key[0]} seed {key[1]}: {run_dir}", flush=True)
        time.sleep(1)
        for key, (process, log, start) in list(running.items()):
            if process.poll() is not None:
                log.close()
                del running[key]
                if process.returncode:
                    raise RuntimeError(f"training {key} failed (exit {process.returncode}); see {log.name}")
                seconds[key] = time.time() - start
                print(f"  {key[0]} seed {key[1]} done in {seconds[key]:.0f} s", flush=True)
    return seconds


def analyse(config: RunConfig, label: str, a: dict, mix: dict, held_out: Path) -> dict:
    """One trained model's figures (module docstring)."""
    checkpoint = common.load_checkpoint(config.train.run_dir, label)
    task = recall.RecallTask(pair_counts=tuple(a["pair_counts"]), num_queries=a["num_queries"], samples=a["samples"],
                             key_letters=mix["key_letters"], value_digits=mix["value_digits"])
    probe = make_probe(checkpoint.model)
    quantized = functools.partial(probe, logit_bits=a["bits"])
    accuracy = recall.evaluate(checkpoint, task, batch_size=a["batch_size"], forward=probe).accuracy
    accuracy_quantized = recall.evaluate(checkpoint, task, batch_size=a["batch_size"], forward=quantized).accuracy
    text = common.text_batches(checkpoint, tokens=a["text_tokens"], batch_size=a["batch_size"], paths=[str(held_out)])
    most = max(task.pair_counts)
    examples = [e for depth in task.depths for e in task.examples(checkpoint.tokenizer, most, depth)]
    answer, noise = attention_scores.score_examples(checkpoint.model, examples, a["batch_size"])
    top = outliers.statistics(checkpoint.model, text)
    return {
        "params": checkpoint.model.num_params(),
        "recall": float(np.mean(list(accuracy.values()))),
        "recall_most_pairs": float(np.mean([accuracy[most, d] for d in task.depths])),
        "recall_by_pairs": {n: float(np.mean([accuracy[n, d] for d in task.depths])) for n in task.pair_counts},
        "recall_by_depth": {d: float(np.mean([accuracy[n, d] for n in task.pair_counts])) for d in task.depths},
        "recall_quantized": float(np.mean(list(accuracy_quantized.values()))),
        "text_loss": quantization.text_metrics(probe, text)[0],
        "text_loss_quantized": quantization.text_metrics(quantized, text)[0],
        "answer": float(np.mean([scores.mean() for scores in answer.values()])),
        "noise": float(np.mean([scores.mean() for scores in noise.values()])),
        "top_logit": top.top_k("attention logits", 1),
        "top_hidden": top.top_k("hidden states", 1),
        "median_logit": top.median["attention logits"],
        "median_hidden": top.median["hidden states"],
    }


def verdict(diff: list[float], baseline: list[float], higher_is_better: bool, learned: bool) -> str:
    if not learned:
        return "not learned"
    sign = 1 if higher_is_better else -1
    if min(sign * x for x in diff) > max(sign * x for x in baseline):
        return "reproduced"
    if max(sign * x for x in diff) < min(sign * x for x in baseline):
        return "reversed"
    return "too close to call"


def summarize(figures: dict, values: dict) -> dict:
    """label -> metric -> {mean, std, seeds}; and the verdicts of every DIFF kind against the Transformer."""
    chance = 10.0 ** -values["mix"]["value_digits"]
    summary = {}
    for label in values["models"]:
        runs = [figures[label, seed] for seed in values["seeds"]]
        summary[label] = {name: {"mean": float(np.mean([r[name] for r in runs])), "std": float(np.std([r[name] for r in runs])),
                                 "seeds": [r[name] for r in runs]}
                          for name in [*METRICS, "text_loss_quantized"]}
        for axis in ("recall_by_pairs", "recall_by_depth"):
            summary[label][axis] = {str(k): {"mean": float(np.mean([r[axis][k] for r in runs])),
                                             "std": float(np.std([r[axis][k] for r in runs]))} for k in runs[0][axis]}
        summary[label]["learned"] = min(r["recall"] for r in runs) >= LEARNED * chance
        summary[label]["params"] = runs[0]["params"]
    verdicts = {}
    for label in values["models"]:
        if label == BASELINE:
            continue
        learned = summary[label]["learned"] and summary[BASELINE]["learned"]
        verdicts[label] = {name: verdict(summary[label][name]["seeds"], summary[BASELINE][name]["seeds"], better,
                                         learned or not on_recall)
                           for name, (_, better, on_recall) in METRICS.items()}
    return {"chance": chance, "models": summary, "verdicts": verdicts}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + ["| " + " | ".join(row) + " |" for row in rows]


def markdown(result: dict, values: dict) -> str:
    models, verdicts, labels = result["models"], result["verdicts"], list(values["models"])
    cell = lambda m: f"{m['mean']:.3f} ± {m['std']:.3f}"  # noqa: E731
    lines = [f"# Retrieval reproduction ({len(values['seeds'])} seeds per model; mean ± std over seeds)", "",
             result["setup"], ""]
    lines += _table(["metric", *(f"{label} ({models[label]['params'] / 1e3:.0f}K)" for label in labels), "paper"],
                    [[f"{what} {'↑' if better else '↓'}", *(cell(models[label][name]) for label in labels), PAPER[name]]
                     for name, (what, better, _) in METRICS.items()])
    for axis, title, unit in (("recall_by_pairs", f"by pairs in context (chance {result['chance']:g})", " pairs"),
                              ("recall_by_depth", "by depth of the first asked pair (mean over pair counts)", "% depth")):
        lines += ["", f"Recall accuracy {title}:", ""]
        lines += _table(["", *labels], [[f"{key}{unit}", *(cell(models[label][axis][key]) for label in labels)]
                                        for key in models[labels[0]][axis]])
    lines += ["", "Verdicts against the Transformer (reproduced: every seed better; reversed: every seed worse):", ""]
    lines += _table(["claim", *verdicts], [[what, *(verdicts[label][name] for label in verdicts)]
                                          for name, (what, _, _) in METRICS.items()])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--results", type=Path, help="also write <results>.json and <results>.md")
    args = parser.parse_args(argv)
    values = read_config(args.config)
    out_dir = Path(values.get("out_dir") or f"runs/reproduction/{args.config.stem}")
    data_path = write_data(values["mix"], out_dir / "data", values["run"]["data"]["seq_len"])
    configs = run_configs(values, data_path, out_dir)
    start = time.time()
    seconds = train_all(configs, values["jobs"])
    training = time.time() - start
    figures = {}
    for (label, seed), config in configs.items():
        figures[label, seed] = analyse(config, label, values["analysis"], values["mix"], out_dir / "data" / "held_out.jsonl")
        print(f"{label} seed {seed}: recall {figures[label, seed]['recall']:.3f}, text loss "
              f"{figures[label, seed]['text_loss']:.3f}", flush=True)
    result = summarize(figures, values)
    some = next(iter(configs.values()))
    result["setup"] = (f"{some.train.steps} steps of {some.train.batch_size} x {some.data.seq_len} tokens per model and seed "
                       f"(d_model {some.model.d_model}, {some.model.num_layers} layers; parameters matched by mlp_dim); "
                       f"training {training:.0f} s with {values['jobs']} at once, analyses {time.time() - start - training:.0f} s; "
                       f"attention logits quantized to {values['analysis']['bits']} bits for the quantized rows")
    result.update(date=datetime.date.today().isoformat(), config=yaml.safe_load(args.config.read_text()),
                  figures={f"{label} seed {seed}": f for (label, seed), f in figures.items()},
                  train_seconds={f"{label} seed {seed}": s for (label, seed), s in seconds.items()})
    report = markdown(result, values)
    print(report)
    (out_dir / "report.md").write_text(report)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        args.results.with_suffix(".md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
