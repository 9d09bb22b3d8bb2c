"""Packed batches through the model and the loss: packing must change nothing a document sees."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.data.config import DataConfig
from diffjax.data import ListSource, make_train_dataset
from diffjax.losses import loss_sum_and_count, next_token_targets, packed_next_token_loss, packed_target_mask
from diffjax.model.transformer import TransformerLM
from diffjax.tokenizers import ByteTokenizer

SEQ_LEN = 64


class EosBytes(ByteTokenizer):
    eos_id = 0


def packed_rows(batch_size=4, num_batches=3):
    """The rows of the first few batches, stacked: the first pack holds the long documents' pieces,
    the later ones many short documents per row."""
    rng = np.random.default_rng(0)
    words = ["diff", "attention", "λ", "softmax", "noise", "日本", "packing", "token", "x"]
    # Two documents longer than SEQ_LEN (split into pieces), one of exactly SEQ_LEN - 1 bytes + eos,
    # then short ones; in order (no shuffle), so the first batch holds all kinds.
    texts = ["a" * 100 + " tail", "b" * (SEQ_LEN - 1), "c" * 150]
    texts += [" ".join(rng.choice(words, size=rng.integers(1, 8))) for _ in range(30)]
    ds = make_train_dataset(
        DataConfig(seq_len=SEQ_LEN, eval_fraction=0.0, shuffle=False), EosBytes(), batch_size=batch_size, seed=3,
        shard_index=0, shard_count=1, source=ListSource(texts),
    )
    it = iter(ds)
    batches = [next(it) for _ in range(num_batches)]
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


@pytest.mark.parametrize("attention", [pytest.param("diff", marks=pytest.mark.slow), "standard"])
def test_each_packed_document_gets_the_logits_it_gets_alone(attention, measured):
    config = ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=2 if attention == "diff" else 4, max_seq_len=64, attention=attention)
    graphdef, params = nnx.split(TransformerLM(config, rngs=nnx.Rngs(0)))
    run = jax.jit(lambda *args: nnx.merge(graphdef, params)(*args))
    batch = packed_rows()
    tokens, segment_ids, positions = (batch[k] for k in ("tokens", "segment_ids", "positions"))
    logits_BTV = np.asarray(run(tokens, positions, segment_ids))
    assert np.isfinite(logits_BTV).all()  # padding included

    # Every document (or piece of a long one) alone in its own row: at the start, positions
    # 0, 1, ..., no segment ids, zeros after it (causal attention never looks ahead, so the tail
    # cannot reach the document).
    where = [
        (row, np.flatnonzero(segment_ids[row] == segment))
        for row in range(len(tokens))
        for segment in range(1, segment_ids[row].max() + 1)
    ]
    alone_NT = np.zeros((len(where), SEQ_LEN), np.int32)
    for n, (row, columns) in enumerate(where):
        alone_NT[n, : len(columns)] = tokens[row, columns]
    alone_NTV = np.asarray(run(alone_NT))
    assert len(where) > len(tokens) and segment_ids.max() >= 3, "the rows really pack several documents"
    worst = max(np.max(np.abs(logits_BTV[row, columns] - alone_NTV[n, : len(columns)])) for n, (row, columns) in enumerate(where))
    measured(f"packed vs alone logits ({len(where)} documents)", worst, 1e-5)
    assert worst < 1e-5
    # The comparison can fail: without segment ids, later documents in a row see earlier ones.
    leaky_BTV = np.asarray(run(tokens, positions))
    assert max(np.max(np.abs(leaky_BTV[row, columns] - alone_NTV[n, : len(columns)])) for n, (row, columns) in enumerate(where)) > 1e-3

    # The packed loss is the target-weighted mean of the documents' own losses.
    total_loss, total_count = 0.0, 0
    for n, (row, columns) in enumerate(where):
        logits_TV, targets_T = alone_NTV[n, : len(columns) - 1].astype(np.float64), alone_NT[n, 1 : len(columns)]
        log_z_T = np.log(np.exp(logits_TV - logits_TV.max(-1, keepdims=True)).sum(-1)) + logits_TV.max(-1)
        total_loss += float(np.sum(log_z_T - logits_TV[np.arange(len(targets_T)), targets_T]))
        total_count += len(targets_T)
    loss, count = packed_next_token_loss(logits_BTV, tokens, segment_ids)
    assert float(count) == total_count
    relative = abs(float(loss) - total_loss / total_count) / (total_loss / total_count)
    measured("packed loss vs per-document losses (relative)", relative, 1e-5)
    assert relative < 1e-5  # float32 sums over ~600 targets


def numpy_packed_loss(logits_BTV, tokens_BT, segment_ids_BT, loss_mask_BT=None):
    total, count = 0.0, 0
    B, T, _ = logits_BTV.shape
    for b in range(B):
        for t in range(T - 1):
            counted = loss_mask_BT is None or loss_mask_BT[b, t + 1] == 1  # the target token is labelled
            if segment_ids_BT[b, t] == segment_ids_BT[b, t + 1] != 0 and counted:
                row = logits_BTV[b, t].astype(np.float64)
                log_z = np.log(np.sum(np.exp(row - row.max()))) + row.max()
                total += log_z - row[tokens_BT[b, t + 1]]
                count += 1
    return total / max(count, 1), count


def test_packed_loss_matches_a_numpy_loop(measured):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 10, 7)).astype(np.float32) * 3
    tokens = rng.integers(0, 7, size=(3, 10)).astype(np.int32)
    segment_ids = np.array(
        [[1, 1, 1, 2, 2, 3, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 0, 0, 0, 0, 0, 0]], np.int32
    )
    expected, expected_count = numpy_packed_loss(logits, tokens, segment_ids)
    loss, count = jax.jit(packed_next_token_loss)(logits, tokens, segment_ids)
    assert int(count) == expected_count == 5 + 9 + 0
    measured("packed loss vs numpy loop", abs(float(loss) - expected), 1e-6)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    assert packed_target_mask(segment_ids).shape == (3, 9)

    # No targets at all (an all-padding eval batch): loss 0, count 0.
    zero_loss, zero_count = packed_next_token_loss(logits, tokens, np.zeros_like(segment_ids))
    assert float(zero_loss) == 0.0 and float(zero_count) == 0.0


def test_the_loss_mask_counts_only_labelled_targets(measured):
    """The batch's loss_mask (segments documents) as the train step states it, against the numpy loop."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 10, 7)).astype(np.float32) * 3
    tokens = rng.integers(0, 7, size=(2, 10)).astype(np.int32)
    segment_ids = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    loss_mask = np.array([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 0, 1, 1, 0, 0, 1]], np.int32)
    expected, expected_count = numpy_packed_loss(logits, tokens, segment_ids, loss_mask)
    loss_sum, count = jax.jit(lambda *a: loss_sum_and_count(a[0], *next_token_targets(*a[1:])))(
        logits, tokens, segment_ids, loss_mask)
    assert int(count) == expected_count == 4 + 4  # row 0: targets 2, 3, 6, 7 (4 starts a document)
    measured("masked loss vs numpy loop", abs(float(loss_sum) / float(count) - expected), 1e-6)
    np.testing.assert_allclose(float(loss_sum) / float(count), expected, rtol=1e-6)
