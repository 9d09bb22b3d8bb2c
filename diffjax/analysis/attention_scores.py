"""Attention to the answer span and attention noise in the retrieval task (the paper's Table 3).

On the multi-needle samples of diffjax.analysis.needles, from every position that predicts an answer token
(teacher-forced, as the accuracy is measured), sum each layer's effective map, A1 - lambda A2 for DIFF and A
for the baseline, over
  - the answer span: the tokens of that query's needle in the context ("The magic number for X is N."), and
  - the noise: every other context token (filler and the other needles).
Each row of the map is normalized by its sum first (1 - lambda for DIFF, 1 for the baseline), so the two
models' scores are shares of the same total. Scores are averaged over heads, layers, answer positions and
samples, per answer depth.

    python -m diffjax.analysis.attention_scores --checkpoint runs/diff --checkpoint runs/transformer --length 1024 \\
        --output out/attention_scores.json   # and the figure, out/attention_scores.png
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from diffjax.analysis import common, figures
from diffjax.analysis.needles import DEPTHS, NeedleExample, NeedleTask, batches, check_fits, longest_context
from diffjax.analysis.probe import LayerView, make_probe

OTHER_CONTEXT, OUTSIDE_CONTEXT = -1, -2  # key labels besides a query's index (its needle)


def key_labels(example: NeedleExample, length: int) -> np.ndarray:
    """int32 [length]: r for the tokens of query r's needle, -1 for the rest of the context, -2 after it."""
    labels = np.full(length, OUTSIDE_CONTEXT, np.int32)
    labels[: example.context_length] = OTHER_CONTEXT
    for query, (start, end) in enumerate(example.needle_spans):
        labels[start:end] = query
    return labels


def row_labels(example: NeedleExample, length: int) -> np.ndarray:
    """int32 [length]: r at the positions that predict query r's answer tokens, -1 elsewhere (not scored)."""
    labels = np.full(length, -1, np.int32)
    for query, (start, end) in enumerate(example.answer_spans):
        labels[start - 1 : end - 1] = query
    return labels


def span_scores(view: LayerView, aux) -> dict:
    """Per query row: the normalized effective map summed over its answer span and over the noise, mean over heads."""
    effective_BHTS = view.effective_BHTS
    row_sum_BHT1 = jnp.sum(effective_BHTS, axis=-1, keepdims=True)
    normalized_BHTS = effective_BHTS / jnp.where(row_sum_BHT1 == 0, 1.0, row_sum_BHT1)
    rows_BT, keys_BS = aux["rows"], aux["keys"]
    answer_BTS = (keys_BS[:, None, :] == rows_BT[:, :, None]) & (rows_BT[:, :, None] >= 0)
    noise_BTS = (keys_BS[:, None, :] != OUTSIDE_CONTEXT) & ~answer_BTS
    return {
        "answer": jnp.mean(jnp.sum(normalized_BHTS * answer_BTS[:, None], axis=-1), axis=1),
        "noise": jnp.mean(jnp.sum(normalized_BHTS * noise_BTS[:, None], axis=-1), axis=1),
    }


@dataclasses.dataclass
class ScoreResult:
    task: NeedleTask
    answer: dict[int, np.ndarray]  # depth -> [layers]: mean normalized attention to the answer span
    noise: dict[int, np.ndarray]  # depth -> [layers]: mean normalized attention to the rest of the context


def evaluate(checkpoint: common.Checkpoint, task: NeedleTask, *, batch_size: int = 8) -> ScoreResult:
    """Table 3 for one model at task.lengths[0] (the first length only)."""
    check_fits(task, checkpoint.tokenizer, checkpoint.model.config.max_seq_len)
    length = task.lengths[0]
    examples = [example for depth in task.depths for example in task.examples(checkpoint.tokenizer, length, depth)]
    return ScoreResult(task, *score_examples(checkpoint.model, examples, batch_size))


def score_examples(model, examples: Sequence[NeedleExample], batch_size: int = 8):
    """(answer, noise): depth -> [layers] mean scores over the examples at that depth (any task whose examples are
    NeedleExamples: the needles', diffjax.analysis.recall's)."""
    probe = make_probe(model, span_scores)
    per_depth = {example.depth: {"answer": [], "noise": []} for example in examples}
    for chunk, ids in batches(examples, batch_size, model.config.max_seq_len):
        rows = chunk + [chunk[0]] * (len(ids) - len(chunk))
        aux = {"rows": np.stack([row_labels(e, ids.shape[1]) for e in rows]),
               "keys": np.stack([key_labels(e, ids.shape[1]) for e in rows])}
        _, observed = probe(ids, aux=aux)
        for b, example in enumerate(chunk):
            scored = aux["rows"][b] >= 0
            for name in ("answer", "noise"):  # [layers]: mean over this sample's scored rows
                per_depth[example.depth][name].append([float(np.asarray(layer[name])[b, scored].mean()) for layer in observed])
    return tuple({depth: np.mean(scores[name], axis=0) for depth, scores in per_depth.items()} for name in ("answer", "noise"))


