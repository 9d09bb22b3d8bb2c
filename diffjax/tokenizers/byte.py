"""The byte-level tokenizer: needs no vocabulary file."""

from __future__ import annotations

import numpy as np

from diffjax.tokenizers.base import Tokenizer


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus eos = 256 to end documents: vocabulary size 257.

    Any string round-trips exactly; decoding an arbitrary id sequence (which may cut a multi-byte
    character) replaces invalid UTF-8 with U+FFFD instead of raising.
    """

    vocab_size = 257
    eos_id = 256
    bos_id = None
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(self._check_text(text).encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (for example a corpus read from disk) as int32 ids."""
        return np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int32)

    def _decode(self, ids: np.ndarray) -> str:
        ids = ids[ids != self.eos_id]
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
