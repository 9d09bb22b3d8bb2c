"""A small-scale reproduction of the paper's analyses: trains a DIFF model and its equal-parameter Transformer twin
(2x the heads) on the same data, text mixed with multi-needle retrieval examples, with the real trainer, then
prints the four analyses side by side.

    python benchmarks/reproduction.py                                        # benchmarks/configs/reproduction/small.yaml
    python benchmarks/reproduction.py --config benchmarks/configs/reproduction/medium.yaml
    python benchmarks/reproduction.py --results benchmarks/results/reproduction_small.txt

The config file has three sections: `run` (a train.py run config for the DIFF model; the twin is the same with
model.attention=standard and twice model.num_heads), `mix` (the training data) and `analysis` (the evaluations).
Everything goes under `out_dir`: data/, diff/ and transformer/ (train.py run directories: rerunning resumes, and
a finished run is not trained again) and report.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffjax.analysis import attention_scores, common, needles, outliers, quantization  # noqa: E402
from diffjax.data import builtin_documents, builtin_held_out  # noqa: E402
from diffjax.run_dir import RunDir  # noqa: E402
from diffjax.tokenizers import ByteTokenizer  # noqa: E402
from diffjax.train import train  # noqa: E402
from diffjax.train.config import RunConfig, build_config, merge  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "reproduction" / "small.yaml"
MIX_DEFAULTS = {"text_bytes": 1_500_000, "held_out_bytes": 200_000, "needle_examples": 5000,
                "needle_lengths": [64, 128, 160], "max_needles": 3, "max_queries": 2, "digits": 4, "seed": 1}
ANALYSIS_DEFAULTS = {"needle_lengths": [128, 192], "needles": 3, "queries": 1, "depths": list(needles.DEPTHS),
                     "samples": 20, "digits": 4, "text_tokens": 16384, "bits": [8, 6, 4], "quantization_samples": 10,
                     "batch_size": 8}


def read_config(path: Path) -> dict:
    values = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(values) - {"out_dir", "run", "mix", "analysis"})
    if unknown:
        raise ValueError(f"{path}: unknown sections {unknown}; allowed: out_dir, run, mix, analysis")
    for name, defaults in (("mix", MIX_DEFAULTS), ("analysis", ANALYSIS_DEFAULTS)):
        bad = sorted(set(values.get(name) or {}) - set(defaults))
        if bad:
            raise ValueError(f"{path}: unknown {name} keys {bad}; allowed: {sorted(defaults)}")
        values[name] = {**defaults, **(values.get(name) or {})}
    return values


def write_mix(mix: dict, data_dir: Path, seq_len: int) -> Path:
    """data_dir/mix.jsonl: the builtin corpus's documents (the stdlib's source) and the needle training examples,
    each of which must fit one training row with its eos (a longer one would be cut from its queries); and
    data_dir/held_out.jsonl: stdlib source the models never see."""
    path = data_dir / "mix.jsonl"
    if path.exists() and (data_dir / "held_out.jsonl").exists():
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    texts = builtin_documents(mix["text_bytes"])
    examples = needles.training_texts(ByteTokenizer(), mix["needle_examples"], lengths=mix["needle_lengths"],
                                      max_needles=mix["max_needles"], max_queries=mix["max_queries"],
                                      digits=mix["digits"], seed=mix["seed"])
    longest = max(len(ByteTokenizer().encode(example)) for example in examples)
    if longest + 1 > seq_len:
        raise ValueError(f"a needle example takes {longest} tokens + eos, more than data.seq_len {seq_len}: "
                         "lower mix.needle_lengths or mix.max_queries")
    # Held-out text for the outlier and quantization analyses: the stdlib files after the training ones.
    held_out = builtin_held_out(mix["text_bytes"], mix["held_out_bytes"])
    for name, documents in (("held_out.jsonl", held_out), ("mix.jsonl", texts + examples)):  # mix.jsonl last: done
        with open(data_dir / "tmp.jsonl", "w") as file:
            file.writelines(json.dumps({"text": text}) + "\n" for text in documents)
        (data_dir / "tmp.jsonl").rename(data_dir / name)
    print(f"data: {len(texts)} text documents ({mix['text_bytes']} bytes) + {len(examples)} needle examples "
          f"({sum(map(len, examples))} bytes) -> {path}; {len(held_out)} held-out text documents", flush=True)
    return path


def run_config(values: dict, kind: str, data_path: Path, run_dir: Path) -> RunConfig:
    run = merge(values["run"], {"data": {"source": "jsonl", "paths": [str(data_path)], "tokenizer": {"kind": "byte"}},
                                "train": {"run_dir": str(run_dir)}})
    run["model"] = {"vocab_size": ByteTokenizer.vocab_size, **run.get("model", {})}
    if kind == "standard":
        run["model"] = {**run["model"], "attention": "standard", "num_heads": 2 * run["model"]["num_heads"]}
    return build_config(RunConfig, run)


def final_losses(run_dir: Path) -> tuple[float | None, float | None]:
    """(last train loss, last eval loss) from the run's metrics.jsonl."""
    losses = {}
    for line in RunDir(run_dir).metrics_file.read_text().splitlines():
        record = json.loads(line)
        losses[record["kind"]] = record.get("loss", losses.get(record["kind"]))
    return losses.get("train"), losses.get("eval")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--results", type=Path, help="also write the report here (e.g. benchmarks/results/...)")
    args = parser.parse_args(argv)
    values = read_config(args.config)
    out_dir = Path(values.get("out_dir") or f"runs/reproduction/{args.config.stem}")
    seq_len = run_config(values, "diff", Path("mix.jsonl"), out_dir / "diff").data.seq_len
    data_path = write_mix(values["mix"], out_dir / "data", seq_len)
    report = [f"# {args.config.name}: {yaml.safe_dump({k: values[k] for k in ('run', 'mix', 'analysis')}, sort_keys=False)}"]
    runs = {}
    for kind, name in (("diff", "diff"), ("standard", "transformer")):
        config = run_config(values, kind, data_path, out_dir / name)
        start = time.perf_counter()
        train(config)
        elapsed = time.perf_counter() - start
        train_loss, eval_loss = final_losses(out_dir / name)
        report.append(f"{name}: {config.model.param_count()} params, {config.train.steps} steps of "
                      f"{config.global_batch_size} x {config.data.seq_len} tokens; final train loss {train_loss:.3f}, "
                      f"eval loss {eval_loss:.3f}; this call {elapsed:.0f} s")
        print(report[-1], flush=True)
        runs[name] = common.load_checkpoint(out_dir / name, name)
    labels, checkpoints = list(runs), list(runs.values())
    a = values["analysis"]
    task = needles.NeedleTask(tuple(a["needle_lengths"]), a["needles"], a["queries"], tuple(a["depths"]), a["samples"], a["digits"])
    score_task = needles.NeedleTask((a["needle_lengths"][-1],), a["needles"], a["queries"], tuple(a["depths"]), a["samples"], a["digits"])
    quant_task = needles.NeedleTask((a["needle_lengths"][-1],), a["needles"], a["queries"], tuple(a["depths"]),
                                    a["quantization_samples"], a["digits"])
    start = time.perf_counter()
    held_out = [str(out_dir / "data" / "held_out.jsonl")]
    text = {name: common.text_batches(c, tokens=a["text_tokens"], batch_size=a["batch_size"], paths=held_out)
            for name, c in runs.items()}
    sections = [
        needles.format_results(labels, [needles.evaluate(c, task, batch_size=a["batch_size"]) for c in checkpoints]),
        attention_scores.format_results(labels, [attention_scores.evaluate(c, score_task, batch_size=a["batch_size"])
                                                 for c in checkpoints]),
        outliers.format_results(labels, [outliers.statistics(c.model, text[name]) for name, c in runs.items()]),
        quantization.format_results(labels, [quantization.evaluate(c, text[name], quant_task, bits=tuple(a["bits"]),
                                                                   batch_size=a["batch_size"]) for name, c in runs.items()]),
    ]
    for section in sections:
        report.append("\n" + section)
        print(report[-1], flush=True)
    report.append(f"\nanalyses: {time.perf_counter() - start:.0f} s")
    print(report[-1])
    text_report = "\n".join(report) + "\n"
    (out_dir / "report.txt").write_text(text_report)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
