"""Multi-query associative recall (MQAR; Zoology, arXiv:2312.04927) written as text: a context of key-value pairs
(" ab42 xk07 ..."), then queries ("\\nab") each answered by its value. A few-layer model learns it on a CPU
in minutes, where the paper's multi-needle task (needles.py) needs far more training, so the attention kinds can
be compared on retrieval at a scale that decides something.

It has the needle task's structure: every pair but the queried ones is a distractor; the first query's pair sits
at the answer depth (0% = the first pair, 100% = the last); examples are `needles.NeedleExample`s (needle spans =
the queried pairs, answer spans = the values after the queries), scored teacher-forced as the needle task is
(`needles.retrieved`), seeded by (seed, pairs, depth, index).

    from diffjax.analysis import recall
    documents = recall.training_documents(ByteTokenizer(), 20000, pair_counts=(4, 8, 16, 32))  # segments.to_json_line
    result = recall.evaluate(checkpoint, recall.RecallTask(pair_counts=(8, 16, 32)))

    python -m diffjax.analysis.recall --checkpoint runs/diff --checkpoint runs/transformer --pairs 8,16,32 \\
        --output out/recall.json   # and the figure, out/recall.png
    python -m diffjax.analysis.recall --write-training recall.jsonl --count 20000 --pairs 4,8,16,32
"""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from diffjax.analysis import common
from diffjax.analysis.needles import DEPTHS, NeedleExample, accuracy_by_depth, draw_accuracy_grids
from diffjax.data.segments import Segments, to_json_line
from diffjax.tokenizers import Tokenizer

# Zoology's layout: each key directly followed by its value (letters, then digits), so retrieving is one
# induction step: find the key earlier, copy what followed it. Key and value are encoded apart (the value's tokens
# are the answer's).
PAIR = " {key}"
QUERY = "\n{key}"  # a query restates its key; the value follows


def make_example(tokenizer: Tokenizer, *, num_pairs: int, num_queries: int, depth: int, rng: np.random.Generator,
                 key_letters: int = 2, value_digits: int = 2) -> NeedleExample:
    """num_pairs distinct keys of key_letters lowercase letters with values of value_digits digits; the queries ask
    num_queries distinct keys, the first of them the pair at `depth` percent of the context."""
    return _make(tokenizer, num_pairs, num_queries, depth, rng, key_letters, value_digits)[0]


