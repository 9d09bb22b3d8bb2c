"""TokenizerConfig: which tokenizer a run uses (diffjax.tokenizers.make_tokenizer builds it)."""

from __future__ import annotations

import dataclasses

from diffjax.config_values import one_of

TOKENIZER_KINDS = ("byte", "sentencepiece", "tiktoken", "hf")


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer (a run config's `data.tokenizer` section)."""

    kind: str = "byte"
    """Which tokenizer: "byte" (256 byte ids + eos), "sentencepiece", "tiktoken" or "hf" (a tokenizer.json)."""
    path: str | None = None
    """sentencepiece: a .model file; tiktoken: a .tiktoken file (instead of encoding); hf: a tokenizer.json, the
    directory holding it (a Hugging Face checkpoint's), or a Hub model name (org/name) whose tokenizer files are read
    through the Hugging Face cache (fetched unless HF_HUB_OFFLINE)."""
    encoding: str | None = None
    """tiktoken: a named encoding (e.g. "cl100k_base"): from tiktoken's cache, downloaded into it when absent and
    the network is there (never with HF_HUB_OFFLINE)."""
    revision: str | None = None
    """hf with a Hub name: its branch, tag or commit (None: main)."""

    def __post_init__(self):
        if self.kind not in TOKENIZER_KINDS:
            raise ValueError(one_of("data.tokenizer.kind", self.kind, TOKENIZER_KINDS))
        if self.kind == "sentencepiece" and not self.path:
            raise ValueError("data.tokenizer.path must name a sentencepiece .model file when data.tokenizer.kind is 'sentencepiece'")
        if self.kind == "hf" and not self.path:
            raise ValueError("data.tokenizer.path must name a tokenizer.json, the directory holding it or a Hub "
                             "model name (org/name) when data.tokenizer.kind is 'hf'")
        if self.revision is not None and self.kind != "hf":
            raise ValueError(f"data.tokenizer.revision is for data.tokenizer.kind 'hf' (a Hub name), not {self.kind!r}")
        if self.kind == "tiktoken" and bool(self.path) == bool(self.encoding):
            raise ValueError(
                "data.tokenizer.kind 'tiktoken' needs exactly one of data.tokenizer.encoding (a named encoding such as "
                "'cl100k_base') or data.tokenizer.path (a .tiktoken file)"
            )