def format_results(labels: Sequence[str], results: Sequence[ScoreResult]) -> str:
    task = results[0].task
    header = ["model"] + [f"answer {d}%" for d in task.depths] + [f"noise {d}%" for d in task.depths]
    rows = [[label] + [float(r.answer[d].mean()) for d in task.depths] + [float(r.noise[d].mean()) for d in task.depths]
            for label, r in zip(labels, results)]
    title = (f"Attention to the answer span (higher is better) and attention noise (lower is better), by answer depth; "
             f"context {task.lengths[0]} tokens, N={task.num_needles}, R={task.num_queries}, {task.samples} samples per depth, "
             "mean over layers and heads of the row-normalized effective map. A differential map A1 - lambda A2 can "
             "weigh a span negatively: an answer score below 0 means the second map puts more on the answer than "
             "the first (lambda-weighted), which is worse than 0")
    return common.table(header, rows, title=title)


def record(result: ScoreResult) -> dict:
    """A model's JSON entry: the task, and answer / noise ["<depth>"] = the mean score of each layer."""
    return {"task": dataclasses.asdict(result.task),
            **{name: {str(depth): [float(v) for v in scores[depth]] for depth in result.task.depths}
               for name, scores in (("answer", result.answer), ("noise", result.noise))}}


def draw(entries: Sequence[dict], path: Path) -> None:
    """The paper's Table 3 as bars: attention to the answer and attention noise by depth, a bar per model."""
    task = entries[0]["task"]
    figure, axes = figures.panels(2, title=f"Normalized attention, context {task['lengths'][0]} tokens, "
                                           f"N={task['num_needles']}, R={task['num_queries']} (mean over layers and heads)")
    depths = [f"{depth}%" for depth in task["depths"]]
    for ax, name, better in zip(axes, ("answer", "noise"), ("higher", "lower")):
        series = {entry["label"]: [float(np.mean(entry[name][str(d)])) for d in task["depths"]] for entry in entries}
        figures.bars(ax, depths, series, title=f"Attention to the {name}{' span' if name == 'answer' else ''} "
                     f"({better} is better)", ylabel="share of the row's attention", xlabel="answer depth")
    figures.save(figure, path)


def main(argv=None) -> int:
    parser = common.parser(__doc__, "diffjax.analysis.attention_scores")
    parser.add_argument("--length", type=common.positive_int, default=None,
                        help="context length in tokens (default: the longest the models fit)")
    parser.add_argument("--needles", type=common.positive_int, default=4, help="N, needles per sample (default 4)")
    parser.add_argument("--queries", type=common.positive_int, default=1, help="R, query cities per sample (default 1)")
    parser.add_argument("--depths", type=common.int_list, default=DEPTHS,
                        help="answer depths in percent (default 0,25,50,75,100)")
    parser.add_argument("--samples", type=common.positive_int, default=20, help="samples per depth (default 20)")
    parser.add_argument("--digits", type=common.positive_int, default=7, help="digits of the magic numbers (default 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default 0)")
    parser.add_argument("--batch-size", type=common.positive_int, default=4, help="samples per forward pass (default 4)")
    args = parser.parse_args(argv)
    tasks = []

    def prepare(checkpoints):
        length = args.length or min(longest_context(c.tokenizer, c.model.config.max_seq_len, args.queries, args.digits)
                                    for c in checkpoints)
        tasks.append(NeedleTask((length,), args.needles, args.queries, args.depths, args.samples, args.digits, args.seed))
        for checkpoint in checkpoints:
            check_fits(tasks[0], checkpoint.tokenizer, checkpoint.model.config.max_seq_len)

    return common.run_cli(args, lambda c: evaluate(c, tasks[0], batch_size=args.batch_size), format_results, prepare,
                          record=record, draw=draw)


if __name__ == "__main__":
    from diffjax.command_line import run

    run(main, "python -m diffjax.analysis.attention_scores")
