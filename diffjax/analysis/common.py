"""What the analyses share: checkpoints with their tokenizer, text batches, the command line and tables."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from diffjax import attention_kinds, command_line
from diffjax.command_line import positive_int  # noqa: F401 (the analyses' argparse type)
from diffjax.analysis import figures
from diffjax.config_values import build_config, read_yaml_mapping
from diffjax.data.config import HF_DEFAULTS, DataConfig
from diffjax.log_lines import print_package_logs
from diffjax.run_dir import RunDir
from diffjax.tokenizers import Tokenizer


@dataclasses.dataclass
class Checkpoint:
    """A model with the tokenizer and data its run used, and a label for table columns."""

    label: str
    model: object  # TransformerLM
    tokenizer: Tokenizer
    data: DataConfig


def describe(model) -> str:
    """'DIFF (4 diff heads, 0.82M params)': the kind's label, its heads, the parameter count."""
    config = model.config
    kind = attention_kinds.get(config.attention)
    heads = f"{config.num_heads} {'diff ' if kind.maps == 2 else ''}heads"
    if config.attention_options is not None and config.attention_options.describe():  # GDA's noise heads, ...
        heads += f", {config.attention_options.describe()}"
    return f"{kind.label} ({heads}, {model.num_params() / 1e6:.2f}M params)"


def load_checkpoint(path: str | Path, label: str | None = None) -> Checkpoint:
    """A run directory (or checkpoint) of train.py or the converter, with the tokenizer of its config.yaml's
    data section. A model whose config names no tokenizer must use the byte tokenizer's 257 ids."""
    from diffjax.params_checkpoint import load_model, resolve_checkpoint
    from diffjax.tokenizers import make_tokenizer

    step_dir = resolve_checkpoint(path, "--checkpoint")
    model = load_model(step_dir, what="--checkpoint")
    values = read_yaml_mapping(RunDir.of_step(step_dir).config_file)
    data_values = values.get("data") or {}
    data = build_config(DataConfig, data_values, prefix="data")
    if "tokenizer" not in data_values and model.config.vocab_size != 257:
        raise ValueError(
            f"--checkpoint {path}: its config.yaml names no data.tokenizer and the model's vocab_size is "
            f"{model.config.vocab_size}, not the byte tokenizer's 257: add the tokenizer it was trained with "
            "(data: {tokenizer: {kind: sentencepiece, path: ...}}) to that config.yaml"
        )
    tokenizer = make_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"--checkpoint {path}: tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, more than "
                         f"the model's vocab_size {model.config.vocab_size}")
    return Checkpoint(label or Path(path).name, model, tokenizer, data)


def check_seq_len(checkpoint: Checkpoint, seq_len: int | None) -> int:
    """The text rows' length (`seq_len`, or the run's data.seq_len capped at the model's max_seq_len); an
    explicit seq_len longer than the model's max_seq_len is refused."""
    max_seq_len = checkpoint.model.config.max_seq_len
    if seq_len is None:
        return min(checkpoint.data.seq_len, max_seq_len)
    if seq_len > max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len {max_seq_len}")
    return seq_len


