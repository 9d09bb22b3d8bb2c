"""DataConfig: where documents come from and how they are packed (diffjax.data builds the pipelines)."""

from __future__ import annotations

import dataclasses

from diffjax.config_values import nonfinite_problems, one_of
from diffjax.tokenizers.config import TokenizerConfig

DATA_SOURCES = ("builtin", "text", "jsonl", "parquet")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data (a run config's `data` section): the documents, their split, packing and tokenizer."""

    source: str = "builtin"
    """Where documents come from: "builtin" (the Python standard library's .py files), "text" (one file per document),
    "jsonl" or "parquet"."""
    paths: tuple[str, ...] = ()
    """Files or glob patterns (text, jsonl, parquet; local or gs://)."""
    text_field: str = "text"
    """jsonl / parquet: the field holding a document's text."""
    seq_len: int = 128
    """Tokens per packed training sequence."""
    eval_fraction: float = 0.02
    """Share of documents held out for the eval loss (chosen by a fixed hash)."""
    eval_batches: int = 8
    """The eval loss is the mean over this many packed batches of held-out documents."""
    builtin_bytes: int = 4_000_000
    """Size budget of the builtin corpus."""
    append_eos: bool = True
    """End every document with the tokenizer's eos id (when it has one)."""
    shuffle: bool = True
    """Shuffle documents (per epoch, from the run seed)."""
    shuffle_window_tokens: int = 1 << 20
    """Packed rows are shuffled within windows of about this many tokens (pieces of one long document would otherwise
    fill whole batches); the first batch packs up to one window: smaller starts faster, larger mixes better."""
    worker_count: int = 0
    """Grain worker processes (0: in the training process)."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """The tokenizer the documents are encoded with."""

    def __post_init__(self):
        if problems := nonfinite_problems(self, "data."):
            raise ValueError(problems[0])
        if self.source not in DATA_SOURCES:
            raise ValueError(one_of("data.source", self.source, DATA_SOURCES))
        if self.source != "builtin" and not self.paths:
            raise ValueError(f"data.paths must list at least one file or glob for data.source {self.source!r}")
        if isinstance(self.paths, str):  # a single path from YAML or the command line
            object.__setattr__(self, "paths", (self.paths,))
        object.__setattr__(self, "paths", tuple(self.paths))
        if not (isinstance(self.seq_len, int) and self.seq_len > 0):
            raise ValueError(f"data.seq_len must be a positive integer, got {self.seq_len!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        for name in ("eval_batches", "builtin_bytes", "shuffle_window_tokens"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise ValueError(f"data.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not (isinstance(self.worker_count, int) and self.worker_count >= 0):
            raise ValueError(f"data.worker_count must be an integer >= 0, got {self.worker_count!r}")
