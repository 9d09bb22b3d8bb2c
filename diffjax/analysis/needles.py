"""Multi-needle retrieval (the paper's section 3.4, after LWM and Gemini 1.5): N needles, each a sentence giving
a city a magic number, in a haystack of filler sentences; R query cities asked after it. The first query's needle
sits at the answer depth (0% = the start of the context, 100% = its end); the other needles, the other
queries' included, sit at random sentence boundaries.

Accuracy is measured teacher-forced: a query counts as retrieved when every token of its answer is the argmax
given the correct prefix, which is exactly when greedy decoding would write the answer, so one forward pass
scores a sample. A sample's accuracy is the share of its R queries retrieved.

    python -m diffjax.analysis.needles --checkpoint runs/diff --checkpoint runs/transformer \\
        --lengths 1024,2048 --needles 4 --queries 2 --samples 50 --output out/needles.json   # and out/needles.png
    python -m diffjax.analysis.needles --write-training needles.jsonl --count 10000 --lengths 256,512
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from diffjax.analysis import common, figures
from diffjax.tokenizers import Tokenizer

DEPTHS = (0, 25, 50, 75, 100)
CITIES = (
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Berlin", "Bogota", "Boston", "Budapest", "Cairo", "Chicago",
    "Copenhagen", "Dakar", "Delhi", "Dublin", "Geneva", "Hanoi", "Havana", "Helsinki", "Istanbul", "Jakarta",
    "Kyoto", "Lagos", "Lima", "Lisbon", "London", "Madrid", "Manila", "Melbourne", "Mexico City", "Milan",
    "Montreal", "Moscow", "Mumbai", "Munich", "Nairobi", "Naples", "Oslo", "Paris", "Prague", "Quito",
    "Riga", "Rome", "Santiago", "Seoul", "Shanghai", "Sofia", "Stockholm", "Sydney", "Taipei", "Tehran",
    "Tokyo", "Toronto", "Tunis", "Valencia", "Vienna", "Warsaw", "Zagreb", "Zurich",
)
FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river runs to the sea.", "A bird sings in the tree.", "The road is long and quiet.",
    "Clouds drift over the hills.", "The market opens at dawn.", "Rain falls on the old roof.",
    "The train leaves on time.", "Children play in the park.", "The baker sells fresh bread.",
    "A cat sleeps by the window.", "The library is closed today.", "Snow covers the mountain.",
    "The lamp glows in the dark.", "Boats rest in the harbor.", "The wind moves the tall trees.",
)
NEEDLE = " The magic number for {city} is"
QUERY = "\nThe magic number for {city} is"  # each query restates its needle's lead; the answer follows


@dataclasses.dataclass(frozen=True)
class NeedleExample:
    """One sample: the context (haystack with needles), then each query followed by its answer."""

    ids: np.ndarray  # int32 [length]
    text: str
    depth: int  # percent: where the first query's needle sits in the context
    context_length: int  # tokens of the context (at most the length asked for, within one filler sentence)
    needle_spans: tuple[tuple[int, int], ...]  # [start, end) token span of each query's needle in the context
    answer_spans: tuple[tuple[int, int], ...]  # [start, end) token span of each query's answer after the context
    answers: tuple[str, ...]


def make_example(tokenizer: Tokenizer, *, context_length: int, num_needles: int, num_queries: int, depth: int,
                 digits: int = 7, rng: np.random.Generator) -> NeedleExample:
    """A sample with a context of at most `context_length` tokens (filler sentences are whole)."""
    if not 1 <= num_queries <= num_needles <= len(CITIES):
        raise ValueError(f"need 1 <= queries ({num_queries}) <= needles ({num_needles}) <= {len(CITIES)} cities")
    if not 0 <= depth <= 100:
        raise ValueError(f"depth must be a percentage in [0, 100], got {depth}")
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be in [1, 18], got {digits}")
    cities = [CITIES[i] for i in rng.choice(len(CITIES), num_needles, replace=False)]
    numbers = [str(n) for n in rng.choice(9 * 10 ** (digits - 1), num_needles, replace=False) + 10 ** (digits - 1)]
    encode = lambda text: np.asarray(tokenizer.encode(text), np.int32)  # noqa: E731
    # A needle is three pieces (lead, number, "."), encoded apart so the number's tokens are the same in the
    # needle and in the answer.
    needles = [[encode(NEEDLE.format(city=city)), encode(" " + number), encode(".")] for city, number in zip(cities, numbers)]
    filler_budget = context_length - sum(len(piece) for needle in needles for piece in needle)
    sentences = []
    while True:
        sentence = encode(" " + FILLER[rng.integers(len(FILLER))])
        if filler_budget < len(sentence):
            break
        sentences.append(sentence)
        filler_budget -= len(sentence)
    if filler_budget < 0:
        raise ValueError(f"context length {context_length} is too short for {num_needles} needles")
    # Boundary b = before filler sentence b (b = len(sentences): the end). The first needle goes at the depth.
    boundaries = [round(depth / 100 * len(sentences))]
    boundaries += [int(b) for b in rng.integers(0, len(sentences) + 1, num_needles - 1)]
    pieces, spans, position = [], {}, 0
    for b in range(len(sentences) + 1):
        here = [i for i in range(num_needles) if boundaries[i] == b]
        for i in (here if depth < 50 else here[::-1]):  # the depth needle outermost: first at 0%, last at 100%
            spans[i] = (position, position + sum(len(piece) for piece in needles[i]))
            pieces += needles[i]
            position = spans[i][1]
        if b < len(sentences):
            pieces.append(sentences[b])
            position += len(sentences[b])
    context_end = position
    answer_spans = []
    for city, number in zip(cities[:num_queries], numbers[:num_queries]):
        pieces.append(encode(QUERY.format(city=city)))
        position += len(pieces[-1])
        pieces.append(encode(" " + number))
        answer_spans.append((position, position + len(pieces[-1])))
        position += len(pieces[-1])
        pieces.append(encode("."))
        position += len(pieces[-1])
    ids = np.concatenate(pieces)
    return NeedleExample(ids, tokenizer.decode(ids), depth, context_end, tuple(spans[i] for i in range(num_queries)),
                         tuple(answer_spans), tuple(numbers[:num_queries]))


@dataclasses.dataclass(frozen=True)
class NeedleTask:
    """One evaluation: every (length, depth) cell gets `samples` examples, seeded by (seed, length, depth, index)."""

    lengths: tuple[int, ...] = (1024,)  # context lengths in tokens
    num_needles: int = 4  # N
    num_queries: int = 1  # R
    depths: tuple[int, ...] = DEPTHS
    samples: int = 50
    digits: int = 7
    seed: int = 0

    def examples(self, tokenizer: Tokenizer, length: int, depth: int) -> list[NeedleExample]:
        return [
            make_example(tokenizer, context_length=length, num_needles=self.num_needles, num_queries=self.num_queries,
                         depth=depth, digits=self.digits, rng=np.random.default_rng((self.seed, length, depth, index)))
            for index in range(self.samples)
        ]


def training_texts(tokenizer: Tokenizer, count: int, *, lengths: Sequence[int], max_needles: int = 6,
                   max_queries: int = 2, digits: int = 7, seed: int = 1) -> list[str]:
    """`count` training examples (the text of samples with random lengths, needle counts (fewer where they do not
    fit) and depths, not just the evaluation's five). Use a seed other than the evaluation's (0) so no
    evaluation sample is trained on."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(count):
        length, num_needles = int(rng.choice(lengths)), int(rng.integers(1, max_needles + 1))
        while True:  # as many needles as drawn, or as fit in the length
            try:
                example = make_example(tokenizer, context_length=length, num_needles=num_needles,
                                       num_queries=int(rng.integers(1, min(num_needles, max_queries) + 1)),
                                       depth=int(rng.integers(0, 101)), digits=digits, rng=rng)
                break
            except ValueError:
                if num_needles == 1:
                    raise
                num_needles -= 1
        texts.append(example.text)
    return texts


def query_tokens(tokenizer: Tokenizer, num_queries: int, digits: int) -> int:
    """The most tokens R queries and their answers can take after the context (the longest city's)."""
    answer = len(tokenizer.encode(" " + "9" * digits)) + len(tokenizer.encode("."))
    return num_queries * (max(len(tokenizer.encode(QUERY.format(city=city))) for city in CITIES) + answer)


def longest_context(tokenizer: Tokenizer, max_seq_len: int, num_queries: int, digits: int) -> int:
    """The longest context length whose samples fit a model of max_seq_len (the analyses' default length)."""
    return max_seq_len - query_tokens(tokenizer, num_queries, digits)


def check_fits(task: NeedleTask, tokenizer: Tokenizer, max_seq_len: int) -> None:
    """Refuse, before anything is computed, a task whose longest samples exceed the model's max_seq_len."""
    longest = max(task.lengths) + query_tokens(tokenizer, task.num_queries, task.digits)
    if longest > max_seq_len:
        raise ValueError(
            f"a sample of context length {max(task.lengths)} with {task.num_queries} queries can take {longest} tokens, "
            f"more than the model's max_seq_len {max_seq_len}: use lengths of at most "
            f"{longest_context(tokenizer, max_seq_len, task.num_queries, task.digits)}")


def batches(examples: Sequence[NeedleExample], batch_size: int, max_seq_len: int):
    """(examples, ids [batch_size, longest of all examples]) in order: every batch has the same shape (one
    compile), ids right-padded with 0 (causal attention: padding changes no earlier logit), and the last
    batch filled up with copies of its first example, which are not returned."""
    length = max(len(example.ids) for example in examples)
    if length > max_seq_len:
        longest = max(examples, key=lambda example: len(example.ids))
        raise ValueError(f"a sample of context length {longest.context_length} with {len(longest.answers)} queries "
                         f"takes {length} tokens, more than the model's max_seq_len {max_seq_len}: use shorter lengths")
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start : start + batch_size])
        rows = chunk + [chunk[0]] * (batch_size - len(chunk))
        yield chunk, np.stack([np.pad(example.ids, (0, length - len(example.ids))) for example in rows])


