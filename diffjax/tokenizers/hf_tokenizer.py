"""Hugging Face tokenizers: a `tokenizer.json` read by the `tokenizers` library, from a local path or a Hub model
name (org/name) through the Hugging Face cache (diffjax.convert.hub.resolve_tokenizer).

Every HF checkpoint diffjax converts ships one (DiffLlama, Llama 3, Motif). eos / bos come from the
`tokenizer_config.json` beside it (`eos_token` / `bos_token`, a string or an AddedToken dict), else from
`special_tokens_map.json`; None where neither names one.
"""

from __future__ import annotations

import json
import os

import numpy as np

from diffjax.tokenizers.base import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
_SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_file(path: str | os.PathLike) -> str:
    """`path` itself when it is a file, else `path`/tokenizer.json; FileNotFoundError naming what is missing."""
    path = os.fspath(path)
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = f"directory {path!r} has no {TOKENIZER_FILE}" if os.path.isdir(path) else f"{path!r} does not exist"
        raise FileNotFoundError(
            f"Hugging Face tokenizer: {where}; data.tokenizer.path must name a tokenizer.json, the directory holding "
            f"it, or a Hub model name (org/name)"
        )
    return file


class HFTokenizer(Tokenizer):
    """`HFTokenizer("path/to/model_dir")`, `HFTokenizer("path/to/tokenizer.json")` or `HFTokenizer("org/name",
    revision=None)` (a Hub model's, through the Hugging Face cache)."""

    def __init__(self, path: str | os.PathLike, *, revision: str | None = None):
        from tokenizers import Tokenizer as RustTokenizer  # the trainer's extra; imported when used

        if revision is not None or not os.path.exists(path):  # perhaps a Hub name (the converters' module: lazily)
            from diffjax.convert.hub import resolve_tokenizer

            path = resolve_tokenizer(path, revision=revision)
        self.path = tokenizer_file(path)
        try:
            self._tok = RustTokenizer.from_file(self.path)
        except Exception as e:  # the library raises a bare Exception for malformed JSON / unknown models
            raise ValueError(f"{self.path!r} is not a Hugging Face tokenizer.json: {e}") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        special = _special_tokens(os.path.dirname(self.path))
        self.eos_id, self.bos_id = (self._token_id(special.get(name), name) for name in ("eos_token", "bos_token"))
        self.name = f"hf({os.path.basename(os.path.dirname(os.path.abspath(self.path))) or self.path}, vocab {self.vocab_size})"

    def _token_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.path!r}: the {what} {token!r} named beside it is not in its vocabulary")
        return int(token_id)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(self._check_text(text), add_special_tokens=False).ids, dtype=np.int32)

    def _decode(self, ids: np.ndarray) -> str:
        return self._tok.decode(ids.tolist(), skip_special_tokens=True)


def _special_tokens(directory: str) -> dict[str, str]:
    """{"eos_token": ..., "bos_token": ...} as the first of tokenizer_config.json / special_tokens_map.json names them."""
    for name in _SPECIAL_TOKEN_FILES:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{file!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{file!r} must hold a JSON object, got {type(data).__name__}")
        found = {}
        for key in ("eos_token", "bos_token"):
            value = data.get(key)
            if isinstance(value, dict):  # an AddedToken: {"content": "</s>", ...}
                value = value.get("content")
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{file!r}: {key} must be a token string, got {value!r}")
            if value:
                found[key] = value
        if found:
            return found
    return {}
