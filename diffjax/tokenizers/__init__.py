"""Tokenizers behind one interface (`Tokenizer`): byte-level, SentencePiece, tiktoken, Hugging Face tokenizer.json.

`make_tokenizer(config.data.tokenizer)` builds the one a config names. Train a SentencePiece model
with `python -m diffjax.data train-sentencepiece --output tok.model --vocab-size 8000`.
"""

from __future__ import annotations

from diffjax.tokenizers.config import TokenizerConfig
from diffjax.tokenizers.base import Tokenizer
from diffjax.tokenizers.byte import ByteTokenizer
from diffjax.tokenizers.hf_tokenizer import HFTokenizer
from diffjax.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece
from diffjax.tokenizers.tiktoken_tokenizer import (
    TiktokenNotCachedError,
    TiktokenTokenizer,
    load_cached_encoding,
    load_encoding,
    tiktoken_cache_dir,
)


def make_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """The tokenizer a TokenizerConfig names (the config has already checked its fields)."""
    if config.kind == "byte":
        return ByteTokenizer()
    if config.kind == "sentencepiece":
        return SentencePieceTokenizer(config.path)
    if config.kind == "tiktoken":
        return TiktokenTokenizer(path=config.path) if config.path else TiktokenTokenizer(config.encoding)
    if config.kind == "hf":
        return HFTokenizer(config.path, revision=config.revision)
    raise ValueError(f"unknown tokenizer kind {config.kind!r}")


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TiktokenNotCachedError",
    "TiktokenTokenizer",
    "Tokenizer",
    "load_cached_encoding",
    "load_encoding",
    "make_tokenizer",
    "tiktoken_cache_dir",
    "train_sentencepiece",
]
