"""The one interface every tokenizer implements, with the id checks they share."""

from __future__ import annotations

import abc

import numpy as np


class Tokenizer(abc.ABC):
    """Text <-> int32 token ids.

    `encode` adds no special tokens (the data pipeline appends `eos_id` itself); `decode` checks ids
    against [0, vocab_size) and skips special ids (eos, bos, ...), so a packed sequence reads as text.
    """

    # Every id is in [0, vocab_size): the model's embedding needs this many rows, and a model whose vocabulary is
    # padded past it (sizes rounded up to 64 / 128) generates with allowed_vocab_size=vocab_size (diffjax.generate).
    vocab_size: int
    eos_id: int | None  # ends a document when packing; None when the tokenizer has none
    bos_id: int | None
    name: str  # a short description for logs

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """`text` as a 1-D int32 array of ids, no special tokens added."""

    @abc.abstractmethod
    def _decode(self, ids: np.ndarray) -> str:
        """Text for ids already checked to be 1-D integers in [0, vocab_size)."""

    def undecodable_ids(self) -> tuple[int, ...]:
        """Ids in [0, vocab_size) that name no token (gaps in the vocabulary): generation blocks them (Sampling's
        blocked_ids). Most tokenizers have none."""
        return ()

    def decode(self, ids) -> str:
        """Text for a 1-D sequence of ids; an id outside [0, vocab_size) raises ValueError."""
        array = np.asarray(ids)
        if array.size == 0:
            return ""
        if array.ndim != 1:
            raise ValueError(f"decode expects a 1-D sequence of ids, got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
        bad = (array < 0) | (array >= self.vocab_size)
        if bad.any():
            index = int(np.argmax(bad))
            raise ValueError(
                f"token id {int(array[index])} at position {index} is outside the vocabulary "
                f"[0, {self.vocab_size}) of {self.name}"
            )
        return self._decode(array.astype(np.int64))

    @staticmethod
    def _check_text(text) -> str:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return text

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
