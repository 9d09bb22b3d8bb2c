"""The XLA reference ops against a float64 numpy loop over heads (every interface option)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from diffjax.ops import diff_attention, dot_product_attention


def softmax_attention_np(q_Td, k_Sd, v_Sv, allowed_TS, scale):
    scores = np.where(allowed_TS, q_Td @ k_Sd.T * scale, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v_Sv


def allowed_np(T, S, causal, q_seg_T=None, kv_seg_S=None):
    allowed = np.ones((T, S), bool)
    if causal:
        allowed = (np.arange(T)[:, None] + S - T) >= np.arange(S)[None]
    if q_seg_T is not None:
        allowed &= q_seg_T[:, None] == kv_seg_S[None]
    return allowed


def diff_attention_np(q, k, v, lam, causal, segments):
    B, T, H, _, d = q.shape
    S, K, G = k.shape[1], k.shape[2], k.shape[3]
    lam = np.broadcast_to(np.asarray(lam, np.float64), (B, T, H))
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        allowed = allowed_np(T, S, causal, *((segments[0][b], segments[1][b]) if segments else ()))
        for h in range(H):
            m = h // (H // K)
            a1 = softmax_attention_np(q[b, :, h, 0], k[b, :, m, 0], v[b, :, m], allowed, d**-0.5)
            a2 = softmax_attention_np(q[b, :, h, 1], k[b, :, m, G - 1], v[b, :, m], allowed, d**-0.5)
            out[b, :, h] = a1 - lam[b, :, h, None] * a2
    return out


@pytest.mark.parametrize("H, K, G", [(4, 4, 2), (4, 2, 2), (4, 1, 1)])
@pytest.mark.parametrize("per_token_lambda", [False, True])
def test_diff_attention(H, K, G, per_token_lambda):
    rng = np.random.default_rng(0)
    B, T, d, dv = 2, 11, 8, 16
    q = rng.normal(size=(B, T, H, 2, d))
    k = rng.normal(size=(B, T, K, G, d))
    v = rng.normal(size=(B, T, K, dv))
    lam = rng.uniform(0.1, 0.9, size=(B, T, H)) if per_token_lambda else 0.37
    segments = np.array([[0] * 4 + [1] * 7, [0] * 11])
    got = diff_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), lam, segment_ids=jnp.asarray(segments))
    expected = diff_attention_np(q, k, v, lam, True, (segments, segments))
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5)


def test_diff_attention_shorter_queries_are_bottom_right_aligned():
    """T < S (queries after a prefix of keys): query t sits at position S - T + t."""
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(1, 3, 2, 2, 8)), rng.normal(size=(1, 9, 2, 2, 8)), rng.normal(size=(1, 9, 2, 16))
    got = diff_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), 0.5)
    np.testing.assert_allclose(np.asarray(got), diff_attention_np(q, k, v, 0.5, True, None), atol=2e-5)
    got = diff_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), 0.5, causal=False)
    np.testing.assert_allclose(np.asarray(got), diff_attention_np(q, k, v, 0.5, False, None), atol=2e-5)


def test_dot_product_attention_gqa():
    rng = np.random.default_rng(2)
    B, T, N, K, d = 2, 7, 6, 2, 8
    q, k, v = rng.normal(size=(B, T, N, d)), rng.normal(size=(B, T, K, d)), rng.normal(size=(B, T, K, d))
    got = np.asarray(dot_product_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v))))
    for b in range(B):
        for n in range(N):
            expected = softmax_attention_np(q[b, :, n], k[b, :, n // 3], v[b, :, n // 3], allowed_np(T, T, True), d**-0.5)
            np.testing.assert_allclose(got[b, :, n], expected, atol=2e-5)


def test_bad_shapes_and_impl():
    q, k, v = jnp.zeros((1, 4, 3, 2, 8)), jnp.zeros((1, 4, 2, 2, 8)), jnp.zeros((1, 4, 2, 16))
    with pytest.raises(ValueError, match="query heads \\(3\\) must be a multiple of kv heads \\(2\\)"):
        diff_attention(q, k, v, 0.5)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        diff_attention(q, k, v, 0.5, impl="pallas")
    with pytest.raises(ValueError, match="segment_ids shapes"):
        dot_product_attention(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)),
                              segment_ids=jnp.zeros((1, 5), jnp.int32))