def retrieved(logits_BTV: np.ndarray, examples: Sequence[NeedleExample]) -> np.ndarray:
    """[B, R] bool: every answer token is the argmax at the position before it."""
    predicted_BT = np.argmax(logits_BTV, axis=-1)
    return np.array([[np.array_equal(predicted_BT[b, start - 1 : end - 1], example.ids[start:end])
                      for start, end in example.answer_spans] for b, example in enumerate(examples)])


@dataclasses.dataclass
class NeedleResult:
    task: NeedleTask
    accuracy: dict[tuple[int, int], float]  # (length, depth) -> mean share of queries retrieved


def evaluate(checkpoint: common.Checkpoint, task: NeedleTask, *, batch_size: int = 8,
             forward: Callable | None = None) -> NeedleResult:
    """Retrieval accuracy per (length, depth). forward(tokens_BT) -> logits (default: the model's forward
    through diffjax.analysis.probe, e.g. with quantized attention logits)."""
    from diffjax.analysis.probe import make_probe

    check_fits(task, checkpoint.tokenizer, checkpoint.model.config.max_seq_len)
    forward = forward or make_probe(checkpoint.model)
    accuracy = {}
    for length in task.lengths:
        examples = [example for depth in task.depths for example in task.examples(checkpoint.tokenizer, length, depth)]
        by_depth = accuracy_by_depth(examples, forward, batch_size, checkpoint.model.config.max_seq_len)
        accuracy.update({(length, depth): value for depth, value in by_depth.items()})
    return NeedleResult(task, accuracy)


