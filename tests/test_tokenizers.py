"""Tokenizers: byte, SentencePiece and tiktoken behind one interface, checked against the libraries
used directly. Everything is built here (no downloads): a SentencePiece model trained on a small
corpus, a small tiktoken vocabulary, and a fake tiktoken cache directory."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import tiktoken
import tiktoken.load
import tiktoken.registry
import tiktoken_ext.openai_public

from diffjax.tokenizers.config import TokenizerConfig
from diffjax.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenNotCachedError,
    TiktokenTokenizer,
    Tokenizer,
    make_tokenizer,
    tiktoken_cache_dir,
    train_sentencepiece,
)
from diffjax.tokenizers.tiktoken_tokenizer import CL100K_PATTERN

REPO_ROOT = Path(__file__).resolve().parents[1]
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"

FIXED_TEXTS = [
    "",
    "hello",
    " leading and trailing spaces  ",
    "\x00nul and\ttabs\n\n  indented\r\n",
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🙂🚀 and e\u0301 combining",
    "\U0010ffff",
    "ｆｕｌｌ-width and \u3000 ideographic space",
    "def f(x):\n    return x  # <|endoftext|> is ordinary text here\n",
]


def _random_text(rng: np.random.Generator, length: int) -> str:
    """Code points from every UTF-8 length class (1 to 4 bytes), surrogates excluded."""
    ranges = [(0, 0x80), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    chars = []
    for _ in range(length):
        low, high = ranges[rng.integers(len(ranges))]
        chars.append(chr(int(rng.integers(low, high))))
    return "".join(chars)


def _random_texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    # U+2581 is SentencePiece's whitespace marker and decodes as a space (see the sentencepiece test).
    return [_random_text(rng, int(rng.integers(1, 120))).replace("\u2581", "_") for _ in range(count)]


def _check_common(tokenizer: Tokenizer, texts: list[str]) -> None:
    """What every tokenizer promises: int32 1-D ids in range, exact round trips, concatenation."""
    assert isinstance(tokenizer, Tokenizer) and tokenizer.name
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert ids.size == 0 or (ids.min() >= 0 and ids.max() < tokenizer.vocab_size)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids.tolist()) == text
    # Documents are encoded one by one and packed: the concatenated ids decode to the joined text,
    # with eos (a special id) skipped.
    pieces = [tokenizer.encode(t) for t in texts[:4]]
    if tokenizer.eos_id is not None:
        pieces = [np.append(p, np.int32(tokenizer.eos_id)) for p in pieces]
    assert tokenizer.decode(np.concatenate(pieces)) == "".join(texts[:4])
    for bad in ([tokenizer.vocab_size], [3, -1], [0, 10**9]):
        with pytest.raises(ValueError, match=f"outside the vocabulary .0, {tokenizer.vocab_size}."):
            tokenizer.decode(bad)
    with pytest.raises(ValueError, match="position 1"):
        tokenizer.decode([0, -5])
    with pytest.raises(ValueError, match="1-D"):
        tokenizer.decode([[1, 2]])
    with pytest.raises(TypeError):
        tokenizer.decode(np.array([65.0, 66.0]))
    with pytest.raises(TypeError):
        tokenizer.encode(b"bytes are not text")


# --- byte -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_byte_tokenizer_round_trips(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids.tolist()) == text


def test_byte_tokenizer_interface_and_random_unicode():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id) == (257, 256, None)
    _check_common(tokenizer, FIXED_TEXTS + _random_texts(50))
    assert tokenizer.encode_bytes(b"\xff\x00A").tolist() == [255, 0, 65]
    assert tokenizer.decode([104, 256, 105, 256]) == "hi"  # eos skipped


def test_byte_tokenizer_replaces_invalid_utf8():
    tokenizer = ByteTokenizer()
    # A cut multi-byte character decodes with U+FFFD instead of raising.
    assert tokenizer.decode([0x68, 0xC3]) == "h\ufffd"
    assert tokenizer.decode([0xFF]) == "\ufffd"


# --- sentencepiece --------------------------------------------------------------------------


def _corpus(max_chars: int = 300_000) -> list[str]:
    """A few hundred KB of documents: stdlib sources plus multilingual prose."""
    documents = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        documents.append(text)
        total += len(text)
        if total >= max_chars:
            break
    prose = "Grüße aus Köln. Ελληνικά κείμενα. Русский текст. 日本語のテキスト。 emoji 🙂🚀\n"
    return documents + [prose * 50]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _corpus()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, corpus) -> str:
    path = tmp_path_factory.mktemp("sp") / "tok.model"
    train_sentencepiece(corpus, vocab_size=400, output_path=path)
    return str(path)


def test_sentencepiece_matches_the_library_and_round_trips(sp_model, corpus):
    tokenizer = SentencePieceTokenizer(sp_model)
    reference = spm.SentencePieceProcessor(model_file=sp_model)
    assert tokenizer.vocab_size == reference.get_piece_size() == 400
    assert (tokenizer.eos_id, tokenizer.bos_id) == (2, 1)
    assert (reference.id_to_piece(2), reference.id_to_piece(1)) == ("</s>", "<s>")
    texts = FIXED_TEXTS + _random_texts(100) + [corpus[0][:3000]]
    for text in texts:
        assert tokenizer.encode(text).tolist() == reference.encode(text)
    _check_common(tokenizer, texts)
    # Byte fallback: characters never seen in training are bytes, not <unk>.
    ids = tokenizer.encode("\U0001f9ec")
    assert len(ids) == 4 and reference.unk_id() not in ids.tolist()
    assert tokenizer.decode([1, *tokenizer.encode("abc"), 2]) == "abc"  # bos, eos skipped
    # The one known exception to exact round trips: U+2581 is SentencePiece's space marker.
    assert tokenizer.decode(tokenizer.encode("a\u2581b")) == "a b"


def test_sentencepiece_training_is_deterministic_and_atomic(tmp_path, corpus):
    documents = corpus[:3]
    first = train_sentencepiece(iter(documents), vocab_size=350, output_path=tmp_path / "a.model")
    second = train_sentencepiece(iter(documents), vocab_size=350, output_path=tmp_path / "b.model")
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert first.encode(corpus[5][:2000]).tolist() == second.encode(corpus[5][:2000]).tolist()
    # Overwriting an existing model leaves no temporary files behind.
    train_sentencepiece(iter(documents), vocab_size=360, output_path=tmp_path / "a.model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "b.model"]
    assert SentencePieceTokenizer(tmp_path / "a.model").vocab_size == 360


def test_sentencepiece_options_and_training_errors(tmp_path, corpus):
    no_eos = train_sentencepiece(corpus[:2], vocab_size=350, output_path=tmp_path / "n.model", eos_id=-1, bos_id=-1)
    assert (no_eos.eos_id, no_eos.bos_id) == (None, None)
    unigram = train_sentencepiece(corpus[:2], vocab_size=350, output_path=tmp_path / "u.model", model_type="unigram")
    train_sentencepiece(corpus[:2], vocab_size=350, output_path=tmp_path / "u2.model", model_type="unigram")
    assert (tmp_path / "u.model").read_bytes() == (tmp_path / "u2.model").read_bytes()  # deterministic too
    assert unigram.decode(unigram.encode(FIXED_TEXTS[3])) == FIXED_TEXTS[3]
    with pytest.raises(ValueError, match="sentencepiece training failed.*vocab"):
        train_sentencepiece(corpus[:2], vocab_size=100, output_path=tmp_path / "small.model")
    assert not (tmp_path / "small.model").exists()


def test_sentencepiece_missing_and_invalid_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-sentencepiece"):
        SentencePieceTokenizer(tmp_path / "absent.model")
    (tmp_path / "text.model").write_text("this is not a sentencepiece model")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        SentencePieceTokenizer(tmp_path / "text.model")
    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        SentencePieceTokenizer(tmp_path / "empty.model")


def test_train_sentencepiece_command(tmp_path, corpus, capsys):
    """`python -m diffjax.data train-sentencepiece` on text files (one file = one document)."""
    for index, document in enumerate(corpus[:4]):
        (tmp_path / f"doc{index}.txt").write_text(document, encoding="utf-8")
    output = tmp_path / "out" / "cli.model"
    command = [sys.executable, "-m", "diffjax.data", "train-sentencepiece", "--output", str(output),
               "--vocab-size", "380", "--source", "text", "--paths", str(tmp_path / "*.txt"), "--max-documents", "3"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"wrote {output}" in result.stdout and "3 documents" in result.stdout
    tokenizer = SentencePieceTokenizer(output)
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (380, 2)
    assert tokenizer.decode(tokenizer.encode(corpus[0])) == corpus[0]
    # A vocabulary too small for the corpus: a one-line error, exit status 1, no model written
    # (in process: a second interpreter start costs seconds).
    from diffjax.data.__main__ import main

    arguments = command[command.index("train-sentencepiece"):]
    arguments[arguments.index("--vocab-size") + 1] = "50"
    arguments[arguments.index("--output") + 1] = str(tmp_path / "small.model")
    assert main(arguments) == 1
    assert capsys.readouterr().err.startswith("error: sentencepiece training failed")
    assert not (tmp_path / "small.model").exists()


# --- tiktoken -------------------------------------------------------------------------------


def _small_ranks() -> dict[bytes, int]:
    """All 256 bytes, then every prefix of a few words: each merged token is a lower-ranked token
    plus one byte, as BPE needs."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in [" the", " and", "ing", " def", " return", "self", "    ", "\n\n", " wörld", "日本"]:
        data = word.encode("utf-8")
        for end in range(2, len(data) + 1):
            ranks.setdefault(data[:end], len(ranks))
    return ranks


