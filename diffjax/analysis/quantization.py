"""Low-bit attention logits (the paper's Figure 8): the same evaluations with every layer's attention logits
quantized by dynamic absmax quantization to 8, 6 and 4 bits (one scale per sequence and layer, over all heads
and both maps; diffjax.analysis.probe.absmax_quantize) against the unquantized model ("16 bits" in the paper).

The paper's evaluation is zero-shot HellaSwag, which needs a download; these evaluations need none:
  - next-token loss and top-1 accuracy on held-out text of the checkpoint's data config (or --text files), and
  - multi-needle retrieval accuracy (diffjax.analysis.needles), averaged over the answer depths.

    python -m diffjax.analysis.quantization --checkpoint runs/diff --checkpoint runs/transformer --length 1024 \\
        --output out/quantization.json   # and the figure, out/quantization.png
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np
import optax

from diffjax.analysis import common, figures, needles
from diffjax.analysis.probe import QUANTIZATION_BITS, make_probe
from diffjax.losses import packed_target_mask

METRICS = ("text loss", "text accuracy", "needle accuracy")


def text_metrics(probe, batches: Sequence[dict]) -> tuple[float, float]:
    """(mean next-token loss, top-1 accuracy) over the targets inside documents of packed batches."""
    loss_sum = hits = count = 0.0
    for batch in batches:
        logits, _ = probe(batch["tokens"], batch["positions"], batch["segment_ids"])
        weights = np.asarray(packed_target_mask(batch["segment_ids"]), np.float64)
        targets = jnp.asarray(batch["tokens"])[:, 1:]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets)
        loss_sum += float(np.sum(np.asarray(losses) * weights))
        hits += float(np.sum((np.asarray(jnp.argmax(logits[:, :-1], -1)) == np.asarray(targets)) * weights))
        count += float(weights.sum())
    return loss_sum / max(count, 1.0), hits / max(count, 1.0)


@dataclasses.dataclass
class QuantizationResult:
    bits: tuple  # None (unquantized) first
    metrics: dict[tuple, float]  # (bits, metric name) -> value


def evaluate(checkpoint: common.Checkpoint, text: Sequence[dict], task: needles.NeedleTask | None, *,
             bits: Sequence[int] = QUANTIZATION_BITS, batch_size: int = 8) -> QuantizationResult:
    """Every metric at every bit width (None first: unquantized). task None: no needle evaluation."""
    all_bits = (None, *bits)
    if task is not None:  # before anything is computed
        needles.check_fits(task, checkpoint.tokenizer, checkpoint.model.config.max_seq_len)
    metrics, probe = {}, make_probe(checkpoint.model)
    for width in all_bits:
        quantized = functools.partial(probe, logit_bits=width)
        metrics[width, "text loss"], metrics[width, "text accuracy"] = text_metrics(quantized, text)
        if task is not None:
            accuracy = needles.evaluate(checkpoint, task, batch_size=batch_size, forward=quantized).accuracy
            metrics[width, "needle accuracy"] = float(np.mean(list(accuracy.values())))
    return QuantizationResult(all_bits, metrics)


def format_results(labels: Sequence[str], results: Sequence[QuantizationResult]) -> str:
    all_bits = results[0].bits
    header = ["model", "metric"] + ["unquantized" if b is None else f"{b} bits" for b in all_bits]
    rows = [[label, metric] + [r.metrics[b, metric] for b in all_bits]
            for metric in METRICS for label, r in zip(labels, results) if (all_bits[0], metric) in r.metrics]
    title = "Attention logits quantized by dynamic absmax (per sequence and layer): text loss (lower is better), accuracies"
    return common.table(header, rows, title=title)


def record(result: QuantizationResult) -> dict:
    """A model's JSON entry: bits ("unquantized" first) and `metrics["<metric>"]["<bits>"]`."""
    names = {width: "unquantized" if width is None else str(width) for width in result.bits}
    metrics = {metric: {names[width]: result.metrics[width, metric] for width in result.bits}
               for metric in METRICS if (result.bits[0], metric) in result.metrics}
    return {"bits": list(names.values()), "metrics": metrics}


def draw(entries: Sequence[dict], path: Path) -> None:
    """The paper's Figure 8: each metric against the attention logits' bits, a line per model."""
    bits, metrics = entries[0]["bits"], list(entries[0]["metrics"])
    figure, axes = figures.panels(len(metrics), title="Attention logits quantized by dynamic absmax (per sequence and layer)")
    for ax, metric in zip(axes, metrics):
        series = {entry["label"]: [entry["metrics"][metric][width] for width in bits] for entry in entries}
        figures.lines(ax, ["none" if width == "unquantized" else width for width in bits], series, categorical=True,
                      title=f"{metric} ({'lower' if metric == 'text loss' else 'higher'} is better)", ylabel=metric,
                      xlabel="bits of the attention logits (none: unquantized)")
    figures.save(figure, path)


def main(argv=None) -> int:
    parser = common.parser(__doc__, "diffjax.analysis.quantization")
    parser.add_argument("--bits", type=common.int_list, default=QUANTIZATION_BITS, help="bit widths (default 8,6,4)")
    parser.add_argument("--tokens", type=common.positive_int, default=16384, help="held-out text tokens (default 16384)")
    parser.add_argument("--seq-len", type=common.positive_int, default=None,
                        help="tokens per text row (default: the run's data.seq_len)")
    parser.add_argument("--text", action="append", default=[], metavar="PATH",
                        help="text to sample (.jsonl, else text files; repeatable); default: the run's held-out documents")
    parser.add_argument("--length", type=int, default=None,
                        help="needle context length in tokens (default: the longest the models fit; 0: no needles)")
    parser.add_argument("--needles", type=common.positive_int, default=4, help="N, needles per sample (default 4)")
    parser.add_argument("--queries", type=common.positive_int, default=1, help="R, query cities per sample (default 1)")
    parser.add_argument("--samples", type=common.positive_int, default=10, help="needle samples per depth (default 10)")
    parser.add_argument("--digits", type=common.positive_int, default=7, help="digits of the magic numbers (default 7)")
    parser.add_argument("--batch-size", type=common.positive_int, default=8,
                        help="text rows or needle samples per forward pass (default 8)")
    args = parser.parse_args(argv)
    if args.length is not None and args.length < 0:
        parser.error(f"argument --length: expected a positive integer or 0 (no needles), got {args.length}")
    tasks = []

    def prepare(checkpoints):
        length = args.length
        if length is None:
            length = min(needles.longest_context(c.tokenizer, c.model.config.max_seq_len, args.queries, args.digits)
                         for c in checkpoints)
        task = needles.NeedleTask((length,), args.needles, args.queries, samples=args.samples, digits=args.digits) if length else None
        for checkpoint in checkpoints:
            if task is not None:
                needles.check_fits(task, checkpoint.tokenizer, checkpoint.model.config.max_seq_len)
            common.check_seq_len(checkpoint, args.seq_len)
        tasks.append(task)

    def analyse(checkpoint):
        text = common.text_batches(checkpoint, tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                                   paths=args.text)
        return evaluate(checkpoint, text, tasks[0], bits=args.bits, batch_size=args.batch_size)

    return common.run_cli(args, analyse, format_results, prepare, record=record, draw=draw)


if __name__ == "__main__":
    from diffjax.command_line import run

    run(main, "python -m diffjax.analysis.quantization")
