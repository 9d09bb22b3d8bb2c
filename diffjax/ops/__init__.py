"""Attention operators behind one interface, selected by `impl`.

impl:
  "xla"         the reference (einsum + fp32 softmax), every platform; materialises T x S scores.
  "pallas_tpu"  our fused flash kernels (diffjax.ops.pallas_tpu): one pass over K/V for both maps,
                custom-VJP backward. Compiled by Mosaic on TPU; Pallas interpret mode elsewhere
                (correct but slow: for tests).
  "splash"      composition of JAX's splash attention (TPU; interpret mode elsewhere): one call per map.
  "cudnn"       composition of jax.nn.dot_product_attention(implementation="cudnn") (GPU): V split
                into d-wide pieces, both maps folded into the head axis.
  "auto"        TPU -> "pallas_tpu" (T >= 128), GPU -> "cudnn" when the call is supported, else
                "xla"; the choice and its reason are logged once per (op, platform, choice, reason).
"""

from __future__ import annotations

import logging

import jax

from diffjax.config import ATTENTION_IMPLS
from diffjax.ops import compositions
from diffjax.ops.reference import attention_mask, diff_attention_xla, dot_product_attention_xla

IMPLS = ATTENTION_IMPLS

logger = logging.getLogger(__name__)
_LOGGED: set[tuple] = set()


def _log_once(level, key, message):
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, message)


def _platform() -> str:
    return jax.default_backend()


def _resolve(op: str, impl: str, q, k, v, causal, segment_ids) -> str:
    """The impl to run, or a ValueError naming the impl, the platform/shape and what is allowed."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: attention impl must be one of {IMPLS}, got {impl!r}")
    platform = _platform()
    T = q.shape[1]
    if impl == "auto":
        if platform == "tpu" and T >= 128:
            choice, reason = "pallas_tpu", "fused Pallas TPU kernel"
        elif platform == "tpu":
            choice, reason = "xla", f"T={T} < 128 is below one kernel block"
        elif platform == "gpu":
            why_not = compositions.cudnn_unsupported(q, k, v, causal, segment_ids, platform)
            choice, reason = ("cudnn", "cuDNN flash composition") if why_not is None else ("xla", f"cudnn {why_not}")
        else:
            choice, reason = "xla", f"platform {platform!r} has no compiled flash kernel (pallas_tpu would run interpreted)"
        level = logging.WARNING if (platform in ("tpu", "gpu") and choice == "xla") else logging.INFO
        _log_once(level, (op, platform, choice, reason), f"{op}: impl='auto' on {platform} chose {choice!r} ({reason})")
        return choice
    if impl == "cudnn":
        why_not = compositions.cudnn_unsupported(q, k, v, causal, segment_ids, platform)
        if why_not:
            raise ValueError(
                f"{op}: impl='cudnn' {why_not}; shapes q {q.shape}, k {k.shape}, v {v.shape}, dtype {q.dtype}. "
                f"Use impl='xla' (any platform) or 'pallas_tpu'."
            )
    if impl == "splash":
        why_not = compositions.splash_unsupported(q, k, v, causal, segment_ids, platform, interpret=True)
        if why_not:
            raise ValueError(f"{op}: impl='splash' {why_not}; shapes q {q.shape}, k {k.shape}. Use impl='pallas_tpu' or 'xla'.")
        if platform != "tpu":
            _log_once(logging.WARNING, (op, platform, "splash"), f"{op}: impl='splash' on {platform} runs in Pallas interpret mode (slow)")
    if impl == "pallas_tpu" and platform != "tpu":
        _log_once(logging.INFO, (op, platform, "pallas_tpu"), f"{op}: impl='pallas_tpu' on {platform} runs in Pallas interpret mode (slow)")
    return impl


def diff_attention(q, k, v, lam, *, causal=True, segment_ids=None, scale=None, impl="auto", block_sizes=None):
    """o[B, T, H, dv] = softmax(q1 k1^T scale) v - lam softmax(q2 k2^T scale) v.

    q: [B, T, H, 2, d]; k: [B, S, Hkv, G, d] (G = 2, or 1 when both maps share keys);
    v: [B, S, Hkv, dv]; lam: scalar or [B, T, H]; scale defaults to d ** -0.5.
    segment_ids: None, [B, T] (T == S) or a pair (q ids [B, T], kv ids [B, S]).
    block_sizes: (block_q, block_k) for impl="pallas_tpu" (default 128, 128).
    """
    choice = _resolve("diff_attention", impl, q, k, v, causal, segment_ids)
    kwargs = dict(causal=causal, segment_ids=segment_ids, scale=scale)
    if choice == "pallas_tpu":
        from diffjax.ops.pallas_tpu import diff_attention_pallas

        return diff_attention_pallas(q, k, v, lam, block_sizes=block_sizes, **kwargs)
    if choice == "cudnn":
        return compositions.diff_attention_cudnn(q, k, v, lam, **kwargs)
    if choice == "splash":
        return compositions.diff_attention_splash(q, k, v, lam, interpret=_platform() != "tpu", **kwargs)
    return diff_attention_xla(q, k, v, lam, **kwargs)


def dot_product_attention(q, k, v, *, causal=True, segment_ids=None, scale=None, impl="auto", block_sizes=None):
    """o[B, T, N, dv] = softmax(q k^T scale) v with q: [B, T, N, d], k: [B, S, K, d], v: [B, S, K, dv].

    The baseline Transformer's op; every impl name works ("pallas_tpu" runs the single-map mode of
    the fused kernel, "cudnn" calls jax.nn.dot_product_attention directly).
    """
    choice = _resolve("dot_product_attention", impl, q, k, v, causal, segment_ids)
    kwargs = dict(causal=causal, segment_ids=segment_ids, scale=scale)
    if choice == "pallas_tpu":
        from diffjax.ops.pallas_tpu import dot_product_attention_pallas

        return dot_product_attention_pallas(q, k, v, block_sizes=block_sizes, **kwargs)
    if choice == "cudnn":
        return compositions.dot_product_attention_cudnn(q, k, v, **kwargs)
    if choice == "splash":
        return compositions.dot_product_attention_splash(q, k, v, interpret=_platform() != "tpu", **kwargs)
    return dot_product_attention_xla(q, k, v, **kwargs)


__all__ = ["IMPLS", "attention_mask", "diff_attention", "dot_product_attention"]
