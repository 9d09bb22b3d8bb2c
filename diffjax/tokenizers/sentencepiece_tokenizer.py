"""SentencePiece: load a `.model`, or train one from an iterable of documents."""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np
import sentencepiece as spm

from diffjax.tokenizers.base import Tokenizer

# SentencePiece skips sentences longer than max_sentence_length (4192 bytes by default), so long
# lines are cut into chunks of at most this many characters (4 UTF-8 bytes each at most).
_CHUNK_CHARS = 1000


class SentencePieceTokenizer(Tokenizer):
    """A trained SentencePiece model (`.model` file); eos/bos ids come from the model (None if absent)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"sentencepiece model {self.path!r} does not exist; train one with "
                f"`python -m diffjax.data train-sentencepiece --output {self.path} --vocab-size N`"
            )
        with open(self.path, "rb") as f:
            data = f.read()
        try:
            if not data:
                raise RuntimeError("the file is empty")
            self._sp = spm.SentencePieceProcessor(model_proto=data)
        except RuntimeError as e:
            raise ValueError(f"{self.path!r} is not a sentencepiece model: {e}") from e
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = _id_or_none(self._sp.eos_id())
        self.bos_id = _id_or_none(self._sp.bos_id())
        self.name = f"sentencepiece({os.path.basename(self.path)}, vocab {self.vocab_size})"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(self._check_text(text)), dtype=np.int32)

    def _decode(self, ids: np.ndarray) -> str:
        # SentencePiece drops control pieces (bos, eos, pad) itself; byte pieces that do not form
        # valid UTF-8 come back as U+FFFD.
        return self._sp.decode(ids.tolist())


def _id_or_none(value: int) -> int | None:
    return None if value < 0 else int(value)


def _sentences(documents: Iterable[str]) -> Iterator[str]:
    """Documents as non-blank lines, long lines cut into chunks: streamed, never one big string."""
    for document in documents:
        for line in document.splitlines():
            for start in range(0, len(line), _CHUNK_CHARS):
                chunk = line[start : start + _CHUNK_CHARS]
                if chunk.strip():
                    yield chunk


def train_sentencepiece(
    documents: Iterable[str],
    *,
    vocab_size: int,
    output_path: str | os.PathLike,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    byte_fallback: bool = True,
    seed: int = 0,
    **options,
) -> SentencePieceTokenizer:
    """Train a SentencePiece model on `documents` and write it to `output_path` atomically.

    Defaults aim at exact round trips and reproducibility: identity normalization, whitespace kept
    as is (no dummy prefix, no collapsing), byte fallback for characters outside the vocabulary, one
    thread and no input shuffling (the same input gives the same model bytes). Any text then
    round-trips exactly, except that a literal U+2581 (SentencePiece's space marker) decodes as a
    space. Ids: unk 0, bos 1, eos 2, no pad. Documents are fed line by line (SentencePiece trains on
    sentences), so newlines are byte pieces; the trainer keeps every sentence in memory. `options` are passed to the SentencePiece trainer and override these defaults
    (e.g. input_sentence_size=10_000_000 to cap the sentences it keeps in memory).
    """
    output_path = os.fspath(output_path)
    settings = dict(
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,  # runs of spaces (indentation) can become one piece
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    settings.update(options)
    spm.set_random_generator_seed(seed)  # any sampling the trainer does is seeded too
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=_sentences(documents), model_writer=model, **settings)
    except RuntimeError as e:  # e.g. an empty corpus, or a vocabulary larger than the text supports
        raise ValueError(f"sentencepiece training failed: {e}") from e

    # Write next to the target, then rename: a reader never sees a half-written model.
    directory = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(directory, exist_ok=True)
    fd, temp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(output_path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.getvalue())
        os.chmod(temp_path, 0o644)  # mkstemp makes it private; a model is shared like any data file
        os.replace(temp_path, output_path)
    except BaseException:
        if os.path.exists(temp_path):
            os.remove(temp_path)
        raise
    return SentencePieceTokenizer(output_path)
