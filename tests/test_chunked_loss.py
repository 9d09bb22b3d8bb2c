"""The chunked cross-entropy (diffjax.losses.chunked_packed_loss_sum_and_count) against the loss on the full
logits (packed_loss_sum_and_count, itself checked against a numpy loop in test_packing.py): loss and
gradients with respect to every parameter, tied and untied heads, packed rows and plain ones, and the
train.loss_chunk setting."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import ModelConfig
from diffjax.losses import chunked_packed_loss_sum_and_count, packed_loss_sum_and_count
from diffjax.model import TransformerLM
from diffjax.train.config import load_run_config
from diffjax.train.step import AUTO_LOSS_CHUNK_TOKENS, resolve_loss_chunk

B, T = 2, 12
D, V = 32, 97
CHUNK_TOKENS = 10  # 5 positions of each row per chunk: 3 chunks, the last one padded


def make_batch(packed: bool, vocab: int):
    tokens = np.random.default_rng(0).integers(0, vocab, (B, T)).astype(np.int32)
    if packed:  # documents of 4 and 5 tokens then padding; a row of 3 documents
        segment_ids = np.array([[1] * 4 + [2] * 5 + [0] * 3, [1] * 3 + [2] * 3 + [3] * 6], np.int32)
    else:
        segment_ids = np.ones((B, T), np.int32)
    positions = np.concatenate([np.arange(T)[None]] * B).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)


def random_params(config: ModelConfig):
    """(graphdef, params) with random values (no init compile: a model's random init takes seconds on CPU)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(1)
    return graphdef, jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), abstract)


def loss_fn(chunk_tokens: int, tied: bool, dtype=jnp.float32):
    """(hidden, head param, batch) -> (loss sum, count) as the train step computes it: the head param is
    [D, V] (lm_head) or [V, D] (tied embedding), cast to the compute dtype; chunk_tokens 0: full logits."""

    def loss(hidden, head_param, batch):
        tokens, _, segment_ids = batch
        head = head_param.astype(dtype).T if tied else head_param.astype(dtype)
        hidden = hidden.astype(dtype)
        if chunk_tokens:
            return chunked_packed_loss_sum_and_count(hidden, head, tokens, segment_ids, chunk_tokens)
        logits = jnp.einsum("btd,dv->btv", hidden, head, preferred_element_type=jnp.float32)
        return packed_loss_sum_and_count(logits, tokens, segment_ids)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def max_relative_error(got, expected) -> float:
    """max over leaves of max |got - expected| / max |expected| (each leaf on its own scale)."""
    worst = 0.0
    for (path, got_leaf), expected_leaf in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        scale = float(jnp.max(jnp.abs(expected_leaf)))
        assert scale > 0, f"the reference gradient of {jax.tree_util.keystr(path)} is zero: the test would not see it"
        worst = max(worst, float(jnp.max(jnp.abs(got_leaf.astype(jnp.float32) - expected_leaf))) / scale)
    return worst


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_chunked_loss_and_grads_equal_the_full_logits_loss(tied, packed, measured):
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((V, D) if tied else (D, V)) / np.sqrt(D), jnp.float32)
    batch = make_batch(packed, V)
    (total, count), grads = loss_fn(CHUNK_TOKENS, tied)(hidden, head, batch)
    (expected_total, expected_count), expected_grads = loss_fn(0, tied)(hidden, head, batch)
    assert count == expected_count == (16 if packed else B * (T - 1))
    measured("loss sum rel diff, fp32", abs(total - expected_total) / expected_total, 1e-6)
    np.testing.assert_allclose(total, expected_total, rtol=1e-6)
    error = measured("max rel grad diff (hidden, head), fp32", max_relative_error(grads, expected_grads), 1e-6)
    assert error < 1e-6


def test_chunked_loss_in_bf16_is_as_close_to_fp32_as_the_full_logits_loss(measured):
    """bf16 compute: the chunked gradients (dlogits in bf16 for the matmuls, the head's gradient summed over
    chunks in fp32 and rounded once) are as close to the fp32 ones as the full-logits bf16 gradients."""
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((D, V)) / np.sqrt(D), jnp.float32)
    batch = make_batch(True, V)
    _, reference = loss_fn(0, False)(hidden, head, batch)
    errors = {chunk: max_relative_error(loss_fn(chunk, False, jnp.bfloat16)(hidden, head, batch)[1], reference)
              for chunk in (0, CHUNK_TOKENS)}
    measured("bf16 full logits: max rel grad error vs fp32", errors[0])
    measured("bf16 chunked: max rel grad error vs fp32", errors[CHUNK_TOKENS], 1.5 * errors[0])
    assert errors[CHUNK_TOKENS] <= 1.5 * errors[0]


@pytest.mark.slow
def test_model_train_loss_with_chunks_equals_full_logits_in_every_param_gradient(measured):
    """Through the model (tied head: the embedding's gradient comes from the lookup and the head), as the
    train step calls it (hidden_states + head vs model(...) logits)."""
    graphdef, params = random_params(ModelConfig(vocab_size=V, d_model=D, num_layers=1, num_heads=2, tie_embeddings=True))
    tokens, positions, segment_ids = make_batch(True, V)

    def loss(params, chunk_tokens):
        model = nnx.merge(graphdef, params)
        if not chunk_tokens:
            return packed_loss_sum_and_count(model(tokens, positions, segment_ids), tokens, segment_ids)[0]
        hidden = model.hidden_states(tokens, positions, segment_ids).hidden_BTD
        return chunked_packed_loss_sum_and_count(hidden, model.head(hidden.dtype), tokens, segment_ids, chunk_tokens)[0]

    grads = {chunk: jax.jit(jax.grad(loss), static_argnums=1)(params, chunk) for chunk in (0, CHUNK_TOKENS)}
    # 1e-4: the lambda vectors' gradients are sums of many cancelling terms, ~1e-3 of the others, so fp32
    # summation order shows (1.5e-5 seen on jax 0.10.2, 5.2e-5 on 0.12), far below a chunking error (a token's terms lost or counted twice)
    error = measured("max rel grad diff per param, fp32", max_relative_error(grads[CHUNK_TOKENS], grads[0]), 1e-4)
    assert error < 1e-4


def test_chunked_loss_rejects_bad_chunks_and_shapes():
    hidden, head = jnp.zeros((B, T, 8)), jnp.zeros((8, 16))
    tokens = jnp.zeros((B, T), jnp.int32)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer, got 0"):
        chunked_packed_loss_sum_and_count(hidden, head, tokens, tokens, 0)
    with pytest.raises(ValueError, match=r"tokens \(2, 11\) and segment_ids \(2, 12\) must be \[B, T\]"):
        chunked_packed_loss_sum_and_count(hidden, head, tokens[:, 1:], tokens, 4)


def test_loss_chunk_setting_auto_off_and_bad_values():
    assert resolve_loss_chunk(None, 100_288) == AUTO_LOSS_CHUNK_TOKENS
    assert resolve_loss_chunk(None, 257) == 0
    assert resolve_loss_chunk(0, 100_288) == 0
    assert resolve_loss_chunk(512, 257) == 512
    assert load_run_config(None, ["train.loss_chunk=2048"]).train.loss_chunk == 2048
    with pytest.raises(ValueError, match="train.loss_chunk must be an integer >= 0, got -1"):
        load_run_config(None, ["train.loss_chunk=-1"])
