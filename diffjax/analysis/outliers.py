"""Activation outliers (the paper's Table 5): the largest and the median magnitude of
  - attention logits: what each softmax sees, q k^T / sqrt(d), over every layer, head and (DIFF) both maps,
    at the (query, key) pairs attention uses (causal, within a document, no padding), and
  - hidden states: every layer's output (the residual stream after the block), over real tokens,
on a sample of held-out text from the checkpoint's data config (or of --text files).

Top-k is the k-th largest |value|, exact. The median |value| is over all values when a batch has at most
`median_sample` of them per layer, else over that many drawn uniformly (seeded) per layer and batch.

    python -m diffjax.analysis.outliers --checkpoint runs/diff --checkpoint runs/transformer --tokens 65536 \\
        --output out/outliers.json   # and the figure, out/outliers.png
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import attention_kinds
from diffjax.analysis import common, figures
from diffjax.analysis.probe import LayerView, make_probe

TOP_K = (1, 2, 3, 10, 100)
KINDS = ("attention logits", "hidden states")


def _top_and_sample(magnitude, counted, index, k):
    """The k largest counted magnitudes (-1 fills when fewer are counted) and the sample at `index` (-1 where not counted)."""
    flat = jnp.where(counted, magnitude, -1.0).reshape(-1)
    return jax.lax.top_k(flat, min(k, flat.size))[0], flat[index]


def magnitudes(view: LayerView, aux) -> dict:
    k = max(TOP_K)
    logits = _top_and_sample(jnp.abs(view.logits_MBHTS), view.counted_BTS[None, :, None], aux["logits"], k)
    hidden = _top_and_sample(jnp.abs(view.hidden_BTD.astype(jnp.float32)), view.real_BT[..., None], aux["hidden"], k)
    return {"attention logits": logits, "hidden states": hidden}


@dataclasses.dataclass
class OutlierResult:
    tokens: int  # real tokens sampled
    top: dict[str, np.ndarray]  # kind -> the largest magnitudes, descending (up to max(TOP_K))
    median: dict[str, float]  # kind -> median magnitude

    def top_k(self, kind: str, k: int) -> float:
        values = self.top[kind]
        return float(values[k - 1]) if len(values) >= k else float("nan")


def _sample_index(size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    return np.arange(size, dtype=np.int32) if size <= count else rng.integers(0, size, count).astype(np.int32)


def statistics(model, batches: Sequence[dict], *, median_sample: int = 1 << 16, seed: int = 0) -> OutlierResult:
    """Table 5's figures for `model` over packed `batches` (tokens / segment_ids / positions [B, T])."""
    probe = make_probe(model, magnitudes)
    config, rng = model.config, np.random.default_rng(seed)
    kind = attention_kinds.get(config.attention)
    maps, heads = kind.maps, kind.map_heads(config)
    tops = {kind: [] for kind in KINDS}
    samples = {kind: [] for kind in KINDS}
    tokens = 0
    for batch in batches:
        B, T = batch["tokens"].shape
        aux = {"logits": _sample_index(maps * B * heads * T * T, median_sample, rng),
               "hidden": _sample_index(B * T * config.d_model, median_sample, rng)}
        _, observed = probe(batch["tokens"], batch["positions"], batch["segment_ids"], aux)
        for layer in jax.device_get(observed):
            for kind in KINDS:
                top, sample = layer[kind]
                tops[kind].append(top[top >= 0])
                samples[kind].append(sample[sample >= 0])
        tokens += int(np.count_nonzero(batch["segment_ids"]))
    top = {kind: np.sort(np.concatenate(tops[kind]))[::-1][: max(TOP_K)] for kind in KINDS}
    return OutlierResult(tokens, top, {kind: float(np.median(np.concatenate(samples[kind]))) for kind in KINDS})


def format_results(labels: Sequence[str], results: Sequence[OutlierResult]) -> str:
    header = ["model", "activation"] + [f"top-{k}" for k in TOP_K] + ["median"]
    rows = [[label, kind] + [r.top_k(kind, k) for k in TOP_K] + [r.median[kind]]
            for kind in KINDS for label, r in zip(labels, results)]
    title = ("Largest activation magnitudes (top-k = k-th largest |value|) and the median |value|, over "
             + ", ".join(f"{r.tokens} tokens ({label})" for label, r in zip(labels, results)))
    return common.table(header, rows, title=title)


def record(result: OutlierResult) -> dict:
    """A model's JSON entry: tokens sampled, and per kind the largest magnitudes (descending) and the median."""
    return {"tokens": result.tokens, "top": {kind: [float(v) for v in result.top[kind]] for kind in KINDS},
            "median": result.median}


def draw(entries: Sequence[dict], path: Path) -> None:
    """The paper's Table 5 as bars on a log scale: top-k and median magnitudes per activation kind, a bar per model."""
    figure, axes = figures.panels(2, title="Largest activation magnitudes (top-k: the k-th largest |value|)", width=5.5)
    categories = [f"top-{k}" for k in TOP_K] + ["median"]
    for ax, kind in zip(axes, KINDS):
        series = {entry["label"]: [entry["top"][kind][k - 1] if len(entry["top"][kind]) >= k else float("nan")
                                   for k in TOP_K] + [entry["median"][kind]] for entry in entries}
        figures.bars(ax, categories, series, title=kind, ylabel="|value|", log=True)
    figures.save(figure, path)


def main(argv=None) -> int:
    parser = common.parser(__doc__, "diffjax.analysis.outliers")
    parser.add_argument("--tokens", type=common.positive_int, default=32768, help="held-out tokens to sample (default 32768)")
    parser.add_argument("--seq-len", type=common.positive_int, default=None,
                        help="tokens per row (default: the run's data.seq_len)")
    parser.add_argument("--text", action="append", default=[], metavar="PATH",
                        help="text to sample (.jsonl, else text files; repeatable); default: the run's held-out documents")
    parser.add_argument("--batch-size", type=common.positive_int, default=8,
                        help="rows of --seq-len tokens per forward pass (default 8)")
    parser.add_argument("--median-sample", type=common.positive_int, default=1 << 16, help="values per layer and batch for the median")
    args = parser.parse_args(argv)

    def analyse(checkpoint):
        batches = common.text_batches(checkpoint, tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                                       paths=args.text)
        return statistics(checkpoint.model, batches, median_sample=args.median_sample)

    return common.run_cli(args, analyse, format_results, record=record, draw=draw)


if __name__ == "__main__":
    sys.exit(main())
