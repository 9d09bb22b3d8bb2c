"""Random-access document sources: `len(source)` documents, `source[i]` -> str.

They implement grain's RandomAccessDataSource protocol (`__len__`, `__getitem__`), so a pipeline
can shuffle, shard and checkpoint by document index alone. Every source lists its files once, in
sorted order, so index i names the same document on every process and after every restart.

Sources hold no open file handles (they open, read and close per document, or cache decoded
Parquet row groups that are dropped when pickled), so they can be sent to grain worker processes.

Paths may be gs:// URLs and globs (diffjax.storage): read through gcsfs, which is imported only then.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import io
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

from diffjax import storage
from diffjax.data.config import DataConfig
from diffjax.data.builtin import builtin_documents
from diffjax.data.segments import Document, parse_segments


def expand_paths(patterns: Sequence[str]) -> list[str]:
    """Files named by `patterns` (plain paths or globs; `**` recurses), sorted and deduplicated.

    Raises FileNotFoundError naming a pattern that matches no file, and IsADirectoryError for a
    plain path to a directory.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    found = set()
    for pattern in patterns:
        if storage.is_url(pattern):
            found.update(_expand_url(os.fspath(pattern)))
            continue
        pattern = os.path.expanduser(str(pattern))
        if glob.has_magic(pattern):
            matches = [path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path)]
            if not matches:
                raise FileNotFoundError(f"data path pattern {pattern!r} matches no files")
        elif os.path.isdir(pattern):
            raise IsADirectoryError(
                f"data path {pattern!r} is a directory; name files or use a glob such as '{pattern}/**/*.txt'"
            )
        elif not os.path.isfile(pattern):
            raise FileNotFoundError(f"data file {pattern!r} does not exist")
        else:
            matches = [pattern]
        found.update(os.path.abspath(path) for path in matches)
    return sorted(found)


def _expand_url(pattern: str) -> list[str]:
    """The gs:// files `pattern` names, as full URLs (the errors of expand_paths, naming the URL)."""
    storage.as_path(pattern)  # clear errors for another scheme or a missing gcsfs
    import gcsfs

    # fsspec's glob, not epath's: that refuses `**` on gs://. It lists the bucket afresh (no stale cache).
    fs = gcsfs.GCSFileSystem()
    if glob.has_magic(pattern):
        matches = fs.glob(pattern, detail=True)
        files = [fs.unstrip_protocol(name) for name, info in matches.items() if info["type"] == "file"]
        if not files:
            raise FileNotFoundError(f"data path pattern {pattern!r} matches no files")
        return files
    if fs.isdir(pattern):  # a prefix with objects below it
        raise IsADirectoryError(
            f"data path {pattern!r} is a directory; name files or use a glob such as '{pattern}/**/*.txt'"
        )
    if not fs.isfile(pattern):
        raise FileNotFoundError(f"data file {pattern!r} does not exist")
    return [fs.unstrip_protocol(pattern)]  # the form the globs give, so the two deduplicate


def _open_binary(path: str):
    """A seekable binary file: plain open for a local path (the fast path), gcsfs for a gs:// URL."""
    return storage.as_path(path).open("rb") if storage.is_url(path) else open(path, "rb")


class ListSource:
    """Documents already in memory (the builtin corpus; tests)."""

    def __init__(self, documents: Sequence[str]):
        self._documents = list(documents)

    def __len__(self) -> int:
        return len(self._documents)

    def __getitem__(self, index: int) -> str:
        return self._documents[index]

    def __repr__(self) -> str:
        return f"ListSource({len(self)} documents)"


class TextFileSource:
    """One file = one document, decoded as UTF-8 (invalid bytes become U+FFFD rather than stop a run)."""

    def __init__(self, patterns: Sequence[str]):
        self.paths = expand_paths(patterns)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> str:
        path = self.paths[index]
        if not storage.is_url(path):
            return Path(path).read_text(encoding="utf-8", errors="replace")
        # Decoded as read_text does (universal newlines), so a URL gives the same text as a local copy.
        with _open_binary(path) as file:
            return io.TextIOWrapper(file, encoding="utf-8", errors="replace").read()

    def __repr__(self) -> str:
        return f"TextFileSource({len(self)} files)"