def text_batches(checkpoint: Checkpoint, *, tokens: int, seq_len: int | None = None, batch_size: int = 8,
                 paths: Sequence[str] = ()) -> list[dict]:
    """Packed batches (tokens / segment_ids / positions [batch, seq_len]) of about `tokens` real tokens (fewer
    when the documents run out): every document of `paths` (.jsonl files, else text files) or, without paths,
    the held-out documents of the checkpoint's data config."""
    from diffjax.data import make_eval_batches, open_documents, pack_documents

    seq_len = check_seq_len(checkpoint, seq_len)
    count = max(1, -(-tokens // (seq_len * batch_size)))
    data = dataclasses.replace(checkpoint.data, seq_len=seq_len, eval_batches=count)
    if not paths:
        data = dataclasses.replace(data, eval_fraction=data.eval_fraction or 0.02)
        batches = make_eval_batches(data, checkpoint.tokenizer, batch_size=batch_size, shard_index=0, shard_count=1)
        if not batches:
            raise ValueError(f"the data of {checkpoint.label} ({data.source}) has no held-out documents to sample tokens from")
        return batches
    data = dataclasses.replace(data, source="jsonl" if str(paths[0]).endswith(".jsonl") else "text", paths=tuple(paths),
                               **HF_DEFAULTS)
    source = open_documents(data)
    packed = pack_documents(source, range(len(source)), checkpoint.tokenizer, data, num_bins=batch_size)
    batches = [batch for batch, _ in zip(packed.batch(batch_size, drop_remainder=True), range(count))]
    if not batches:
        raise ValueError(f"{', '.join(map(str, paths))}: fewer than {batch_size} rows of {seq_len} tokens")
    return batches


# --- command line ---------------------------------------------------------------------------


def parser(description: str, module: str, *, checkpoint_required: bool = True) -> argparse.ArgumentParser:
    """An argument parser with the options every analysis takes: --checkpoint (one or more) and --label; its
    usage line names the command (`python -m <module>`), not the file."""
    result = command_line.ArgumentParser(prog=f"python -m {module}", description=description,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument("--checkpoint", action="append", required=checkpoint_required, metavar="DIR",
                        help="a run directory or checkpoint; repeat to compare models side by side")
    result.add_argument("--label", action="append", default=[], metavar="NAME",
                        help="a column name per --checkpoint (default: the directory's name)")
    result.add_argument("--output", type=json_path, metavar="JSON",
                        help="write the results here as JSON, and the figure beside it (the same name, .png)")
    result.set_defaults(analysis=module.rsplit(".", 1)[-1])
    return result


def json_path(text: str) -> Path:
    """--output: a path ending in .json (the figure is written beside it with .png), for argparse."""
    if not text.endswith(".json"):
        raise argparse.ArgumentTypeError(f"expected a path ending in .json (the figure goes beside it as .png), got {text!r}")
    return Path(text)


def int_list(text: str) -> tuple[int, ...]:
    """'0,25,50' -> (0, 25, 50), for argparse."""
    try:
        return tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int_list(text: str) -> tuple[int, ...]:
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def make_parent(path: Path, option: str) -> bool:
    """Make the directory a file named by `option` goes into, as a user expects of `--output out/x.json` on a fresh
    checkout; False (one line on stderr said why) when it cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"error: {option} {path}: cannot make its directory {path.parent} ({error.strerror or error})",
              file=sys.stderr)
        return False
    return True


def run_cli(args, analyse: Callable[[Checkpoint], object], format_table: Callable[[Sequence[str], Sequence], str],
            prepare: Callable[[Sequence[Checkpoint]], None] | None = None, *, record: Callable[[object], dict],
            draw: Callable[[Sequence[dict], Path], None]) -> int:
    """Load each --checkpoint, analyse it, print the table; bad input is one line on stderr and exit 2.
    prepare(checkpoints) runs before any analysis: defaults that depend on the models, and the checks that
    refuse a task before anything is computed. With --output: record(result) is a model's JSON entry (beside its
    label, checkpoint and description), and draw(entries, png_path) the figure of them all."""
    if args.label and len(args.label) != len(args.checkpoint):
        print(f"error: {len(args.label)} --label for {len(args.checkpoint)} --checkpoint", file=sys.stderr)
        return 2
    labels = args.label or [None] * len(args.checkpoint)
    print_package_logs()
    if args.output and not make_parent(args.output, "--output"):  # before the analysis: where its results go
        return 2
    try:
        checkpoints = [load_checkpoint(path, label) for path, label in zip(args.checkpoint, labels)]
        if prepare is not None:
            prepare(checkpoints)
        results = [analyse(checkpoint) for checkpoint in checkpoints]
    except (ValueError, FileNotFoundError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for checkpoint in checkpoints:
        print(f"{checkpoint.label}: {describe(checkpoint.model)}")
    print(format_table([c.label for c in checkpoints], results))
    if args.output:
        entries = [{"label": c.label, "checkpoint": str(path), "model": describe(c.model), **record(result)}
                   for c, path, result in zip(checkpoints, args.checkpoint, results)]
        write_output(args.output, args.analysis, entries, draw)
    return 0


def write_output(path: Path, analysis: str, entries: Sequence[dict], draw: Callable[[Sequence[dict], Path], None]) -> None:
    """The JSON {"analysis": name, "models": entries} at path, and draw's figure of the entries beside it (.png);
    without matplotlib, the JSON and one line saying so."""
    path.write_text(json.dumps({"analysis": analysis, "models": list(entries)}, indent=1) + "\n")
    figure_path = path.with_suffix(".png")
    try:
        draw(entries, figure_path)
    except figures.MatplotlibMissing as missing:
        print(missing, file=sys.stderr)
        print(f"wrote {path}")
        return
    print(f"wrote {path} and {figure_path}")


# --- tables ---------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence], *, title: str = "") -> str:
    """A plain-text table: the first column left-aligned, numbers right-aligned (floats with 3 decimals
    when < 10, else 1)."""
    def cell(value):
        if isinstance(value, (float, np.floating)):
            return "n/a" if not np.isfinite(value) else f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    cells = [[cell(value) for value in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title] if title else []
    for number, row in enumerate(cells):
        lines.append("  ".join(text.ljust(widths[0]) if i == 0 else text.rjust(widths[i]) for i, text in enumerate(row)))
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)
