"""Data sources read from gs:// files and globs (on the GCS emulator): the same documents as the same files locally."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from diffjax import storage
from diffjax.data import expand_paths, make_train_dataset, open_documents
from diffjax.data.config import DataConfig
from diffjax.tokenizers import ByteTokenizer

UNICODE = "naïve café — 日本語テキスト, emoji 🚀, Ελληνικά"
RECORDS = [{"text": UNICODE, "id": 1}, {"text": "two\nlines"}, {"text": None}] + [{"text": f"doc {i} " * i} for i in range(40)]


def write_both(files: dict, local_root, url: str) -> None:
    """The same bytes under a local directory and under a gs:// prefix."""
    for name, data in files.items():
        (local_root / name).parent.mkdir(parents=True, exist_ok=True)
        (local_root / name).write_bytes(data)
        with storage.as_path(f"{url}/{name}").open("wb") as file:
            file.write(data)


def documents(source) -> list:
    return [source[i] for i in range(len(source))]


def assert_same_source(local, remote):
    assert len(remote) == len(local) > 0
    assert documents(remote) == documents(local)
    assert documents(pickle.loads(pickle.dumps(remote))) == documents(local)  # grain workers get it pickled


def parquet_bytes(texts, row_group_size) -> bytes:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), sink, row_group_size=row_group_size)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("source", ["text", "jsonl", "parquet"])
def test_gs_glob_gives_the_same_documents_as_the_local_files(source, gcs, tmp_path):
    url = gcs.url(source)
    if source == "text":  # CRLF and invalid UTF-8: decoded as locally (newlines translated, U+FFFD)
        files = {"a.txt": UNICODE.encode(), "b.txt": b"crlf\r\nline\r\n", "sub/c.txt": b"bad \xff byte\n"}
        pattern, text_field = "**/*.txt", "text"
    elif source == "jsonl":
        lines = [json.dumps(r, ensure_ascii=False).encode() for r in RECORDS]
        files = {"a.jsonl": b"\n".join(lines[:20]) + b"\n\n", "deep/er/b.jsonl": b"\r\n".join(lines[20:])}
        pattern, text_field = "**/*.jsonl", "text"
    else:
        texts = ["zero", UNICODE, None, "three", "four"]
        files = {"a.parquet": parquet_bytes(texts, 2), "sub/b.parquet": parquet_bytes(["five"], 1)}
        pattern, text_field = "**/*.parquet", "content"
    files["notes.md"] = b"not matched"
    write_both(files, tmp_path, url)

    local = open_documents(DataConfig(source=source, paths=(str(tmp_path / pattern),), text_field=text_field))
    remote = open_documents(DataConfig(source=source, paths=(f"{url}/{pattern}",), text_field=text_field))
    assert remote.paths == sorted(f"{url}/{name}" for name in files if name != "notes.md")
    assert_same_source(local, remote)


def test_gs_globs_recurse_sort_and_deduplicate(gcs, tmp_path):
    url = gcs.url("globs")
    write_both({name: name.encode() for name in ["b.txt", "a.txt", "sub/c.txt", "sub/deep/d.txt", "skip.md"]}, tmp_path, url)
    found = expand_paths([f"{url}/**/*.txt", f"{url}/a.txt", f"{url}/*.txt", f"{url}/sub/*"])
    assert found == [f"{url}/{name}" for name in ["a.txt", "b.txt", "sub/c.txt", "sub/deep/d.txt"]]
    assert expand_paths([f"{url}/sub/*"]) == [f"{url}/sub/c.txt"]  # only files: not the sub/deep "directory"
    assert expand_paths(f"{url}/**") == [f"{url}/{name}" for name in ["a.txt", "b.txt", "skip.md", "sub/c.txt", "sub/deep/d.txt"]]


def test_gs_errors_name_the_url(gcs, tmp_path):
    url = gcs.url("errors")
    write_both({"dir/a.txt": b"a"}, tmp_path, url)
    with pytest.raises(FileNotFoundError, match=f"'{url}/nothing/\\*\\*/\\*.txt' matches no files"):
        expand_paths([f"{url}/nothing/**/*.txt"])
    with pytest.raises(IsADirectoryError, match=f"'{url}/dir' is a directory.*'{url}/dir/\\*\\*/\\*.txt'"):
        expand_paths([f"{url}/dir"])
    with pytest.raises(FileNotFoundError, match=f"data file '{url}/missing.jsonl' does not exist"):
        open_documents(DataConfig(source="jsonl", paths=(f"{url}/missing.jsonl",)))
    with pytest.raises(ValueError, match=r"s3:// is not supported"):
        expand_paths(["s3://bucket/*.txt"])


def test_gs_jsonl_errors_name_the_url_and_line(gcs):
    url = gcs.url("bad")
    storage.as_path(f"{url}/docs.jsonl").write_text('{"text": "one"}\n\n{not json}\n')
    source = open_documents(DataConfig(source="jsonl", paths=(f"{url}/docs.jsonl",)))
    assert source[0] == "one"
    with pytest.raises(ValueError, match=f"{url}/docs.jsonl line 3: invalid JSON"):
        source[1]


def test_first_training_batch_from_gs_equals_the_local_one(gcs, tmp_path):
    url = gcs.url("train")
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in RECORDS]
    write_both({"part-0.jsonl": b"\n".join(lines[:25]), "more/part-1.jsonl": b"\n".join(lines[25:])}, tmp_path, url)

    def first_batch(pattern):
        config = DataConfig(source="jsonl", paths=(pattern,), seq_len=32, eval_fraction=0.1, shuffle_window_tokens=256)
        source = open_documents(config)
        return next(iter(make_train_dataset(config, ByteTokenizer(), batch_size=4, seed=7, shard_index=0, shard_count=1,
                                            source=source)))

    local, remote = first_batch(str(tmp_path / "**" / "*.jsonl")), first_batch(f"{url}/**/*.jsonl")
    assert set(remote) == set(local)
    for key in local:
        np.testing.assert_array_equal(remote[key], local[key])
    assert (local["segment_ids"] > 0).any()


def test_local_paths_import_no_gcs_client(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    code = ("import sys\nfrom diffjax.data import open_documents\nfrom diffjax.data.config import DataConfig\n"
            f"open_documents(DataConfig(source='jsonl', paths=({str(tmp_path / '*.jsonl')!r},)))[0]\n"
            "print(sorted({'gcsfs', 'fsspec'} & {name.split('.')[0] for name in sys.modules}))")  # etils: grain's
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
