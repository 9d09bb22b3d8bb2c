"""Document sources (text files, globs, JSONL, Parquet, builtin) and the train / eval split."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from diffjax.data.config import DataConfig
from diffjax.data import (
    builtin_held_out,
    JsonlSource,
    TextFileSource,
    builtin_documents,
    expand_paths,
    is_eval_document,
    open_documents,
    split_documents,
)

UNICODE = "naïve café — 日本語テキスト, emoji 🚀, Ελληνικά"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_text_files_and_globs_sorted_and_deduplicated(tmp_path):
    write(tmp_path / "b.txt", "second")
    write(tmp_path / "a.txt", UNICODE)
    write(tmp_path / "sub" / "c.txt", "third\n")
    write(tmp_path / "skip.md", "not matched")
    patterns = [str(tmp_path / "*.txt"), str(tmp_path / "a.txt"), str(tmp_path / "**" / "*.txt")]
    source = open_documents(DataConfig(source="text", paths=patterns))
    assert isinstance(source, TextFileSource)
    assert [p.rsplit("/", 1)[-1] for p in source.paths] == ["a.txt", "b.txt", "c.txt"]
    assert [source[i] for i in range(len(source))] == [UNICODE, "second", "third\n"]


def test_missing_files_name_the_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        expand_paths([str(tmp_path / "nothing-here" / "*.txt")])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        open_documents(DataConfig(source="jsonl", paths=(str(tmp_path / "missing.jsonl"),)))
    with pytest.raises(IsADirectoryError, match="glob"):
        expand_paths([str(tmp_path)])


def test_jsonl_reads_each_line_across_files(tmp_path):
    records = [{"text": UNICODE, "id": 1}, {"text": "two\nlines", "meta": [1, 2]}, {"text": None}]
    write(tmp_path / "a.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n\n")
    write(tmp_path / "b.jsonl", '{"body": "x", "text": "last"}\r\n\r\n')  # CRLF, blank line, no trailing LF
    source = open_documents(DataConfig(source="jsonl", paths=(str(tmp_path / "*.jsonl"),)))
    assert isinstance(source, JsonlSource)
    assert len(source) == 4
    assert [source[i] for i in range(4)] == [UNICODE, "two\nlines", "", "last"]
    assert source[-1] == "last"
    with pytest.raises(IndexError):
        source[4]
    clone = pickle.loads(pickle.dumps(source))  # grain workers receive the source pickled
    assert clone[1] == "two\nlines"


def test_jsonl_text_field_and_errors_name_file_and_line(tmp_path):
    path = write(tmp_path / "docs.jsonl", '{"body": "one"}\n\n{"body": "two"}\n{"body": 3}\n{not json}\n[1]\n')
    source = JsonlSource([str(path)], text_field="body")
    assert source[0] == "one" and source[1] == "two"
    with pytest.raises(ValueError, match=r"docs.jsonl line 4: field 'body' must be a string"):
        source[2]
    with pytest.raises(ValueError, match=r"docs.jsonl line 5: invalid JSON"):
        source[3]
    with pytest.raises(ValueError, match=r"docs.jsonl line 6: expected a JSON object"):
        source[4]
    with pytest.raises(ValueError, match=r"docs.jsonl line 1: no field 'text' \(fields: \['body'\]\)"):
        JsonlSource([str(path)])[0]


def test_parquet_reads_rows_across_row_groups_and_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    first = ["zero", UNICODE, None, "three", "four"]
    pq.write_table(pa.table({"id": list(range(5)), "content": first}), tmp_path / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"content": ["five"]}), tmp_path / "b.parquet")
    source = open_documents(DataConfig(source="parquet", paths=(str(tmp_path / "*.parquet"),), text_field="content"))
    assert len(source) == 6
    expected = ["zero", UNICODE, "", "three", "four", "five"]
    assert [source[i] for i in (5, 0, 3, 1, 4, 2)] == [expected[i] for i in (5, 0, 3, 1, 4, 2)]
    clone = pickle.loads(pickle.dumps(source))
    assert [clone[i] for i in range(6)] == expected

    with pytest.raises(ValueError, match=r"a.parquet: no column 'text' \(columns: \['id', 'content'\]\)"):
        open_documents(DataConfig(source="parquet", paths=(str(tmp_path / "a.parquet"),)))
    with pytest.raises(ValueError, match=r"column 'id' must hold strings"):
        open_documents(DataConfig(source="parquet", paths=(str(tmp_path / "a.parquet"),), text_field="id"))


def test_builtin_documents_are_files_within_the_budget():
    budget = 300_000
    documents = open_documents(DataConfig(builtin_bytes=budget))
    texts = [documents[i] for i in range(len(documents))]
    assert len(texts) > 3
    sizes = [len(text.encode("utf-8")) for text in texts]
    assert sum(sizes[:-1]) < budget <= sum(sizes) + 8  # the last file is cut at the budget (+ U+FFFD slack)
    assert texts == builtin_documents(budget)  # stable


@pytest.mark.parametrize("train_bytes", [150_000, 300_000])  # 150K: the cut file runs past 250K
def test_builtin_held_out_text_follows_the_training_text_without_overlap(train_bytes):
    train, held_out = builtin_documents(train_bytes), builtin_held_out(train_bytes, 100_000)
    assert held_out and sum(len(text.encode()) for text in held_out) == 100_000
    assert "".join(train) + "".join(held_out) == "".join(builtin_documents(train_bytes + 100_000))


def test_split_is_disjoint_covering_stable_and_nested():
    train, held_out = split_documents(10_000, 0.1)
    assert len(np.intersect1d(train, held_out)) == 0
    np.testing.assert_array_equal(np.union1d(train, held_out), np.arange(10_000))
    assert 0.08 < len(held_out) / 10_000 < 0.12
    # A document's side depends on its index alone: not on the corpus size ...
    np.testing.assert_array_equal(is_eval_document(500, 0.1), is_eval_document(10_000, 0.1)[:500])
    # ... and a larger fraction only adds held-out documents.
    assert set(held_out) < set(split_documents(10_000, 0.2)[1])
    assert len(split_documents(100, 0.0)[1]) == 0
    # The hash is splitmix64 (restated here with Python ints): it must never change between
    # versions, so that eval losses stay comparable across runs.
    assert split_documents(200, 0.1)[1].tolist() == [i for i in range(200) if splitmix64_fraction(i) < 0.1]


def splitmix64_fraction(index: int) -> float:
    mask = (1 << 64) - 1
    z = (index + 0x6469666A6178) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) / 2.0**53


def test_jsonl_segments_documents_and_their_errors(tmp_path):
    lines = [{"segments": [{"text": "Q: 2+2?", "label": False}, {"text": " 4", "label": True}]},
             {"text": "plain", "segments": "ignored: the text field wins"},
             {"segments": [{"text": "x", "label": "yes"}]},
             {"segments": {"text": "x", "label": True}},
             {"segments": [{"text": "x", "label": True, "weight": 2}]}]
    path = write(tmp_path / "sft.jsonl", "\n".join(json.dumps(line) for line in lines) + "\n")
    source = JsonlSource([str(path)])
    assert source[0] == (("Q: 2+2?", False), (" 4", True))
    assert source[1] == "plain"
    with pytest.raises(ValueError, match=r"sft.jsonl line 3: segments\[0\] must be \{'text': str, 'label': bool\}"):
        source[2]
    with pytest.raises(ValueError, match=r"sft.jsonl line 4: field 'segments' must be a list"):
        source[3]
    with pytest.raises(ValueError, match=r"sft.jsonl line 5: segments\[0\] must be"):
        source[4]
