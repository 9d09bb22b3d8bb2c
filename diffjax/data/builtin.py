"""The built-in corpus: the Python standard library's own source, one document per file.

It exists wherever Python runs, needs no download, and is a few MB of real, structured text. The
same interpreter always yields the same documents (paths are sorted, and the byte budget cuts at a
fixed point).

`builtin_corpus`, `split_train_eval`, `random_windows` and `sequential_windows` serve the first
(window-sampling) trainer and go when it does.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

DEFAULT_CORPUS_BYTES = 4_000_000
# Directories never read: third-party code, the (large, repetitive) test suites, and generated
# data rather than code (codec tables in encodings/, the pydoc topic strings in pydoc_data/).
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)
# Files never read: written at build time, so they differ between machines.
SKIP_FILE_PREFIXES = ("_sysconfigdata",)
FILE_SEPARATOR = b"\n\n"


def stdlib_dir() -> Path:
    """The standard library directory: where the `os` module lives."""
    return Path(os.__file__).resolve().parent


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """Every `.py` file under root (default: the stdlib) not excluded by SKIP_DIRS / SKIP_FILE_PREFIXES.

    Sorted by path relative to root, so the order is the same wherever the stdlib is installed.
    """
    root = stdlib_dir() if root is None else Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in SKIP_DIRS]
        found.extend(
            Path(dirpath, name)
            for name in filenames
            if name.endswith(".py") and not name.startswith(SKIP_FILE_PREFIXES)
        )
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def builtin_documents(max_bytes: int = DEFAULT_CORPUS_BYTES, root: Path | None = None) -> list[str]:
    """The stdlib `.py` files in sorted order, one str per file, `max_bytes` of UTF-8 in all (fewer if exhausted).

    The file that crosses the budget is cut there. Unreadable and empty files are skipped; bytes that
    are not UTF-8 become U+FFFD.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    documents, size = [], 0
    for path in stdlib_source_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        data = data[: max_bytes - size]
        if not data:
            continue
        documents.append(data.decode("utf-8", errors="replace"))
        size += len(data)
        if size >= max_bytes:
            break
    if not documents:
        raise RuntimeError(f"found no readable .py files under {root or stdlib_dir()}")
    return documents


def builtin_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, root: Path | None = None) -> bytes:
    """The stdlib `.py` sources concatenated in sorted order, cut at exactly `max_bytes` (or fewer if exhausted).

    Unreadable files are skipped. Files are separated by a blank line.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks, size = [], 0
    for path in stdlib_source_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        chunks.append(data + FILE_SEPARATOR)
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if not corpus:
        raise RuntimeError(f"found no readable .py files under {root or stdlib_dir()}")
    return corpus


def split_train_eval(data, eval_fraction: float):
    """(train, eval): the last `eval_fraction` of `data` (a sequence or array) is held out, unshuffled."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    num_eval = int(round(len(data) * eval_fraction))
    cut = len(data) - num_eval
    return data[:cut], data[cut:]


def random_windows(tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """[batch_size, seq_len] int32 windows starting at uniformly random offsets drawn from `rng`."""
    tokens = np.asarray(tokens)
    if len(tokens) < seq_len:
        raise ValueError(f"need at least seq_len={seq_len} tokens to cut a window, got {len(tokens)}")
    starts = rng.integers(0, len(tokens) - seq_len + 1, size=batch_size)
    return tokens[starts[:, None] + np.arange(seq_len)].astype(np.int32)


def sequential_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """[N, seq_len] int32 consecutive non-overlapping windows from the start of `tokens` (the tail is dropped)."""
    tokens = np.asarray(tokens)
    count = len(tokens) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    return tokens[: count * seq_len].reshape(count, seq_len).astype(np.int32)
