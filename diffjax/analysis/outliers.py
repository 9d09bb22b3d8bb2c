"""Activation outliers (the paper's Table 5): the largest and the median magnitude of
  - attention logits: what each softmax sees, q k^T / sqrt(d), over every layer, head and (DIFF) both maps,
    at the (query, key) pairs attention uses (causal, within a document, no padding), and
  - hidden states: every layer's output (the residual stream after the block), over real tokens,
on a sample of held-out text from the checkpoint's data config (or of --text files).

Top-k is the k-th largest |value|, exact, each activation counted where it occurs (as the paper's Table 5 counts
them: its DIFF row has top-1 = top-2). The median |value| is over all values when a batch has at most
`median_sample` of them per layer, else over that many drawn uniformly (seeded) per layer and batch. The table says
which layers the 100 largest come from, and a note explains a row whose top-100 equals its top-1: activations
repeat wherever their inputs do. In the first layer a logit depends only on its two tokens and their distance
(RoPE), so a pair of tokens that recurs at one distance repeats its value (docs/analyses.md has an example).

    python -m diffjax.analysis.outliers --checkpoint runs/diff --checkpoint runs/transformer --tokens 65536 \\
        --output out/outliers.json   # and the figure, out/outliers.png
"""

from __future__ import annotations

import dataclasses
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
    top_layers: dict[str, np.ndarray]  # kind -> the layer (depth) each of `top` comes from

    def top_k(self, kind: str, k: int) -> float:
        values = self.top[kind]
        return float(values[k - 1]) if len(values) >= k else float("nan")

    def layers(self, kind: str) -> str:
        """The layers the largest values come from, most first: '0' or '3 (60), 1 (40)'."""
        depths, counts = np.unique(self.top_layers[kind], return_counts=True)
        order = np.argsort(-counts, kind="stable")
        if len(depths) == 1:
            return str(depths[0])
        return ", ".join(f"{depths[i]} ({counts[i]})" for i in order)

    def repeated(self, kind: str) -> bool:
        """Whether the largest max(TOP_K) values are one value (to 0.1%: the same activation, rounded apart)."""
        top = self.top[kind]
        return len(top) == max(TOP_K) and top[-1] >= 0.999 * top[0]


def _sample_index(size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    return np.arange(size, dtype=np.int32) if size <= count else rng.integers(0, size, count).astype(np.int32)


def statistics(model, batches: Sequence[dict], *, median_sample: int = 1 << 16, seed: int = 0) -> OutlierResult:
    """Table 5's figures for `model` over packed `batches` (tokens / segment_ids / positions [B, T])."""
    probe = make_probe(model, magnitudes)
    config, rng = model.config, np.random.default_rng(seed)
    kind = attention_kinds.get(config.attention)
    maps, heads = kind.maps, kind.map_heads(config)
    tops = {kind: [] for kind in KINDS}
    depths = {kind: [] for kind in KINDS}
    samples = {kind: [] for kind in KINDS}
    tokens = 0
    for batch in batches:
        B, T = batch["tokens"].shape
        aux = {"logits": _sample_index(maps * B * heads * T * T, median_sample, rng),
               "hidden": _sample_index(B * T * config.d_model, median_sample, rng)}
        _, observed = probe(batch["tokens"], batch["positions"], batch["segment_ids"], aux)
        for depth, layer in enumerate(jax.device_get(observed)):
            for kind in KINDS:
                top, sample = layer[kind]
                tops[kind].append(top[top >= 0])
                depths[kind].append(np.full(len(tops[kind][-1]), depth))
                samples[kind].append(sample[sample >= 0])
        tokens += int(np.count_nonzero(batch["segment_ids"]))
    values = {kind: np.concatenate(tops[kind]) for kind in KINDS}
    order = {kind: np.argsort(-values[kind], kind="stable")[: max(TOP_K)] for kind in KINDS}
    return OutlierResult(tokens, {kind: values[kind][order[kind]] for kind in KINDS},
                         {kind: float(np.median(np.concatenate(samples[kind]))) for kind in KINDS},
                         {kind: np.concatenate(depths[kind])[order[kind]] for kind in KINDS})


def format_results(labels: Sequence[str], results: Sequence[OutlierResult]) -> str:
    header = ["model", "activation"] + [f"top-{k}" for k in TOP_K] + ["median", f"top-{max(TOP_K)} from layers"]
    rows = [[label, kind] + [r.top_k(kind, k) for k in TOP_K] + [r.median[kind], r.layers(kind)]
            for kind in KINDS for label, r in zip(labels, results)]
    title = ("Largest activation magnitudes (top-k = k-th largest |value|, each occurrence counted) and the median "
             "|value|, over " + ", ".join(f"{r.tokens} tokens ({label})" for label, r in zip(labels, results)))
    notes = [f"note: {label}, {kind}: the {max(TOP_K)} largest are one value repeated (layers {r.layers(kind)}): "
             "activations repeat wherever their inputs do (in the first layer a logit depends only on its two tokens "
             "and their distance; in any layer on the document up to the query)"
             for kind in KINDS for label, r in zip(labels, results) if r.repeated(kind)]
    return "\n".join([common.table(header, rows, title=title), *notes])


def record(result: OutlierResult) -> dict:
    """A model's JSON entry: tokens sampled, and per kind the largest magnitudes (descending), the layer of each and
    the median."""
    return {"tokens": result.tokens, "top": {kind: [float(v) for v in result.top[kind]] for kind in KINDS},
            "median": result.median, "top_layers": {kind: [int(d) for d in result.top_layers[kind]] for kind in KINDS}}


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
    from diffjax.command_line import run

    run(main, "python -m diffjax.analysis.outliers")
