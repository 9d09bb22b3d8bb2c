"""XLA reference attention: the correctness oracle every faster path is tested against.

Numerics follow flash kernels (and unilm's recommended module): scores accumulate in float32 and
are scaled in float32, softmax runs in float32, P is rounded to the value dtype for the P V matmul
(float32 accumulation), and the output is cast back to the value dtype. A fully masked query row
(no key allowed) yields zeros, not NaN and not a uniform average.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_MASKED = jnp.finfo(jnp.float32).min  # finite, so no inf - inf; fully masked rows are zeroed below


def check_window(window, causal: bool):
    """A sliding window is a positive int (keys per query, the query's own included) and needs causal attention."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be None (no window) or a positive integer (keys each query sees, itself "
                         f"included), got {window!r}")
    if not causal:
        raise ValueError(f"window={window} needs causal attention (a sliding window bounds the keys behind a query)")


def attention_mask(T: int, S: int, *, causal: bool, segment_ids=None, window: int | None = None):
    """Boolean mask [B or 1, T, S]; True where query t may attend key s.

    Causal alignment is bottom-right: query t sits at position S - T + t.
    segment_ids: None, an int array [B, T] (self-attention, T == S), or a pair (q [B, T], kv [B, S]); the kv ids may
    also be [B, T, S], one row per query (a multi-token decode step over a KV cache: diffjax.model.kv_cache).
    window: None, or W: query t sees only the W keys at positions S - T + t - W + 1 .. S - T + t (a sliding
    window, flash-attn's window_size=(W - 1, 0); causal only).
    """
    check_window(window, causal)
    mask_TS = jnp.ones((T, S), dtype=bool)
    if causal:
        q_pos = jnp.arange(T)[:, None] + (S - T)
        mask_TS = q_pos >= jnp.arange(S)[None, :]
        if window is not None:
            mask_TS = mask_TS & (q_pos - jnp.arange(S)[None, :] < window)
    mask_BTS = mask_TS[None]
    if segment_ids is not None:
        q_seg_BT, kv_seg_BS = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        if q_seg_BT.shape[-1] != T or kv_seg_BS.shape[-1] != S:
            raise ValueError(
                f"segment_ids shapes {q_seg_BT.shape} / {kv_seg_BS.shape} do not match query length {T} "
                f"and key length {S}"
            )
        kv_seg_BTS = kv_seg_BS if kv_seg_BS.ndim == 3 else kv_seg_BS[:, None, :]
        mask_BTS = mask_BTS & (q_seg_BT[:, :, None] == kv_seg_BTS)
    return mask_BTS


def split_segment_ids(segment_ids, B: int, T: int, S: int):
    """(q ids [B, T], kv ids [B, S]) from a [B, T] array (self-attention) or a pair, checked."""
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
    if q_ids.shape != (B, T) or kv_ids.shape != (B, S):
        raise ValueError(f"segment_ids shapes {q_ids.shape} / {kv_ids.shape} do not match (B, T) = {(B, T)} and (B, S) = {(B, S)}")
    return q_ids, kv_ids