def _write_tiktoken(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_bytes(b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in ranks.items()))


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt by tiktoken to download fails the test."""
    import requests

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(requests, "get", refuse)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # no encoding cached in memory, none leaked


def test_tiktoken_file_matches_the_library_and_round_trips(tmp_path):
    ranks = _small_ranks()
    path = tmp_path / "small.tiktoken"
    _write_tiktoken(path, ranks)
    tokenizer = TiktokenTokenizer(path=path)
    eos = max(ranks.values()) + 1
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id) == (eos + 1, eos, None)
    # The pattern is cl100k_base's, as the installed tiktoken defines it.
    reference = tiktoken.Encoding(
        name="reference", pat_str=_cl100k_definition(ranks)["pat_str"], mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": eos},
    )
    assert CL100K_PATTERN == reference._pat_str
    texts = FIXED_TEXTS + _random_texts(100)
    for text in texts:
        assert tokenizer.encode(text).tolist() == reference.encode_ordinary(text)
    assert len(tokenizer.encode(" the and")) == 2  # the merges are used
    _check_common(tokenizer, texts)
    assert tokenizer.encode("<|endoftext|>").tolist() == reference.encode_ordinary("<|endoftext|>")  # plain text


def _cl100k_definition(ranks: dict[bytes, int]) -> dict:
    """tiktoken's own cl100k_base definition, with our small vocabulary instead of a download."""
    original = tiktoken_ext.openai_public.load_tiktoken_bpe
    tiktoken_ext.openai_public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
    try:
        return tiktoken_ext.openai_public.cl100k_base()
    finally:
        tiktoken_ext.openai_public.load_tiktoken_bpe = original


