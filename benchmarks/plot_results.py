"""Figures of the benchmarks' result files, each written beside its JSON (the same name, .png):

    retrieval_<platform>.json   recall by attention kind and seed, and by pairs in context (benchmarks/retrieval.py)
    generate_<platform>.json    decode tokens/s against batch size, diffjax beside transformers (benchmarks/generate.py)
    attention_<platform>.json   attention TFLOP/s against sequence length per kernel, DIFF beside each kernel's
                                baseline (cuDNN's on a GPU) (benchmarks/attention.py)

    python benchmarks/plot_results.py                    # every such file in benchmarks/results/
    python benchmarks/plot_results.py --results DIR

Needs matplotlib (pip install 'diffjax[plot]').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from diffjax.analysis import figures  # noqa: E402


def draw_retrieval(results: dict, path: Path) -> None:
    """Recall per kind with a bar per seed, and the mean recall per kind against the pairs in context."""
    models, seeds = results["models"], results["config"]["seeds"]
    figure, (by_seed, by_pairs) = figures.panels(2, title=f"Retrieval reproduction, {results['date']} (dashed: chance)",
                                                 width=5.5)
    figures.bars(by_seed, list(models), {f"seed {seed}": [models[kind]["recall"]["seeds"][i] for kind in models]
                                         for i, seed in enumerate(seeds)},
                 title="Recall accuracy by kind and seed", ylabel="accuracy")
    pairs = sorted(models[next(iter(models))]["recall_by_pairs"], key=int)
    figures.lines(by_pairs, [int(n) for n in pairs], {kind: [models[kind]["recall_by_pairs"][n]["mean"] for n in pairs]
                                                      for kind in models},
                  title=f"Recall by pairs in context (mean of {len(seeds)} seeds)", ylabel="accuracy",
                  xlabel="key-value pairs in context", logx=True)
    for ax in (by_seed, by_pairs):
        ax.axhline(results["chance"], color="gray", linestyle="--", linewidth=1)
        ax.set_ylim(0, 1.05)
    figures.save(figure, path)


def draw_generate(results: dict, path: Path) -> None:
    """Decode tokens/s against batch size, a panel per (dtype, prompt length), diffjax and each transformers mode."""
    rows = results["rows"]
    settings = sorted({(row["dtype"], row["prompt_len"]) for row in rows})
    systems = [name for name in rows[0] if isinstance(rows[0][name], dict) and "tokens_per_s" in rows[0][name]]
    figure, axes = figures.panels(len(settings), title=f"Decode throughput, {results['device']} "
                                                       f"({rows[0]['new_tokens']} new tokens)")
    for ax, (dtype, prompt_len) in zip(axes, settings):
        chosen = sorted((row for row in rows if (row["dtype"], row["prompt_len"]) == (dtype, prompt_len)),
                        key=lambda row: row["batch"])
        series = {name if name == "diffjax" else f"transformers {name}":
                  [row[name]["tokens_per_s"] if name in row else np.nan for row in chosen] for name in systems}
        figures.lines(ax, [row["batch"] for row in chosen], series, title=f"{dtype}, prompt {prompt_len} tokens",
                      ylabel="tokens / s", xlabel="batch size", logx=True, logy=True)
    figures.save(figure, path)


def draw_attention(results: dict, path: Path) -> None:
    """TFLOP/s against T, a panel per (causal, pass), bars for each kernel's DIFF and baseline (interpreted Pallas,
    whose timings mean nothing, left out)."""
    records = [record for record in results["records"] if not record.get("interpret")]
    lengths = sorted({record["T"] for record in records})
    impls = list(dict.fromkeys(record["impl"] for record in records))
    settings = list(dict.fromkeys((record["causal"], record["pass"]) for record in records))
    device = results["device"]
    figure, axes = figures.panels(len(settings), title=f"Attention TFLOP/s (nominal FLOPs), {device['kind']}, "
                                                       f"{results['dtype']}", width=4.2)
    for ax, (causal, which) in zip(axes, settings):
        def tflops(impl, what, T):
            found = [r[f"{what}_tflops"] for r in records if (r["impl"], r["T"], r["causal"], r["pass"]) == (impl, T, causal, which)]
            return found[0] if found else np.nan

        series = {f"{impl} {label}": [tflops(impl, what, T) for T in lengths]
                  for impl in impls for what, label in (("diff", "DIFF"), ("baseline", "baseline"))}
        figures.bars(ax, [str(T) for T in lengths], series, title=f"{'causal' if causal else 'full'}, {which}",
                     ylabel="TFLOP/s", xlabel="sequence length T")
    figures.save(figure, path)


DRAW = {"retrieval": draw_retrieval, "generate": draw_generate, "attention": draw_attention}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/plot_results.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results", help="the results directory")
    args = parser.parse_args(argv)
    paths = [path for kind in DRAW for path in sorted(args.results.glob(f"{kind}_*.json"))]
    if not paths:
        print(f"error: --results {args.results}: no {', '.join(f'{kind}_*.json' for kind in DRAW)} files", file=sys.stderr)
        return 2
    for path in paths:
        try:
            DRAW[path.name.split("_")[0]](json.loads(path.read_text()), path.with_suffix(".png"))
        except figures.MatplotlibMissing:
            print("error: matplotlib is not installed (pip install 'diffjax[plot]')", file=sys.stderr)
            return 2
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