def _grouped_softmax_attention(q_BTKRMd, k_BSKMd, v_BSKv, mask_BTS, scale):
    """Softmax attention for M maps at once, with GQA groups explicit.

    q_BTKRMd: queries of kv head K, repeat R, map M.  k_BSKMd: keys per kv head and map (M may be
    1 and broadcast).  Returns o_BTKRMv in v's dtype.
    """
    B, T, K, R, M, d = q_BTKRMd.shape
    S = k_BSKMd.shape[1]
    # Both products as batched matmuls in XLA's canonical order (batch axes, the query rows, the keys' free axis),
    # queries on the left: a decode step then reads the KV cache's buffers as stored (kv_cache.py), without a copy.
    # Keys shared by the maps (M = 1 in k) take every map's queries as rows of one product.
    maps_in_k = k_BSKMd.shape[3]
    q_BKMNd = jnp.transpose(q_BTKRMd, (0, 2, 4, 1, 3, 5)).reshape(B, K, maps_in_k, -1, d)
    s_BKMNS = jax.lax.dot_general(q_BKMNd, k_BSKMd, (((4,), (4,)), ((0, 1, 2), (0, 2, 3))),
                                  preferred_element_type=jnp.float32)
    s_BKMTRS = s_BKMNS.reshape(B, K, M, T, R, S) * jnp.float32(scale)
    s_BKMTRS = jnp.where(mask_BTS[:, None, None, :, None], s_BKMTRS, _MASKED)
    p_BKMTRS = jax.nn.softmax(s_BKMTRS, axis=-1)
    # A query that may attend no key (a segment absent from the keys, or T > S under causal) gets
    # o = 0 and zero gradients, as in flash kernels, instead of a uniform average of V.
    any_allowed_BT1 = jnp.any(mask_BTS, axis=-1, keepdims=True)
    p_BKMTRS = jnp.where(any_allowed_BT1[:, None, None, :, None], p_BKMTRS, 0.0).astype(v_BSKv.dtype)
    o_BKNv = jax.lax.dot_general(p_BKMTRS.reshape(B, K, M * T * R, S), v_BSKv, (((3,), (1,)), ((0, 1), (0, 2))),
                                 preferred_element_type=jnp.float32)
    o_BTKRMv = jnp.transpose(o_BKNv.reshape(B, K, M, T, R, -1), (0, 3, 1, 4, 2, 5))
    return o_BTKRMv.astype(v_BSKv.dtype)


def _check_heads(name: str, H: int, K: int):
    if H % K:
        raise ValueError(f"{name}: query heads ({H}) must be a multiple of kv heads ({K})")


def diff_attention_xla(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, window=None):
    """(softmax(q1 k1^T s) - lam softmax(q2 k2^T s)) v for every differential head.

    q_BTH2d: [B, T, H, 2, d]; k_BSKGd: [B, S, Hkv, G, d] with G = 2 (k1, k2) or 1 (shared keys);
    v_BSKv: [B, S, Hkv, dv]; lam: scalar or [B, T, H]. Query head h uses kv head h // (H / Hkv)
    for both maps. Returns o_BTHv in v's dtype; `A1 - lam A2` is computed in that dtype.
    """
    B, T, H, two, d = q_BTH2d.shape
    _, S, K, G, _ = k_BSKGd.shape
    if two != 2 or G not in (1, 2):
        raise ValueError(f"diff_attention: q must be [B, T, H, 2, d] and k [B, S, Hkv, 1 or 2, d], got {q_BTH2d.shape} and {k_BSKGd.shape}")
    _check_heads("diff_attention", H, K)
    scale = d**-0.5 if scale is None else scale
    q_BTKRMd = q_BTH2d.reshape(B, T, K, H // K, 2, d)
    mask_BTS = attention_mask(T, S, causal=causal, segment_ids=segment_ids, window=window)
    o_BTKRMv = _grouped_softmax_attention(q_BTKRMd, k_BSKGd, v_BSKv, mask_BTS, scale)
    o_BTHMv = o_BTKRMv.reshape(B, T, H, 2, v_BSKv.shape[-1])
    lam_BTH1 = jnp.asarray(lam, dtype=v_BSKv.dtype)
    if lam_BTH1.ndim:
        lam_BTH1 = lam_BTH1[..., None]
    return o_BTHMv[..., 0, :] - lam_BTH1 * o_BTHMv[..., 1, :]


def dot_product_attention_xla(q_BTNd, k_BSKd, v_BSKv, *, causal=True, segment_ids=None, scale=None, window=None):
    """Standard softmax attention with GQA (query head n uses kv head n // (N / K))."""
    B, T, N, d = q_BTNd.shape
    _, S, K, _ = k_BSKd.shape
    _check_heads("dot_product_attention", N, K)
    scale = d**-0.5 if scale is None else scale
    q_BTKRMd = q_BTNd.reshape(B, T, K, N // K, 1, d)
    mask_BTS = attention_mask(T, S, causal=causal, segment_ids=segment_ids, window=window)
    o_BTKRMv = _grouped_softmax_attention(q_BTKRMd, k_BSKd[:, :, :, None], v_BSKv, mask_BTS, scale)
    return o_BTKRMv.reshape(B, T, N, v_BSKv.shape[-1])