class _MultiFileIndex:
    """Maps a global document index to (file number, index within the file) by cumulative counts."""

    def __init__(self, counts: Sequence[int]):
        self.ends = np.cumsum(np.asarray(counts, dtype=np.int64)).tolist()

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def locate(self, index: int) -> tuple[int, int]:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"document index {index} out of range [0, {len(self)})")
        file_number = bisect.bisect_right(self.ends, index)
        return file_number, index - (self.ends[file_number - 1] if file_number else 0)


def _jsonl_line_starts(path: str) -> np.ndarray:
    """Byte offsets of the non-blank lines of `path`, read in a stream (never the whole file at once)."""
    starts, offset = [], 0
    with _open_binary(path) as file:
        if storage.is_url(path):  # gcsfs's own readline reads a whole block (5 MB) per line: buffered here
            file = io.BufferedReader(file, buffer_size=1 << 20)
        for line in file:
            if line.strip():
                starts.append(offset)
            offset += len(line)
    return np.asarray(starts, dtype=np.int64)


def _line_number(path: str, offset: int) -> int:
    """1-based line number of the line starting at byte `offset` (only for error messages)."""
    count, remaining = 0, offset
    with _open_binary(path) as file:
        while remaining > 0:
            chunk = file.read(min(remaining, 1 << 24))
            count += chunk.count(b"\n")
            remaining -= len(chunk)
    return count + 1


def _read_url_line(path: str, start: int, end: int | None) -> bytes:
    """The line at byte `start` of a gs:// file (which ends before `end`, the next line's start; None: at the end
    of the file) in one ranged read: gcsfs's readline and read-ahead would fetch a whole block per document."""
    import gcsfs

    storage.as_path(path)  # clear errors for another scheme or a missing gcsfs
    with gcsfs.GCSFileSystem().open(path, "rb", cache_type="none") as file:
        file.seek(start)
        data = file.read(-1 if end is None else end - start)
    newline = data.find(b"\n")
    return data if newline < 0 else data[: newline + 1]  # without the blank lines before `end`


class JsonlSource:
    """One non-blank line = one document: the string in field `text_field` of the line's JSON object, or a
    "segments" list whose labelled segments alone count in the loss (diffjax.data.segments).

    Each file's line-offset index is built by one streaming pass when the source is opened; a
    document is then one seek and one line read. A null field is an empty document (skipped by the
    pipeline). Bad JSON, a missing field or a non-string field raise ValueError naming file and line.
    """

    def __init__(self, patterns: Sequence[str], text_field: str = "text"):
        self.paths = expand_paths(patterns)
        self.text_field = text_field
        self._starts = [_jsonl_line_starts(path) for path in self.paths]
        self._index = _MultiFileIndex([len(starts) for starts in self._starts])

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> Document:
        file_number, line_index = self._index.locate(index)
        starts = self._starts[file_number]
        path, start = self.paths[file_number], int(starts[line_index])
        if storage.is_url(path):
            end = int(starts[line_index + 1]) if line_index + 1 < len(starts) else None
            line = _read_url_line(path, start, end)
        else:
            with open(path, "rb") as file:
                file.seek(start)
                line = file.readline()

        def fail(what: str):
            raise ValueError(f"{path} line {_line_number(path, start)}: {what}")

        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            fail(f"invalid JSON ({error})")
        if not isinstance(record, dict):
            fail(f"expected a JSON object with a {self.text_field!r} field, got {type(record).__name__}")
        if self.text_field not in record:
            if "segments" in record:
                return parse_segments(record["segments"], fail)
            fail(f"no field {self.text_field!r} (fields: {sorted(record)}); set data.text_field, or give a "
                 "'segments' list (diffjax.data.segments)")
        text = record[self.text_field]
        if text is None:
            return ""
        if not isinstance(text, str):
            fail(f"field {self.text_field!r} must be a string, got {type(text).__name__}")
        return text

    def __repr__(self) -> str:
        return f"JsonlSource({len(self)} documents in {len(self.paths)} files, field {self.text_field!r})"


