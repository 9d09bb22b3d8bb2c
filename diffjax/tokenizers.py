"""Tokenizers. So far only the byte-level one, which needs no vocabulary file."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary size 256, no special tokens.

    Any string round-trips exactly; decoding an arbitrary id sequence (which may cut a multi-byte
    character) replaces invalid UTF-8 with U+FFFD instead of raising.
    """

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (for example a corpus read from disk) as int32 ids."""
        return np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
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
                f"token id {int(array[index])} at position {index} is outside the byte vocabulary "
                f"[0, {self.vocab_size})"
            )
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