def test_tiktoken_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TiktokenTokenizer(path=tmp_path / "absent.tiktoken")
    (tmp_path / "garbage.tiktoken").write_text("not base64!! 0\n")
    with pytest.raises(ValueError, match="garbage.tiktoken:1"):
        TiktokenTokenizer(path=tmp_path / "garbage.tiktoken")
    _write_tiktoken(tmp_path / "partial.tiktoken", {b"a": 0, b"b": 1})
    with pytest.raises(ValueError, match="lacks 254 single-byte tokens"):
        TiktokenTokenizer(path=tmp_path / "partial.tiktoken")
    with pytest.raises(ValueError, match="exactly one"):
        TiktokenTokenizer()


def test_tiktoken_named_encoding_from_a_fake_cache(tmp_path, monkeypatch, no_network):
    """cl100k_base read from TIKTOKEN_CACHE_DIR under tiktoken's file name: the sha1 of the blob URL."""
    ranks = _small_ranks()
    cached = tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest()
    _write_tiktoken(cached, ranks)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    # tiktoken checks the cached file's sha256; this small vocabulary is not OpenAI's file.
    monkeypatch.setattr(tiktoken.load, "check_hash", lambda data, expected_hash: True)
    tokenizer = TiktokenTokenizer("cl100k_base")
    assert cached.exists()
    definition = _cl100k_definition(ranks)
    reference = tiktoken.Encoding(**definition)
    assert tokenizer.name == "tiktoken(cl100k_base)"
    assert tokenizer.vocab_size == reference.n_vocab == 100277
    assert (tokenizer.eos_id, tokenizer.bos_id) == (100257, None)
    texts = FIXED_TEXTS + _random_texts(50)
    for text in texts:
        assert tokenizer.encode(text).tolist() == reference.encode_ordinary(text)
    _check_common(tokenizer, texts)
    # Special ids are skipped; ids in the gaps of the vocabulary are errors.
    assert tokenizer.decode([100258, *tokenizer.encode("hi"), 100276, 100257]) == "hi"
    with pytest.raises(ValueError, match="token id 100256 .position 1"):
        tokenizer.decode([5, 100256])
    assert isinstance(make_tokenizer(TokenizerConfig(kind="tiktoken", encoding="cl100k_base")), TiktokenTokenizer)