def accuracy_by_depth(examples: Sequence[NeedleExample], forward: Callable, batch_size: int,
                      max_seq_len: int) -> dict[int, float]:
    """depth -> mean share of queries retrieved over `examples`, run through forward(tokens_BT) -> (logits, _)."""
    hits: dict[int, list] = {}
    for chunk, ids in batches(examples, batch_size, max_seq_len):
        logits, _ = forward(ids)
        for example, row in zip(chunk, retrieved(np.asarray(logits[: len(chunk)]), chunk)):
            hits.setdefault(example.depth, []).append(row.mean())
    return {depth: float(np.mean(values)) for depth, values in hits.items()}


def format_results(labels: Sequence[str], results: Sequence[NeedleResult]) -> str:
    """Rows: depths and their average; columns: each model at each length (the paper's Figure 5 as a table)."""
    task = results[0].task
    header = ["depth"] + [f"{label} @{length}" for label in labels for length in task.lengths]
    rows = [[f"{depth}%"] + [r.accuracy[length, depth] for r in results for length in task.lengths] for depth in task.depths]
    rows.append(["avg"] + [float(np.mean([r.accuracy[length, d] for d in task.depths])) for r in results for length in task.lengths])
    title = (f"Multi-needle retrieval accuracy (N={task.num_needles} needles, R={task.num_queries} queries, "
             f"{task.samples} samples per cell, {task.digits}-digit numbers; columns: model @context length)")
    return common.table(header, rows, title=title)


