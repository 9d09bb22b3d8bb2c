"""tiktoken: a named encoding (from tiktoken's cache, downloaded into it by tiktoken when absent and the network is
there; never with HF_HUB_OFFLINE), or a `.tiktoken` vocabulary file."""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import os
import tempfile

import numpy as np
import tiktoken
import tiktoken.load

from diffjax.log_lines import first_line
from diffjax.tokenizers.base import Tokenizer

ENDOFTEXT = "<|endoftext|>"

# cl100k_base's pre-tokenization pattern (copied from tiktoken_ext/openai_public.py, tiktoken 0.14):
# used for `.tiktoken` files, which carry only the vocabulary.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


class TiktokenNotCachedError(FileNotFoundError):
    """A named tiktoken encoding whose vocabulary file is not in the local cache and could not be downloaded
    (offline, or the download failed)."""


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE: `TiktokenTokenizer("cl100k_base")` (load_encoding: the cache, else a download),
    `TiktokenTokenizer(path="vocab.tiktoken")`, or `TiktokenTokenizer(an_existing_tiktoken_Encoding)`.

    eos is the encoding's "<|endoftext|>" (a `.tiktoken` file gets it appended after its highest rank);
    no bos. `encode` treats special-token text such as "<|endoftext|>" in the input as ordinary text.
    """

    def __init__(self, encoding: str | tiktoken.Encoding | None = None, *, path: str | os.PathLike | None = None):
        if (encoding is None) == (path is None):
            raise ValueError("TiktokenTokenizer needs exactly one of `encoding` (a name) or `path` (a .tiktoken file)")
        if path is not None:
            self._enc = encoding_from_tiktoken_file(path)
            self.name = f"tiktoken({os.path.basename(os.fspath(path))})"
        else:
            self._enc = encoding if isinstance(encoding, tiktoken.Encoding) else load_encoding(encoding)
            self.name = f"tiktoken({self._enc.name})"
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id = self._enc.encode_single_token(ENDOFTEXT) if ENDOFTEXT in self._enc.special_tokens_set else None
        self.bos_id = None
        self._special_ids = np.array(sorted(self._enc.encode_single_token(t) for t in self._enc.special_tokens_set), dtype=np.int64)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(self._check_text(text)), dtype=np.int32)

    @functools.cache
    def undecodable_ids(self) -> tuple[int, ...]:
        """The gaps below n_vocab (cl100k_base: 100256 and 100261-100275), read once: ~0.1 s for 100k ids."""
        known = set(self._enc._mergeable_ranks.values()) | set(self._enc._special_tokens.values())
        return tuple(i for i in range(self.vocab_size) if i not in known)

    def _decode(self, ids: np.ndarray) -> str:
        ids = ids[~np.isin(ids, self._special_ids)]
        try:
            data = self._enc.decode_bytes(ids.tolist())
        except KeyError:  # an id in a gap of the vocabulary (e.g. cl100k_base has no 100256)
            for index, token in enumerate(ids.tolist()):
                try:
                    self._enc.decode_single_token_bytes(token)
                except KeyError:
                    raise ValueError(f"token id {token} (position {index} after dropping special ids) is not in {self.name}") from None
            raise
        return data.decode("utf-8", errors="replace")


def tiktoken_cache_dir() -> str:
    """Where tiktoken caches vocabulary files (mirrors tiktoken.load.read_file_cached)."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            return os.environ[variable]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


@contextlib.contextmanager
def _downloads_refused(name: str):
    """Make tiktoken's one network step raise our error instead of downloading.

    tiktoken looks in its cache (file name = sha1 of the blob URL, contents checked against a
    sha256) and calls `tiktoken.load.read_file(url)` only on a miss; patching that keeps tiktoken's
    own cache rules and works for every encoding, including gpt2's two files. Not thread-safe
    against other tiktoken loads running at the same moment.
    """
    real_read_file = tiktoken.load.read_file

    def refuse(blobpath: str) -> bytes:
        if "://" not in blobpath:  # a local file: no network involved
            return real_read_file(blobpath)
        cache_dir = tiktoken_cache_dir()
        file_name = hashlib.sha1(blobpath.encode()).hexdigest()
        where = (
            "caching is disabled (TIKTOKEN_CACHE_DIR is empty)"
            if cache_dir == ""
            else f"expected the file {os.path.join(cache_dir, file_name)!r} (absent, or it failed tiktoken's sha256 check)"
        )
        raise TiktokenNotCachedError(
            f"tiktoken encoding {name!r} is not in the local cache ({where}). Provide it offline: copy {blobpath} to a "
            f"file named {file_name} in {cache_dir or '<a cache directory>'!r} (or set TIKTOKEN_CACHE_DIR to a "
            f"directory that holds it), or set tokenizer.path to a .tiktoken file instead"
        )

    tiktoken.load.read_file = refuse
    try:
        yield
    finally:
        tiktoken.load.read_file = real_read_file


def load_cached_encoding(name: str) -> tiktoken.Encoding:
    """A named tiktoken encoding, read only from the local cache (TiktokenNotCachedError if it is not there)."""
    known = tiktoken.list_encoding_names()
    if name not in known:
        raise ValueError(f"unknown tiktoken encoding {name!r}; known encodings: {', '.join(sorted(known))}")
    with _downloads_refused(name):
        return tiktoken.get_encoding(name)


def load_encoding(name: str) -> tiktoken.Encoding:
    """A named tiktoken encoding: from the local cache, else downloaded by tiktoken (into its cache, checked against
    tiktoken's sha256) unless offline (HF_HUB_OFFLINE, diffjax's switch for every download). Offline, or when the
    download fails: TiktokenNotCachedError, one line saying where the file goes and why it is not there."""
    try:
        return load_cached_encoding(name)
    except TiktokenNotCachedError as absent:
        from diffjax.convert.hub import is_offline, offline_because

        if is_offline():
            raise TiktokenNotCachedError(f"{absent}; nothing was downloaded: {offline_because()}") from None
        try:
            return tiktoken.get_encoding(name)
        except (OSError, ValueError) as error:  # no network (requests' errors are OSErrors), a corrupt download
            raise TiktokenNotCachedError(f"{absent}; the download failed: {type(error).__name__}: "
                                         f"{first_line(error)}") from None


def read_tiktoken_file(path: str | os.PathLike) -> dict[bytes, int]:
    """A `.tiktoken` vocabulary: one `<base64 token> <rank>` per line. Read directly, not through
    tiktoken.load, which would also copy the file into its cache."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tiktoken vocabulary file {path!r} does not exist")
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{number}: expected '<base64 token> <rank>', got {line[:80]!r}") from None
    if not ranks:
        raise ValueError(f"tiktoken vocabulary file {path!r} has no tokens")
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"tiktoken vocabulary file {path!r} gives the same rank to two tokens")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # BPE starts from single bytes: without them some text could not be encoded
        raise ValueError(f"tiktoken vocabulary file {path!r} lacks {len(missing)} single-byte tokens (first: byte {missing[0]})")
    return ranks


def encoding_from_tiktoken_file(path: str | os.PathLike) -> tiktoken.Encoding:
    """A `.tiktoken` file as an Encoding: cl100k_base's pattern, eos "<|endoftext|>" after the highest rank."""
    ranks = read_tiktoken_file(path)
    name = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    return tiktoken.Encoding(
        name=name, pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={ENDOFTEXT: max(ranks.values()) + 1}
    )