@pytest.fixture
def online(monkeypatch):
    """Offline mode off (the network itself is what each test makes of tiktoken.load.read_file)."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_tiktoken_named_encoding_absent_offline(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TiktokenNotCachedError) as raised:
        TiktokenTokenizer("cl100k_base")
    message = str(raised.value)
    file_name = hashlib.sha1(CL100K_URL.encode()).hexdigest()
    for part in ("'cl100k_base'", str(tmp_path / file_name), CL100K_URL, "TIKTOKEN_CACHE_DIR", "tokenizer.path",
                 "nothing was downloaded: offline mode is on (HF_HUB_OFFLINE set in your environment)"):
        assert part in message
    assert "\n" not in message
    assert isinstance(raised.value, FileNotFoundError)
    assert tiktoken.load.read_file.__module__ == "tiktoken.load"  # the download guard is undone
    # gpt2 needs two files; the first one missing is named.
    with pytest.raises(TiktokenNotCachedError, match="'gpt2'.*vocab.bpe"):
        TiktokenTokenizer("gpt2")
    # An empty TIKTOKEN_CACHE_DIR turns tiktoken's cache off.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(TiktokenNotCachedError, match="caching is disabled"):
        TiktokenTokenizer("o200k_base")
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'cl200k'.*cl100k_base.*r50k_base"):
        TiktokenTokenizer("cl200k")


def test_tiktoken_downloads_an_absent_encoding_when_online(tmp_path, monkeypatch, online):
    """Online, tiktoken's own download (tiktoken.load.read_file, here answering with a small vocabulary) fills its
    cache; the next load reads the cache with the network refused."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setattr(tiktoken.load, "check_hash", lambda data, expected_hash: True)  # not OpenAI's file
    _write_tiktoken(tmp_path / "served", _small_ranks())
    fetched = []

    def read_file(url: str) -> bytes:
        fetched.append(url)
        return (tmp_path / "served").read_bytes()

    monkeypatch.setattr(tiktoken.load, "read_file", read_file)
    tokenizer = TiktokenTokenizer("cl100k_base")
    assert fetched == [CL100K_URL] and (tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest()).exists()
    reference = tiktoken.Encoding(**_cl100k_definition(_small_ranks()))
    assert tokenizer.encode(FIXED_TEXTS[0]).tolist() == reference.encode_ordinary(FIXED_TEXTS[0])
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setattr(tiktoken.load, "read_file", lambda url: pytest.fail(f"downloaded {url} again"))
    assert TiktokenTokenizer("cl100k_base").vocab_size == tokenizer.vocab_size