@contextlib.contextmanager
def _parquet_file(path: str):
    """pq.ParquetFile of `path`: pyarrow opens a local path itself; a gs:// URL is a gcsfs file, closed after."""
    import pyarrow.parquet as pq

    if not storage.is_url(path):
        yield pq.ParquetFile(path)
        return
    with _open_binary(path) as file:
        yield pq.ParquetFile(file)


class ParquetSource:
    """One row = one document: the string column `text_field`. Null values are empty documents.

    Reads whole row groups (the unit Parquet compresses) of the one column and keeps the last few
    decoded. Sequential reads cost one row group per group; shuffled reads of a corpus much larger
    than the cache cost one row group per document, so write shuffle-read Parquet with small row
    groups.
    """

    CACHED_ROW_GROUPS = 8

    def __init__(self, patterns: Sequence[str], text_field: str = "text"):
        import pyarrow as pa

        self.paths = expand_paths(patterns)
        self.text_field = text_field
        self._row_group_ends = []  # per file: cumulative row counts of its row groups
        for path in self.paths:
            try:
                with _parquet_file(path) as parquet_file:
                    schema, metadata = parquet_file.schema_arrow, parquet_file.metadata
            except (pa.ArrowException, OSError) as error:
                raise ValueError(f"{path}: not a readable Parquet file ({error})") from error
            if text_field not in schema.names:
                raise ValueError(f"{path}: no column {text_field!r} (columns: {schema.names}); set data.text_field")
            column_type = schema.field(text_field).type
            if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
                raise ValueError(f"{path}: column {text_field!r} must hold strings, got type {column_type}")
            rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
            self._row_group_ends.append(np.cumsum(rows, dtype=np.int64).tolist())
        self._index = _MultiFileIndex([ends[-1] if ends else 0 for ends in self._row_group_ends])
        self._cache = OrderedDict()  # (file number, row group) -> list of str | None

    def __len__(self) -> int:
        return len(self._index)

    def _row_group(self, file_number: int, group: int) -> list:
        key = (file_number, group)
        if key in self._cache:
            self._cache.move_to_end(key)
        else:
            with _parquet_file(self.paths[file_number]) as parquet_file:
                table = parquet_file.read_row_group(group, columns=[self.text_field])
            self._cache[key] = table.column(0).to_pylist()
            while len(self._cache) > self.CACHED_ROW_GROUPS:
                self._cache.popitem(last=False)
        return self._cache[key]

    def __getitem__(self, index: int) -> str:
        file_number, row = self._index.locate(index)
        ends = self._row_group_ends[file_number]
        group = bisect.bisect_right(ends, row)
        text = self._row_group(file_number, group)[row - (ends[group - 1] if group else 0)]
        return "" if text is None else text

    def __getstate__(self):
        return {**self.__dict__, "_cache": OrderedDict()}  # decoded row groups stay behind

    def __repr__(self) -> str:
        return f"ParquetSource({len(self)} documents in {len(self.paths)} files, column {self.text_field!r})"


def open_documents(config: DataConfig):
    """The document source that `config.source` names: random access (len, [i]), or for a streamed dataset
    (config.streams) a diffjax.data.hf_datasets.DocumentStream (iteration only). Every source iterates."""
    if config.source == "hf":
        from diffjax.data import hf_datasets  # datasets (the hub extra) only when asked for

        return hf_datasets.DocumentStream(config) if config.streams else hf_datasets.HFDatasetSource(config)
    if config.source == "builtin":
        return ListSource(builtin_documents(config.builtin_bytes))
    if config.source == "text":
        return TextFileSource(config.paths)
    if config.source == "jsonl":
        return JsonlSource(config.paths, config.text_field)
    if config.source == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError as error:
            raise ImportError("data.source 'parquet' needs pyarrow: pip install pyarrow") from error
        return ParquetSource(config.paths, config.text_field)
    raise ValueError(f"unknown data.source {config.source!r}")
