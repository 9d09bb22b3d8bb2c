"""grain pipelines: packing invariants, deterministic order, process sharding, checkpointable state.

Documents here are "<id> <length>" and IdTokenizer turns one into the ids id * 10_000 + [0, length),
so every token names its document and its place in it.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from diffjax.data.config import DataConfig
from diffjax.data import BATCH_KEYS, ListSource, make_eval_batches, make_train_dataset, pack_documents
from diffjax.tokenizers import ByteTokenizer

SEQ_LEN = 16
STRIDE = 10_000


class IdTokenizer:
    vocab_size = 100 * STRIDE
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        doc_id, length = map(int, text.split())
        return (doc_id * STRIDE + np.arange(length)).astype(np.int32)


def id_source(lengths) -> ListSource:
    return ListSource([f"{doc_id} {length}" for doc_id, length in enumerate(lengths)])


LENGTHS = [5, 16, 40, 1, 9, 0, 23, 12, 3, 17, 8, 31, 2, 14, 6, 11, 7, 20, 4, 10]  # some longer than SEQ_LEN, one empty


def config(**overrides) -> DataConfig:
    """Packed rows shuffled within windows of 8 rows (the default window of 2^20 tokens would pack tens of
    thousands of rows of these tiny documents before the first batch)."""
    return DataConfig(**{"seq_len": SEQ_LEN, "eval_fraction": 0.0, "shuffle_window_tokens": 8 * SEQ_LEN, **overrides})


def train_batches(count, *, batch_size=4, seed=0, source=None, tokenizer=None, **config_overrides):
    ds = make_train_dataset(
        config(**config_overrides), tokenizer or IdTokenizer(), batch_size=batch_size, seed=seed,
        shard_index=0, shard_count=1, source=source or id_source(LENGTHS),
    )
    it = iter(ds)
    return [next(it) for _ in range(count)]


def segments(row_tokens, row_segment_ids):
    """The token arrays of a row's segments, in order."""
    return [row_tokens[row_segment_ids == s] for s in range(1, int(row_segment_ids.max(initial=0)) + 1)]


def check_row(tokens, segment_ids, positions):
    """Layout invariants of one packed row; returns its segments."""
    used = int(np.count_nonzero(segment_ids))
    assert (segment_ids[used:] == 0).all() and (segment_ids[:used] > 0).all(), "padding only at the end"
    assert (tokens[used:] == 0).all() and (positions[used:] == 0).all()
    ids = segment_ids[:used]
    assert ids[0] == 1 and set(np.diff(ids)) <= {0, 1}, "segment ids count 1, 2, ... along the row"
    pieces = segments(tokens, segment_ids)
    for s, piece in enumerate(pieces, start=1):
        np.testing.assert_array_equal(positions[segment_ids == s], np.arange(len(piece)))
        doc_id, offset = divmod(int(piece[0]), STRIDE)
        # One segment = consecutive tokens of one document, starting at a multiple of seq_len.
        np.testing.assert_array_equal(piece, doc_id * STRIDE + offset + np.arange(len(piece)))
        assert offset % SEQ_LEN == 0
        assert len(piece) == SEQ_LEN or offset + len(piece) == LENGTHS[doc_id], "only a document's last piece is short"
    return pieces


def test_packing_covers_every_token_exactly_once():
    rows = list(pack_documents(id_source(LENGTHS), range(len(LENGTHS)), IdTokenizer(), config(), num_bins=3))
    counts = Counter()
    for row in rows:
        assert {k: (v.shape, v.dtype) for k, v in row.items()} == {k: ((SEQ_LEN,), np.int32) for k in BATCH_KEYS}
        for piece in check_row(row["tokens"], row["segment_ids"], row["positions"]):
            counts.update(piece.tolist())
    expected = Counter(d * STRIDE + i for d, n in enumerate(LENGTHS) for i in range(n))
    assert counts == expected
    assert len(rows) * SEQ_LEN < 1.3 * sum(LENGTHS), "first-fit packing keeps padding low"


def test_train_batches_have_the_format_and_layout():
    for batch in train_batches(10, batch_size=3):
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: ((3, SEQ_LEN), np.int32) for k in BATCH_KEYS}
        for row in range(3):
            check_row(batch["tokens"][row], batch["segment_ids"][row], batch["positions"][row])


