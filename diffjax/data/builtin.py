"""The built-in corpus: the Python standard library's own source, one document per file.

It exists wherever Python runs, needs no download, and is a few MB of real, structured text. The
same interpreter always yields the same documents (paths are sorted, and the byte budget cuts at a
fixed point).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CORPUS_BYTES = 4_000_000
# Directories never read: third-party code, the (large, repetitive) test suites, and generated
# data rather than code (codec tables in encodings/, the pydoc topic strings in pydoc_data/).
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)
# Files never read: written at build time, so they differ between machines.
SKIP_FILE_PREFIXES = ("_sysconfigdata",)


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


def builtin_held_out(train_bytes: int, held_out_bytes: int, root: Path | None = None) -> list[str]:
    """The `held_out_bytes` of the corpus that follow builtin_documents(train_bytes): the rest of the file that
    budget cut, then whole files. No byte of it is in the training documents."""
    train = builtin_documents(train_bytes, root)
    both = builtin_documents(train_bytes + held_out_bytes, root)
    rest_of_cut_file = both[len(train) - 1][len(train[-1]):]
    return [text for text in [rest_of_cut_file, *both[len(train):]] if text]