def record(result: NeedleResult) -> dict:
    """A model's JSON entry: the task, and `accuracy["<length>"]["<depth>"]`."""
    accuracy = {str(length): {str(depth): result.accuracy[length, depth] for depth in result.task.depths}
                for length in result.task.lengths}
    return {"task": dataclasses.asdict(result.task), "accuracy": accuracy}


def draw_accuracy_grids(entries: Sequence[dict], path: Path, *, columns: str, xlabel: str, title: str) -> None:
    """One heat map per model of `entry["accuracy"][column][depth]` (rows: depths; columns: `task[columns]`)."""
    task = entries[0]["task"]
    figure, axes = figures.panels(len(entries), title=title, width=1.2 + 0.9 * max(3, len(task[columns])))
    for ax, entry in zip(axes, entries):
        grid_RC = [[entry["accuracy"][str(column)][str(depth)] for column in task[columns]] for depth in task["depths"]]
        figures.heatmap(figure, ax, grid_RC, rows=[f"{depth}%" for depth in task["depths"]],
                        columns=[str(column) for column in task[columns]], title=entry["label"], xlabel=xlabel,
                        ylabel="answer depth")
    figures.save(figure, path)


def draw(entries: Sequence[dict], path: Path) -> None:
    """The paper's Figure 5: accuracy over answer depth x context length, one heat map per model."""
    task = entries[0]["task"]
    draw_accuracy_grids(entries, path, columns="lengths", xlabel="context length (tokens)",
                        title=f"Multi-needle retrieval accuracy (N={task['num_needles']} needles, R={task['num_queries']} "
                              f"queries, {task['samples']} samples per cell)")


def main(argv=None) -> int:
    parser = common.parser(__doc__, "diffjax.analysis.needles", checkpoint_required=False)  # not to write training data
    parser.add_argument("--lengths", type=common.positive_int_list, default=None,
                        help="context lengths in tokens (default: the longest the models fit; 1024 with --write-training)")
    parser.add_argument("--needles", type=common.positive_int, default=4, help="N, needles per sample (default 4)")
    parser.add_argument("--queries", type=common.positive_int, default=1, help="R, query cities per sample (default 1)")
    parser.add_argument("--depths", type=common.int_list, default=DEPTHS, help="answer depths in percent (default 0,25,50,75,100)")
    parser.add_argument("--samples", type=common.positive_int, default=50, help="samples per (length, depth) (default 50)")
    parser.add_argument("--digits", type=common.positive_int, default=7, help="digits of the magic numbers (default 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default 0)")
    parser.add_argument("--batch-size", type=common.positive_int, default=8, help="samples per forward pass (default 8)")
    parser.add_argument("--write-training", type=Path, metavar="JSONL",
                        help="write --count training examples ({\"text\": ...} lines, byte tokenizer lengths) instead")
    parser.add_argument("--count", type=common.positive_int, default=1000, help="training examples to write (default 1000)")
    args = parser.parse_args(argv)
    if args.write_training:
        from diffjax.tokenizers import ByteTokenizer

        try:
            texts = training_texts(ByteTokenizer(), args.count, lengths=args.lengths or (1024,), max_needles=args.needles,
                                   max_queries=args.queries, digits=args.digits, seed=args.seed + 1)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if not common.make_parent(args.write_training, "--write-training"):
            return 2
        with open(args.write_training, "w") as file:
            file.writelines(json.dumps({"text": text}) + "\n" for text in texts)
        print(f"wrote {len(texts)} examples to {args.write_training}")
        return 0
    if not args.checkpoint:
        parser.error("give --checkpoint DIR (one or more) or --write-training JSONL")
    tasks = []

    def prepare(checkpoints):  # one task for all models: the longest length every one of them fits by default
        lengths = args.lengths or (min(longest_context(c.tokenizer, c.model.config.max_seq_len, args.queries, args.digits)
                                       for c in checkpoints),)
        tasks.append(NeedleTask(lengths, args.needles, args.queries, args.depths, args.samples, args.digits, args.seed))
        for checkpoint in checkpoints:
            check_fits(tasks[0], checkpoint.tokenizer, checkpoint.model.config.max_seq_len)

    return common.run_cli(args, lambda c: evaluate(c, tasks[0], batch_size=args.batch_size), format_results, prepare,
                          record=record, draw=draw)


if __name__ == "__main__":
    from diffjax.command_line import run

    run(main, "python -m diffjax.analysis.needles")