def test_eos_is_appended_when_the_tokenizer_has_one():
    class EosBytes(ByteTokenizer):
        eos_id = 0

    source = ListSource(["abc", "de"])
    for append_eos, expected in [(True, [[97, 98, 99, 0], [100, 101, 0]]), (False, [[97, 98, 99], [100, 101]])]:
        (row,) = pack_documents(source, [0, 1], EosBytes(), config(append_eos=append_eos), num_bins=1)
        assert [piece.tolist() for piece in segments(row["tokens"], row["segment_ids"])] == expected


ONE_ROW_WINDOW = 1  # data.shuffle_window_tokens: no row shuffle


def one_document_per_row(num_documents=12):
    """Documents of exactly seq_len tokens (with ONE_ROW_WINDOW): one row = one document, so the row
    stream shows the document order directly."""
    return id_source([SEQ_LEN] * num_documents)


def document_order(batches):
    return [int(t) // STRIDE for batch in batches for t in batch["tokens"][:, 0]]


def test_order_is_deterministic_per_seed_and_reshuffled_every_epoch():
    source, window = one_document_per_row(), {"shuffle_window_tokens": ONE_ROW_WINDOW}
    order = document_order(train_batches(9, batch_size=4, source=source, **window))  # 3 epochs of 12 documents
    epochs = [order[0:12], order[12:24], order[24:36]]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs), "each document once per epoch"
    assert epochs[0] != epochs[1] != epochs[2]
    assert order == document_order(train_batches(9, batch_size=4, source=source, **window)), "same seed, same order"
    assert order != document_order(train_batches(9, batch_size=4, seed=1, source=source, **window))
    assert document_order(train_batches(3, batch_size=4, source=source, shuffle=False)) == list(range(12))


def test_default_pipeline_is_deterministic_and_seed_dependent():
    first = train_batches(6)
    for a, b in zip(first, train_batches(6)):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key])
    other = train_batches(6, seed=7)
    assert any((a["tokens"] != b["tokens"]).any() for a, b in zip(first, other))


def test_process_shards_are_disjoint_and_cover_the_documents():
    source = one_document_per_row(num_documents=10)
    seen = []
    for shard in range(3):
        ds = make_train_dataset(config(shuffle_window_tokens=ONE_ROW_WINDOW), IdTokenizer(), batch_size=2, seed=0, shard_index=shard, shard_count=3, source=source)
        it = iter(ds)
        seen.append(set(document_order([next(it) for _ in range(4)])))
    assert seen == [{0, 3, 6, 9}, {1, 4, 7}, {2, 5, 8}]
    with pytest.raises(ValueError, match="shard_index"):
        make_train_dataset(config(), IdTokenizer(), batch_size=2, seed=0, shard_index=3, shard_count=3, source=source)
    with pytest.raises(ValueError, match="no training documents"):
        make_train_dataset(config(), IdTokenizer(), batch_size=2, seed=0, shard_index=11, shard_count=12, source=source)


@pytest.mark.parametrize("shuffle", [True, False])
def test_iterator_state_is_json_and_resumes_exactly_in_a_fresh_pipeline(shuffle):
    def fresh_iterator():
        ds = make_train_dataset(
            config(shuffle=shuffle), IdTokenizer(), batch_size=3, seed=5, shard_index=0, shard_count=1,
            source=id_source(LENGTHS),
        )
        return iter(ds)

    it = fresh_iterator()
    for _ in range(7):  # mid-epoch, mid-document (LENGTHS has documents of several pieces)
        next(it)
    saved = json.dumps(it.get_state())
    expected = [next(it) for _ in range(12)]  # crosses an epoch boundary

    restored = fresh_iterator()  # as after a process restart
    restored.set_state(json.loads(saved))
    again = [next(restored) for _ in range(12)]
    it.set_state(json.loads(saved))  # and rewinding the same iterator
    rewound = [next(it) for _ in range(12)]
    for a, b, c in zip(expected, again, rewound):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key])
            np.testing.assert_array_equal(a[key], c[key])
    assert len(saved) < 1000


