"""Attention operators behind one interface, selected by `impl`.

Only the XLA reference exists so far; the kernel issue adds compositions of existing flash
kernels and fused Pallas kernels behind the same signatures.
"""

from __future__ import annotations

from diffjax.ops.reference import attention_mask, diff_attention_xla, dot_product_attention_xla

IMPLS = ("auto", "xla")


def _resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    return "xla"


def diff_attention(q, k, v, lam, *, causal=True, segment_ids=None, scale=None, impl="auto"):
    """o[B, T, H, dv] = softmax(q1 k1^T scale) v - lam softmax(q2 k2^T scale) v.

    q: [B, T, H, 2, d]; k: [B, S, Hkv, G, d] (G = 2, or 1 when both maps share keys);
    v: [B, S, Hkv, dv]; lam: scalar or [B, T, H]; scale defaults to d ** -0.5.
    """
    _resolve(impl)
    return diff_attention_xla(q, k, v, lam, causal=causal, segment_ids=segment_ids, scale=scale)


def dot_product_attention(q, k, v, *, causal=True, segment_ids=None, scale=None, impl="auto"):
    """o[B, T, N, dv] = softmax(q k^T scale) v with q: [B, T, N, d], k: [B, S, K, d], v: [B, S, K, dv]."""
    _resolve(impl)
    return dot_product_attention_xla(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale)


__all__ = ["IMPLS", "attention_mask", "diff_attention", "dot_product_attention"]