def _make(tokenizer, num_pairs, num_queries, depth, rng, key_letters, value_digits) -> tuple[NeedleExample, Segments]:
    """The example and its text as segments (each piece encoded apart; the answers labelled)."""
    if not 1 <= num_queries <= num_pairs <= 26 ** key_letters:
        raise ValueError(f"need 1 <= queries ({num_queries}) <= pairs ({num_pairs}) <= {26 ** key_letters} keys of "
                         f"{key_letters} letters")
    if not 0 <= depth <= 100:
        raise ValueError(f"depth must be a percentage in [0, 100], got {depth}")
    if not 1 <= value_digits <= 9:
        raise ValueError(f"value_digits must be in [1, 9], got {value_digits}")
    letters = np.array(list(string.ascii_lowercase))
    codes = rng.choice(26 ** key_letters, num_pairs, replace=False)
    keys = ["".join(letters[(code // 26 ** np.arange(key_letters)) % 26]) for code in codes]
    values = [str(v).zfill(value_digits) for v in rng.integers(0, 10 ** value_digits, num_pairs)]
    # keys[0] is the first query's pair: placed at the depth, the others shuffled around it.
    order = list(rng.permutation(np.arange(1, num_pairs)))
    order.insert(round(depth / 100 * (num_pairs - 1)), 0)
    asked = [0] + [int(i) for i in rng.choice(np.arange(1, num_pairs), num_queries - 1, replace=False)]
    segments = [(text, False) for i in order for text in (PAIR.format(key=keys[i]), values[i])]
    segments += [(text, answer) for i in asked for text, answer in ((QUERY.format(key=keys[i]), False), (values[i], True))]
    pieces = [np.asarray(tokenizer.encode(text), np.int32) for text, _ in segments]
    ends = np.cumsum([len(piece) for piece in pieces])
    starts = ends - [len(piece) for piece in pieces]
    pair_spans = {i: (int(starts[2 * n]), int(ends[2 * n + 1])) for n, i in enumerate(order)}
    answer_spans = tuple((int(starts[n]), int(ends[n])) for n in range(2 * num_pairs + 1, len(segments), 2))
    ids = np.concatenate(pieces)
    example = NeedleExample(ids, tokenizer.decode(ids), depth, int(ends[2 * num_pairs - 1]),
                            tuple(pair_spans[i] for i in asked), answer_spans, tuple(values[i] for i in asked))
    return example, tuple(segments)


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """One evaluation: every (pairs, depth) cell gets `samples` examples."""

    pair_counts: tuple[int, ...] = (8, 16, 32)  # key-value pairs per context (num_queries of them asked)
    num_queries: int = 4
    depths: tuple[int, ...] = DEPTHS
    samples: int = 50
    key_letters: int = 2
    value_digits: int = 2
    seed: int = 0

    def examples(self, tokenizer: Tokenizer, num_pairs: int, depth: int) -> list[NeedleExample]:
        return [make_example(tokenizer, num_pairs=num_pairs, num_queries=self.num_queries, depth=depth,
                             key_letters=self.key_letters, value_digits=self.value_digits,
                             rng=np.random.default_rng((self.seed, num_pairs, depth, index)))
                for index in range(self.samples)]


def training_documents(tokenizer: Tokenizer, count: int, *, pair_counts: Sequence[int], max_queries: int | None = None,
                       key_letters: int = 2, value_digits: int = 2, seed: int = 1) -> list[Segments]:
    """`count` training examples as segments documents (diffjax.data.segments: the loss counts the answers
    alone, the rest being random keys and values no model can predict), with pair counts drawn from
    pair_counts, 1..max_queries queries (None: as many as pairs) and any depth. Write them with
    `segments.to_json_line` for the trainer's jsonl source. Use a seed other than the evaluation's (0): no
    evaluation sample is then trained on."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        num_pairs = int(rng.choice(pair_counts))
        most = num_pairs if max_queries is None else min(num_pairs, max_queries)
        _, segments = _make(tokenizer, num_pairs, int(rng.integers(1, most + 1)), int(rng.integers(0, 101)), rng,
                            key_letters, value_digits)
        documents.append(segments)
    return documents


@dataclasses.dataclass
class RecallResult:
    task: RecallTask
    accuracy: dict[tuple[int, int], float]  # (pairs, depth) -> mean share of queries retrieved


def evaluate(checkpoint: common.Checkpoint, task: RecallTask, *, batch_size: int = 16,
             forward: Callable | None = None) -> RecallResult:
    """Recall accuracy per (pairs, depth), teacher-forced (needles.retrieved). forward(tokens_BT) -> logits
    (default: the model's forward through diffjax.analysis.probe)."""
    from diffjax.analysis.probe import make_probe

    forward = forward or make_probe(checkpoint.model)
    accuracy = {}
    for num_pairs in task.pair_counts:
        examples = [example for depth in task.depths for example in task.examples(checkpoint.tokenizer, num_pairs, depth)]
        by_depth = accuracy_by_depth(examples, forward, batch_size, checkpoint.model.config.max_seq_len)
        accuracy.update({(num_pairs, depth): value for depth, value in by_depth.items()})
    return RecallResult(task, accuracy)


def format_results(labels: Sequence[str], results: Sequence[RecallResult]) -> str:
    """Rows: depths and their average; columns: each model at each pair count."""
    task = results[0].task
    header = ["depth"] + [f"{label} @{n} pairs" for label in labels for n in task.pair_counts]
    rows = [[f"{depth}%"] + [r.accuracy[n, depth] for r in results for n in task.pair_counts] for depth in task.depths]
    rows.append(["avg"] + [float(np.mean([r.accuracy[n, d] for d in task.depths])) for r in results for n in task.pair_counts])
    chance = 10.0 ** -task.value_digits
    title = (f"Associative recall accuracy ({task.num_queries} queries, {task.samples} samples per cell, "
             f"{task.value_digits}-digit values: chance {chance:g}; columns: model @pairs in context)")
    return common.table(header, rows, title=title)


def record(result: RecallResult) -> dict:
    """A model's JSON entry: the task, and `accuracy["<pairs>"]["<depth>"]`."""
    accuracy = {str(pairs): {str(depth): result.accuracy[pairs, depth] for depth in result.task.depths}
                for pairs in result.task.pair_counts}
    return {"task": dataclasses.asdict(result.task), "accuracy": accuracy}


def draw(entries: Sequence[dict], path: Path) -> None:
    """Accuracy over answer depth x pairs in context, one heat map per model (as the needles' Figure 5)."""
    task = entries[0]["task"]
    draw_accuracy_grids(entries, path, columns="pair_counts", xlabel="key-value pairs in context",
                        title=f"Associative recall accuracy ({task['num_queries']} queries, {task['samples']} samples "
                              f"per cell, chance {10.0 ** -task['value_digits']:g})")


def main(argv=None) -> int:
    parser = common.parser(__doc__, "diffjax.analysis.recall", checkpoint_required=False)  # not to write training data
    parser.add_argument("--pairs", type=common.positive_int_list, default=RecallTask.pair_counts,
                        help="key-value pairs per context, one column each (default 8,16,32)")
    parser.add_argument("--queries", type=common.positive_int, default=RecallTask.num_queries,
                        help="keys asked per sample (default 4; training data: 1 to this many)")
    parser.add_argument("--depths", type=common.int_list, default=DEPTHS, help="answer depths in percent (default 0,25,50,75,100)")
    parser.add_argument("--samples", type=common.positive_int, default=RecallTask.samples,
                        help="samples per (pairs, depth) (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default 0)")
    parser.add_argument("--batch-size", type=common.positive_int, default=16,
                        help="samples per forward pass (default 16)")
    parser.add_argument("--write-training", type=Path, metavar="JSONL",
                        help="write --count training documents (segments lines: the loss counts the answers) instead")
    parser.add_argument("--count", type=common.positive_int, default=1000, help="training documents to write (default 1000)")
    args = parser.parse_args(argv)
    if args.write_training:
        return _write_training(args)
    if not args.checkpoint:
        parser.error("give --checkpoint DIR (one or more) or --write-training JSONL")
    task = RecallTask(args.pairs, args.queries, args.depths, args.samples, seed=args.seed)
    return common.run_cli(args, lambda c: evaluate(c, task, batch_size=args.batch_size), format_results,
                          record=record, draw=draw)


def _write_training(args) -> int:
    """Byte-tokenizer training documents, seeded apart from the evaluation's samples."""
    from diffjax.tokenizers import ByteTokenizer

    if not common.make_parent(args.write_training, "--write-training"):
        return 2
    documents = training_documents(ByteTokenizer(), args.count, pair_counts=args.pairs, max_queries=args.queries,
                                   seed=args.seed + 1)
    with open(args.write_training, "w") as file:
        file.writelines(to_json_line(document) + "\n" for document in documents)
    print(f"wrote {len(documents)} documents to {args.write_training}")
    return 0


if __name__ == "__main__":
    from diffjax.command_line import run

    run(main, "python -m diffjax.analysis.recall")