def test_eval_batches_hold_out_documents_stably(monkeypatch):
    lengths = [7 + (3 * i) % 20 for i in range(60)]
    source = id_source(lengths)
    cfg = config(eval_fraction=0.25, eval_batches=3)
    batches = make_eval_batches(cfg, IdTokenizer(), batch_size=2, shard_index=0, shard_count=1, source=source)
    assert 1 <= len(batches) <= 3
    assert all(b[k].shape == (2, SEQ_LEN) for b in batches for k in BATCH_KEYS)
    eval_docs = {int(t) // STRIDE for b in batches for t in b["tokens"][b["segment_ids"] > 0]}
    ds = make_train_dataset(cfg, IdTokenizer(), batch_size=2, seed=0, shard_index=0, shard_count=1, source=source)
    it = iter(ds)
    train_docs = {int(t) // STRIDE for _ in range(60) for b in [next(it)] for t in b["tokens"][b["segment_ids"] > 0]}
    assert eval_docs and not eval_docs & train_docs
    again = make_eval_batches(cfg, IdTokenizer(), batch_size=2, shard_index=0, shard_count=1, source=source)
    assert all((a[k] == b[k]).all() for a, b in zip(batches, again) for k in BATCH_KEYS)

    # Small eval split: fewer batches, the last one filled with padding rows.
    few = make_eval_batches(config(eval_fraction=0.25, eval_batches=100), IdTokenizer(), batch_size=2, shard_index=0, shard_count=1, source=source)
    assert 3 <= len(few) < 100
    assert make_eval_batches(config(eval_fraction=0.0), IdTokenizer(), batch_size=2, shard_index=0, shard_count=1, source=source) == []
    # Several processes: every process gets exactly eval_batches batches (padded with empty ones).
    per_process = [
        make_eval_batches(config(eval_fraction=0.25, eval_batches=100), IdTokenizer(), batch_size=2, shard_index=i, shard_count=2, source=source)
        for i in range(2)
    ]
    assert [len(b) for b in per_process] == [100, 100]
    assert not per_process[0][-1]["segment_ids"].any()


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="batch_size"):
        make_train_dataset(config(), IdTokenizer(), batch_size=0, seed=0, shard_index=0, shard_count=1, source=id_source([3]))
    with pytest.raises(ValueError, match="seed"):
        make_train_dataset(config(), IdTokenizer(), batch_size=1, seed=-1, shard_index=0, shard_count=1, source=id_source([3]))


@pytest.mark.slow
@pytest.mark.both_legs
def test_worker_processes_resume_exactly():
    """worker_count > 0: grain's multiprocess prefetch, whose state also restores exactly."""
    ds = make_train_dataset(
        config(worker_count=2), ByteTokenizer(), batch_size=2, seed=0, shard_index=0, shard_count=1,
        source=ListSource([f"document {i}: " + "text " * (i % 13) for i in range(40)]),
    )
    it = iter(ds)
    try:
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        expected = [next(it) for _ in range(3)]
        it.set_state(state)
        for a in expected:
            b = next(it)
            for key in BATCH_KEYS:
                np.testing.assert_array_equal(a[key], b[key])
    finally:
        it.close()


def test_segments_documents_count_only_their_labelled_tokens_through_packing():
    """Segments are tokenized apart (no merge across a boundary), the mask follows each token through the pieces
    and the packing, the eos takes the last segment's label, and a text document counts every token."""
    class EosBytes(ByteTokenizer):
        eos_id = 0

    documents = [(("ab", False), ("cd", True), ("e", False)), "fgh", (("ij", False), ("klmnopqrstu", True))]
    expected = [([97, 98, 99, 100, 101, 0], [0, 0, 1, 1, 0, 0]), ([102, 103, 104, 0], [1, 1, 1, 1]),
                ([105, 106] + list(range(107, 118)) + [0], [0, 0] + [1] * 11 + [1])]
    rows = list(pack_documents(ListSource(documents), range(3), EosBytes(), config(seq_len=8), num_bins=2))
    got = Counter()
    for row in rows:
        for s in range(1, int(row["segment_ids"].max()) + 1):
            where = row["segment_ids"] == s
            got[tuple(row["tokens"][where]), tuple(row["loss_mask"][where])] += 1
        assert (row["loss_mask"][row["segment_ids"] == 0] == 0).all(), "padding is never counted"
    # Documents longer than seq_len (8) arrive in pieces; cut the expectations the same way.
    want = Counter((tuple(t[i:i + 8]), tuple(m[i:i + 8])) for t, m in expected for i in range(0, len(t), 8))
    assert got == want