def test_tiktoken_download_that_fails_is_one_line(tmp_path, monkeypatch, online):
    import requests

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})

    def unreachable(url: str) -> bytes:
        raise requests.exceptions.ConnectionError(f"HTTPSConnectionPool: Max retries exceeded with url: {url}\n...")

    monkeypatch.setattr(tiktoken.load, "read_file", unreachable)
    with pytest.raises(TiktokenNotCachedError) as raised:
        TiktokenTokenizer("cl100k_base")
    message = str(raised.value)
    assert "the download failed: ConnectionError: HTTPSConnectionPool: Max retries exceeded" in message
    assert str(tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest()) in message and "\n" not in message


def test_tiktoken_cache_dir_follows_tiktoken(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    assert tiktoken_cache_dir() == os.path.join(tempfile.gettempdir(), "data-gym-cache")
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "gym"))
    assert tiktoken_cache_dir() == str(tmp_path / "gym")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tik"))
    assert tiktoken_cache_dir() == str(tmp_path / "tik")


# --- Hugging Face tokenizer.json -----------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, corpus) -> Path:
    """A byte-level BPE trained here with the `tokenizers` library and saved as an HF checkpoint ships it:
    tokenizer.json, and tokenizer_config.json naming eos (a string) and bos (an AddedToken dict)."""
    import json

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory = tmp_path_factory.mktemp("hf")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def test_hf_tokenizer_matches_the_library_and_round_trips(hf_dir):
    from tokenizers import Tokenizer as RustTokenizer

    tokenizer = HFTokenizer(hf_dir)
    library = RustTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert (tokenizer.eos_id, tokenizer.bos_id) == (library.token_to_id("</s>"), library.token_to_id("<s>"))
    assert tokenizer.vocab_size == library.get_vocab_size(with_added_tokens=True)
    texts = FIXED_TEXTS + _random_texts(50, seed=4)
    for text in texts:
        assert tokenizer.encode(text).tolist() == library.encode(text, add_special_tokens=False).ids
    _check_common(tokenizer, texts)
    assert HFTokenizer(hf_dir / "tokenizer.json").encode("hello").tolist() == tokenizer.encode("hello").tolist()


def test_hf_tokenizer_agrees_with_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ours = HFTokenizer(hf_dir)
    assert (ours.eos_id, ours.bos_id) == (theirs.eos_token_id, theirs.bos_token_id)
    for text in FIXED_TEXTS + _random_texts(20, seed=5):
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text).tolist() == ids
        assert ours.decode(ids + [ours.eos_id]) == theirs.decode(ids + [ours.eos_id], skip_special_tokens=True)


