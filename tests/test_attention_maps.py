"""DiffAttention.attention_maps / StandardAttention.attention_maps (the notebooks' plots) against the op the
layer really calls: the layer's own q, k, v and lambda are captured on their way into the XLA op, and
(A1 - lambda A2) @ v (or A @ v) must equal what the op returned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import ops
from diffjax.config import ModelConfig
from diffjax.model import DiffAttention, StandardAttention
from diffjax.model.rope import inv_frequencies, rope_tables

# GQA (4 query heads over 2 kv heads), so the kv-head repeat is exercised.
CONFIG = ModelConfig(vocab_size=32, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16,
                     attention_impl="xla", lambda_std=0.3, init_std=0.3)


def _capture(monkeypatch, name):
    """Record the args and output of ops.<name> while the layer runs."""
    calls, original = [], getattr(ops, name)

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(ops, name, spy)
    return calls


def _inputs(config, segments: bool):
    B, T = 2, 12
    x = jax.random.normal(jax.random.key(1), (B, T, config.d_model), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    segment_ids = None
    if segments:  # two packed documents in row 0
        segment_ids = jnp.array([[1] * 5 + [2] * 7, [1] * 12], jnp.int32)
        positions = jnp.where(segment_ids == 2, positions - 5, positions).at[1].set(jnp.arange(T))
    return x, rope_tables(positions, inv_frequencies(config), jnp.float32), segment_ids


def _check_maps(maps, segment_ids):
    for a in maps:
        a = np.asarray(a)
        np.testing.assert_allclose(a.sum(-1), 1.0, rtol=1e-5)
        assert np.all(np.triu(a, k=1) == 0), "a query attends a later key"
        if segment_ids is not None:
            ids = np.asarray(segment_ids)
            crossing = ids[:, None, :, None] != ids[:, None, None, :]
            assert np.all(a[np.broadcast_to(crossing, a.shape)] == 0), "attention crosses documents"


@pytest.mark.parametrize("segments", [False, True])
def test_diff_maps_reproduce_the_op(monkeypatch, segments):
    layer = DiffAttention(CONFIG, depth=1, rngs=nnx.Rngs(0))
    x, rope, segment_ids = _inputs(CONFIG, segments)
    calls = _capture(monkeypatch, "diff_attention")
    layer(x, rope, segment_ids)
    (q, k, v, lam), kwargs, out = calls[0]
    assert kwargs["impl"] == "xla"
    a1, a2 = layer.attention_maps(x, rope, segment_ids)
    assert a1.shape == a2.shape == (2, CONFIG.num_heads, 12, 12)
    _check_maps((a1, a2), segment_ids)
    v_BSHv = jnp.repeat(v, CONFIG.num_heads // CONFIG.num_kv_heads, axis=2)
    expected = jnp.einsum("bhts,bshv->bthv", a1 - lam * a2, v_BSHv)
    np.testing.assert_allclose(expected, out, rtol=1e-5, atol=1e-5)
    # And the maps are not trivially equal: the difference is what the plots show.
    assert float(jnp.abs(a1 - a2).max()) > 1e-2


@pytest.mark.parametrize("segments", [False, True])
def test_standard_map_reproduces_the_op(monkeypatch, segments):
    config = CONFIG.replace(attention="standard", num_heads=8, num_kv_heads=4)
    layer = StandardAttention(config, rngs=nnx.Rngs(0))
    x, rope, segment_ids = _inputs(config, segments)
    calls = _capture(monkeypatch, "dot_product_attention")
    layer(x, rope, segment_ids)
    (q, k, v), _, out = calls[0]
    a = layer.attention_maps(x, rope, segment_ids)
    assert a.shape == (2, 8, 12, 12)
    _check_maps((a,), segment_ids)
    expected = jnp.einsum("bnts,bsnv->btnv", a, jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(expected, out, rtol=1e-5, atol=1e-5)
