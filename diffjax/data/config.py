"""DataConfig: where documents come from and how they are packed (diffjax.data builds the pipelines)."""

from __future__ import annotations

import dataclasses

from diffjax.config_values import nonfinite_problems, one_of
from diffjax.tokenizers.config import TokenizerConfig

DATA_SOURCES = ("builtin", "text", "jsonl", "parquet", "hf")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data (a run config's `data` section): the documents, their split, packing and tokenizer."""

    source: str = "builtin"
    """Where documents come from: "builtin" (the Python standard library's .py files), "text" (one file per document),
    "jsonl", "parquet" or "hf" (a Hugging Face dataset through the `datasets` library: data.hf_dataset)."""
    paths: tuple[str, ...] = ()
    """Files or glob patterns (text, jsonl, parquet; local or gs://)."""
    text_field: str = "text"
    """jsonl / parquet / hf: the field (column) holding a document's text."""
    hf_dataset: str | None = None
    """hf: a Hub dataset name ("org/name") or a local dataset directory, as `datasets.load_dataset` takes it. Offline
    (HF_HUB_OFFLINE) it is read from the Hugging Face cache: the Hub cache's snapshot (`hf download NAME --repo-type
    dataset`) or datasets' own cache of an earlier load."""
    hf_config: str | None = None
    """hf: the dataset's configuration (load_dataset's `name`, e.g. "wikitext-2-raw-v1"; None: its default)."""
    hf_split: str = "train"
    """hf: the split whose documents are read (data.eval_fraction holds some of them out, as for files)."""
    hf_revision: str | None = None
    """hf: the Hub dataset's branch, tag or commit (None: main)."""
    hf_streaming: bool = False
    """hf: stream the documents (nothing downloaded up front; datasets' shuffle buffer of 1000 documents per epoch,
    the eval split by a hash of each document's text, no data.worker_count) instead of reading the prepared
    dataset by index (downloaded once into datasets' cache: exact per-epoch shuffles, as for files)."""
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
        self._check_source()
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

    def _check_source(self):
        """The keys of data.source: files for text / jsonl / parquet, a dataset for hf, and no key of another."""
        hf_set = [key for key, default in HF_DEFAULTS.items() if getattr(self, key) != default]
        if self.source == "hf":
            if not self.hf_dataset:
                raise ValueError("data.source 'hf' needs data.hf_dataset: a Hub dataset name (org/name) or a local "
                                 "dataset directory")
            if self.paths:
                raise ValueError("data.paths is for files (data.source text / jsonl / parquet); data.source 'hf' reads "
                                 "data.hf_dataset")
            if self.hf_streaming and self.worker_count:
                raise ValueError("data.hf_streaming reads one stream in the training process: set data.worker_count 0")
        elif hf_set:
            raise ValueError(f"data.{hf_set[0]} is for data.source 'hf' (data.source is {self.source!r})")
        elif self.source != "builtin" and not self.paths:
            raise ValueError(f"data.paths must list at least one file or glob for data.source {self.source!r}")

    @property
    def streams(self) -> bool:
        """Whether the documents come as a stream (no random access, no len)."""
        return self.source == "hf" and self.hf_streaming


# data.source "hf"'s own keys and their defaults (a config of another source leaves them so)
HF_DEFAULTS = {field.name: field.default for field in dataclasses.fields(DataConfig) if field.name.startswith("hf_")}