def test_hf_tokenizer_errors_name_the_file(tmp_path, hf_dir):
    import json
    import shutil

    with pytest.raises(FileNotFoundError, match=r"directory .* has no tokenizer.json.*or a Hub model name"):
        HFTokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'.*absent.json' does not exist"):
        HFTokenizer(tmp_path / "absent.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer.json' is not a Hugging Face tokenizer.json"):
        HFTokenizer(tmp_path)
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|no such token|>"}))
    with pytest.raises(ValueError, match=r"the eos_token '<\|no such token\|>' named beside it is not in its vocabulary"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config.json' must hold a JSON object, got list"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    assert (HFTokenizer(tmp_path).eos_id, HFTokenizer(tmp_path).bos_id) == (None, None)  # nothing names them
    with pytest.raises(ValueError, match="data.tokenizer.path must name a tokenizer.json"):
        TokenizerConfig(kind="hf")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, hf_dir):
    """A Hugging Face cache (tests/hub_cache.py) holding the tokenizer of hf_dir as NAME at main, and at the branch
    v2 one whose tokenizer_config.json names another eos; read offline. Returns NAME."""
    constants = pytest.importorskip("huggingface_hub.constants")
    import json
    import shutil

    from hub_cache import write_cached_repo

    v2 = tmp_path / "v2"
    shutil.copytree(hf_dir, v2)
    (v2 / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    (v2 / "model.safetensors").write_bytes(b"weights the tokenizer never needs")
    write_cached_repo(tmp_path / "hub", "diffjax-tests/tokenizer", {"main": hf_dir, "v2": v2})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return "diffjax-tests/tokenizer"


def test_hf_tokenizer_by_hub_name_reads_the_cache(offline_hub, hf_dir):
    by_name, by_path = HFTokenizer(offline_hub), HFTokenizer(hf_dir)
    assert by_name.encode(FIXED_TEXTS[0]).tolist() == by_path.encode(FIXED_TEXTS[0]).tolist()
    assert (by_name.eos_id, by_name.vocab_size) == (by_path.eos_id, by_path.vocab_size)
    v2 = make_tokenizer(TokenizerConfig(kind="hf", path=offline_hub, revision="v2"))
    assert v2.eos_id == by_path._tok.token_to_id("<pad>") != by_path.eos_id
    with pytest.raises(FileNotFoundError) as absent:
        HFTokenizer("diffjax-tests/absent")
    assert "`hf download diffjax-tests/absent`" in str(absent.value) and "\n" not in str(absent.value)
    with pytest.raises(ValueError, match="applies to a Hugging Face Hub name"):
        HFTokenizer(hf_dir, revision="v2")
    with pytest.raises(ValueError, match="data.tokenizer.revision is for data.tokenizer.kind 'hf'"):
        TokenizerConfig(kind="byte", revision="v2")


def test_a_hub_tokenizer_fetches_its_tokenizer_files_only(hf_dir, tmp_path, monkeypatch):
    """Online, snapshot_download is asked for the tokenizer's files, never the weights; a repository without a
    tokenizer.json is one line."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked = []

    def snapshot_download(name, **kwargs):
        asked.append((name, kwargs))
        return str(hf_dir if name.endswith("tokenizer") else tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    HFTokenizer("diffjax-tests/tokenizer")
    assert set(asked[0][1]["allow_patterns"]) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    with pytest.raises(FileNotFoundError, match="diffjax-tests/weights-only has no tokenizer.json"):
        HFTokenizer("diffjax-tests/weights-only")


# --- make_tokenizer -------------------------------------------------------------------------


def test_make_tokenizer_builds_each_kind(tmp_path, sp_model, hf_dir):
    assert isinstance(make_tokenizer(TokenizerConfig()), ByteTokenizer)
    sentencepiece = make_tokenizer(TokenizerConfig(kind="sentencepiece", path=sp_model))
    assert isinstance(sentencepiece, SentencePieceTokenizer) and sentencepiece.vocab_size == 400
    _write_tiktoken(tmp_path / "v.tiktoken", _small_ranks())
    tiktoken_file = make_tokenizer(TokenizerConfig(kind="tiktoken", path=str(tmp_path / "v.tiktoken")))
    assert isinstance(tiktoken_file, TiktokenTokenizer) and tiktoken_file.name == "tiktoken(v.tiktoken)"
    hf = make_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)))
    assert isinstance(hf, HFTokenizer) and hf.vocab_size == 400
