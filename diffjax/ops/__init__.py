"""Attention operators behind one interface, selected by `impl`.

impl:
  "xla"         the reference (einsum + fp32 softmax), every platform; materialises T x S scores, except for
                self-attention from context_parallel.BLOCKWISE_FROM (8192) tokens on, or beyond 2048 under a sliding
                window, which runs blockwise (online softmax over key blocks, blocks outside the window skipped,
                flash-style backward: memory of one query piece x one key block).
  window=W (a sliding window: each query sees its W latest keys) runs on xla, pallas_tpu, splash and cudnn;
  pallas_gpu and triton refuse it, and "auto" passes over them.
  A mesh with a context axis (parallel.context > 1) splits the sequence: attention then all-gathers K/V over
  that axis; each device attends its two query chunks with the fused Pallas TPU kernels (impl "pallas_tpu", or
  "auto" on a TPU) or blockwise XLA attention (every other impl) (context_parallel.py).
  "pallas_tpu"  our fused flash kernels (diffjax.ops.pallas_tpu): one pass over K/V for both maps,
                custom-VJP backward. Compiled by Mosaic on TPU; Pallas interpret mode elsewhere
                (correct but slow: for tests).
  "pallas_gpu"  our fused Mosaic GPU kernels for Hopper (diffjax.ops.pallas_gpu); standard attention runs
                their single-map mode (dv == d, segment ids too). Mosaic GPU interpret mode off GPU (for tests).
  "splash"      composition of JAX's splash attention (TPU; interpret mode elsewhere): one call per map.
  "triton"      composition of JAX's Pallas Triton flash attention (any CUDA GPU; interpret mode elsewhere),
                which takes segment ids: packed batches' flash path on GPUs without the fused kernel.
  Under diffjax.sharding.activation_sharding (the train step on a mesh) the Pallas impls (triton too) run inside
  jax.shard_map over the batch and head axes; cudnn and xla are partitioned by the compiler.
  "cudnn"       composition of jax.nn.dot_product_attention(implementation="cudnn") (GPU): V split
                into d-wide pieces, both maps folded into the head axis.
  "auto"        TPU -> "pallas_tpu" (T >= 128). GPU -> "pallas_gpu" on Hopper for every shape it runs,
                with or without segment ids, except where cuDNN was measured faster on a call cuDNN
                takes (CUDNN_FASTER_ON_HOPPER); else "cudnn" when it takes the call (no segment ids);
                else "triton" (segment ids, any CUDA GPU); "xla" only when none of them runs; a decode
                step (one query against a KV cache) runs "xla". The choice is `diffjax.ops.choose`, a pure
                function of the shapes and the device (choice.py; `python -m diffjax.ops --config ...
                --device h100` prints it per attention call); it and its reason are logged once per (op,
                platform, choice, reason); "xla" on an accelerator is a warning.
Under a mesh with a context axis (context_parallel.py): "pallas_tpu" / "pallas_gpu", and "auto" on a TPU / on a
Hopper GPU where the Mosaic GPU kernels take the call, run the fused kernels per query chunk (the chunk's place
in the sequence as their query offset); every other impl attends blockwise in XLA.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from diffjax import sharding
from diffjax.ops import compositions, context_parallel
from diffjax.ops.choice import (CUDNN_FASTER_ON_HOPPER, DEVICES, IMPLS, AttentionCall, Device, choose, current_device,
                                pallas_gpu_unsupported)
from diffjax.ops.reference import attention_mask, check_window, diff_attention_xla, dot_product_attention_xla

def config_problems(impl: str, dtype: str) -> list[str]:
    """What is wrong with running `impl` at a model's compute dtype (ModelConfig checks this at
    construction, before anything is traced)."""
    if impl not in IMPLS:
        return [f"attention_impl must be one of {IMPLS}, got {impl!r}"]
    if impl == "pallas_gpu" and dtype not in ("bfloat16", "float16"):
        return [f"attention_impl 'pallas_gpu' (the fused Mosaic GPU kernels) needs dtype bfloat16 or float16, got "
                f"dtype {dtype!r} (use 'cudnn', 'triton', 'xla' or 'auto' otherwise)"]
    return []


logger = logging.getLogger(__name__)
_LOGGED: set[tuple] = set()


def _log_once(level, key, message):
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, message)


def _resolve(op: str, impl: str, q, k, v, causal, segment_ids, window) -> tuple[str, Device]:
    """(the impl to run, the device) by `choice.choose`, logging auto's choice once per (op, platform, choice,
    reason) ("xla" on an accelerator is a warning) and an explicit impl that runs interpreted."""
    device, call = current_device(), AttentionCall.of(op, q, k, v, causal, segment_ids, window)
    choice, reason = choose(call, impl, device)
    if impl == "auto":
        slow = device.platform in ("tpu", "gpu") and choice == "xla" and not call.is_decode
        level = logging.WARNING if slow else logging.INFO
        _log_once(level, (op, device.platform, choice, reason), f"{op}: impl='auto' on {device.platform} chose {choice!r} ({reason})")
    elif "interpret" in reason:
        level = logging.INFO if impl == "pallas_tpu" else logging.WARNING
        _log_once(level, (op, device.platform, impl), f"{op}: impl={impl!r} on {device.platform} {reason.removeprefix('asked for; ')}")
    return choice, device


def _partitioned(kernel, q, k, v, lam, segment_ids):
    """kernel(q, k, v, lam, segment_ids), under diffjax.sharding.activation_sharding run per device with
    jax.shard_map over the batch and head axes: XLA cannot partition a Pallas call itself."""
    mesh = sharding.active_mesh()
    if mesh is None:
        return kernel(q, k, v, lam, segment_ids)
    heads = ("batch", "length", "act_heads", None, None)[: q.ndim]
    kv_heads = ("batch", "length", "act_kv_heads", None, None)
    arrays = [(q, heads), (k, kv_heads[: k.ndim]), (v, kv_heads[: v.ndim])]
    if lam is not None:
        arrays.append((lam, () if jnp.ndim(lam) == 0 else ("batch", "length", "act_heads")))
    ids = () if segment_ids is None else (segment_ids if isinstance(segment_ids, tuple) else (segment_ids,))
    arrays += [(jnp.asarray(x), ("batch", "length")) for x in ids]
    n = 4 if lam is not None else 3

    def per_device(*local):
        local_ids = local[n:]
        local_segments = None if not local_ids else (local_ids if isinstance(segment_ids, tuple) else local_ids[0])
        return kernel(*local[:3], local[3] if lam is not None else None, local_segments)

    return sharding.shard_map_by_logical_axes(per_device, mesh, arrays, ("batch", "length", "act_heads", None))


def _runs_blockwise(q, k, choice, window) -> bool:
    """Whether attention runs blockwise (context_parallel.py): always over a context axis (choice None), and on the
    XLA path for self-attention from context_parallel.BLOCKWISE_FROM tokens on, or under a sliding window beyond 4
    key blocks (blocks outside the window are skipped: cost T x window; at 4 blocks, 2048 tokens with a window of
    512, one T x T pass was still faster on CPU: benchmarks/sliding_window.py)."""
    if choice is None:
        return True
    T = q.shape[1]
    windowed = window is not None and T > 4 * context_parallel.DEFAULT_BLOCK
    long_enough = T >= context_parallel.BLOCKWISE_FROM or windowed
    return choice == "xla" and T == k.shape[1] and long_enough


def _blockwise(q_BTKRMd, k_BSKGd, v_BSKv, causal, segment_ids, scale, window):
    """Per-map outputs [B, T, K, R, M, dv]: over the active mesh's context axis when it has one, else on one device."""
    scale = q_BTKRMd.shape[-1] ** -0.5 if scale is None else scale
    kwargs = dict(causal=causal, segment_ids=segment_ids, scale=scale, window=window)
    if context_parallel.context_size() == 1:
        return context_parallel.blockwise_xla_attention(q_BTKRMd, k_BSKGd, v_BSKv, **kwargs)
    return context_parallel.context_parallel_attention(q_BTKRMd, k_BSKGd, v_BSKv, mesh=sharding.active_mesh(), **kwargs)


def _choose(op: str, impl: str, q, k, v, causal, segment_ids, window) -> tuple[str | None, Device | None]:
    """_resolve's choice; under a context axis "context_pallas_tpu" / "context_pallas_gpu" (the fused kernels per
    query chunk, with the chunk's place as their query offset) for that impl, or for "auto" on a TPU / on a Hopper
    GPU where the Mosaic GPU kernels take the call; else (None, None): blockwise XLA attention."""
    check_window(window, causal)
    if context_parallel.context_size() > 1:
        device = current_device()
        call = AttentionCall.of(op, q, k, v, causal, segment_ids, window)
        fused = None
        if impl in ("pallas_tpu", "pallas_gpu"):
            fused = choose(call, impl, device)[0]  # raises a clear error where the kernel cannot take the call
        elif impl == "auto" and device.platform == "tpu":
            fused = "pallas_tpu"
        elif impl == "auto" and device.is_hopper and pallas_gpu_unsupported(call) is None:
            fused = "pallas_gpu"
        path = {"pallas_tpu": "the fused Pallas TPU kernels", "pallas_gpu": "the fused Mosaic GPU kernels",
                None: "blockwise XLA attention"}[fused]
        _log_once(logging.INFO, ("context", impl, fused), f"attention over the context axis: all-gathered K/V, {path} "
                  f"per query chunk (diffjax.ops.context_parallel; impl={impl!r})")
        return (f"context_{fused}", device) if fused else (None, None)
    return _resolve(op, impl, q, k, v, causal, segment_ids, window)


def _context_fused(kernel, q, k, v, lam, segment_ids):
    """kernel(q, k, v, lam, segment_ids, q_offset) per query chunk over the context axis (context_parallel_fused)."""
    heads = ("batch", "length", "act_heads") + (None,) * (q.ndim - 3)
    kv_heads = ("batch", "length", "act_kv_heads") + (None,) * (k.ndim - 3)
    lam_axes = () if lam is None or jnp.ndim(lam) == 0 else ("batch", "length", "act_heads")
    return context_parallel.context_parallel_fused(kernel, q, k, v, lam, segment_ids=segment_ids,
                                                   mesh=sharding.active_mesh(), q_axes=heads, kv_axes=kv_heads,
                                                   lam_axes=lam_axes)


def diff_attention(q, k, v, lam, *, causal=True, segment_ids=None, scale=None, impl="auto", block_sizes=None,
                   window=None):
    """o[B, T, H, dv] = softmax(q1 k1^T scale) v - lam softmax(q2 k2^T scale) v.

    q: [B, T, H, 2, d]; k: [B, S, Hkv, G, d] (G = 2, or 1 when both maps share keys);
    v: [B, S, Hkv, dv]; lam: scalar or [B, T, H]; scale defaults to d ** -0.5.
    segment_ids: None, [B, T] (T == S) or a pair (q ids [B, T], kv ids [B, S]).
    block_sizes: (block_q, block_k) for impl="pallas_tpu" (default 128, 128); a
    diffjax.ops.pallas_gpu.Tuning for impl="pallas_gpu" (default: pallas_gpu.default_tuning).
    window: None, or W: a sliding window, each query sees its W latest keys (itself included; causal only).
    Under an activation-sharding mesh with a context axis, the sequence is split over it (context_parallel.py).
    """
    choice, device = _choose("diff_attention", impl, q, k, v, causal, segment_ids, window)
    kwargs = dict(causal=causal, segment_ids=segment_ids, scale=scale, window=window)
    if choice == "context_pallas_tpu":
        from diffjax.ops.pallas_tpu import diff_attention_pallas

        return _context_fused(lambda q, k, v, lam, ids, offset: diff_attention_pallas(
            q, k, v, lam, causal=causal, segment_ids=ids, scale=scale, block_sizes=block_sizes, window=window,
            q_offset=offset), q, k, v, lam, segment_ids)
    if choice == "context_pallas_gpu":
        from diffjax.ops.pallas_gpu import diff_attention_pallas_gpu

        return _context_fused(lambda q, k, v, lam, ids, offset: diff_attention_pallas_gpu(
            q, k, v, lam, causal=causal, segment_ids=ids, scale=scale, tuning=block_sizes, q_offset=offset),
            q, k, v, lam, segment_ids)
    if choice == "pallas_tpu":
        from diffjax.ops.pallas_tpu import diff_attention_pallas

        return _partitioned(lambda q, k, v, lam, ids: diff_attention_pallas(
            q, k, v, lam, causal=causal, segment_ids=ids, scale=scale, block_sizes=block_sizes, window=window),
            q, k, v, lam, segment_ids)
    if choice == "pallas_gpu":
        from diffjax.ops.pallas_gpu import diff_attention_pallas_gpu

        return _partitioned(lambda q, k, v, lam, ids: diff_attention_pallas_gpu(
            q, k, v, lam, causal=causal, segment_ids=ids, scale=scale, tuning=block_sizes), q, k, v, lam, segment_ids)
    if choice == "cudnn":
        return compositions.diff_attention_cudnn(q, k, v, lam, **kwargs)
    if choice == "triton":
        return _partitioned(lambda q, k, v, lam, ids: compositions.diff_attention_triton(
            q, k, v, lam, causal=causal, segment_ids=ids, scale=scale, interpret=device.platform != "gpu"), q, k, v, lam, segment_ids)
    if choice == "splash":
        return _partitioned(lambda q, k, v, lam, ids: compositions.diff_attention_splash(
            q, k, v, lam, causal=causal, segment_ids=ids, scale=scale, window=window, interpret=device.platform != "tpu"),
            q, k, v, lam, segment_ids)
    if _runs_blockwise(q, k, choice, window):
        B, T, H, _, d = q.shape
        o_BTKRMv = _blockwise(q.reshape(B, T, k.shape[2], -1, 2, d), k, v, causal, segment_ids, scale, window)
        return compositions.lam_epilogue(o_BTKRMv.reshape(B, T, H, 2, v.shape[-1]), lam, v.dtype)
    return diff_attention_xla(q, k, v, lam, **kwargs)


def dot_product_attention(q, k, v, *, causal=True, segment_ids=None, scale=None, impl="auto", block_sizes=None,
                          window=None):
    """o[B, T, N, dv] = softmax(q k^T scale) v with q: [B, T, N, d], k: [B, S, K, d], v: [B, S, K, dv].

    The baseline Transformer's op; every impl name works ("pallas_tpu" and "pallas_gpu" run the
    single-map mode of the fused kernels, "cudnn" calls jax.nn.dot_product_attention directly).
    block_sizes, window: as for diff_attention. A context axis splits the sequence as for diff_attention.
    """
    choice, device = _choose("dot_product_attention", impl, q, k, v, causal, segment_ids, window)
    kwargs = dict(causal=causal, segment_ids=segment_ids, scale=scale, window=window)
    if choice == "context_pallas_tpu":
        from diffjax.ops.pallas_tpu import dot_product_attention_pallas

        return _context_fused(lambda q, k, v, _, ids, offset: dot_product_attention_pallas(
            q, k, v, causal=causal, segment_ids=ids, scale=scale, block_sizes=block_sizes, window=window,
            q_offset=offset), q, k, v, None, segment_ids)
    if choice == "context_pallas_gpu":
        from diffjax.ops.pallas_gpu import dot_product_attention_pallas_gpu

        return _context_fused(lambda q, k, v, _, ids, offset: dot_product_attention_pallas_gpu(
            q, k, v, causal=causal, segment_ids=ids, scale=scale, tuning=block_sizes, q_offset=offset),
            q, k, v, None, segment_ids)
    if choice == "pallas_tpu":
        from diffjax.ops.pallas_tpu import dot_product_attention_pallas

        return _partitioned(lambda q, k, v, _, ids: dot_product_attention_pallas(
            q, k, v, causal=causal, segment_ids=ids, scale=scale, block_sizes=block_sizes, window=window),
            q, k, v, None, segment_ids)
    if choice == "pallas_gpu":
        from diffjax.ops.pallas_gpu import dot_product_attention_pallas_gpu

        return _partitioned(lambda q, k, v, _, ids: dot_product_attention_pallas_gpu(
            q, k, v, causal=causal, segment_ids=ids, scale=scale, tuning=block_sizes), q, k, v, None, segment_ids)
    if choice == "cudnn":
        return compositions.dot_product_attention_cudnn(q, k, v, **kwargs)
    if choice == "triton":
        return _partitioned(lambda q, k, v, _, ids: compositions.dot_product_attention_triton(
            q, k, v, causal=causal, segment_ids=ids, scale=scale, interpret=device.platform != "gpu"), q, k, v, None, segment_ids)
    if choice == "splash":
        return _partitioned(lambda q, k, v, _, ids: compositions.dot_product_attention_splash(
            q, k, v, causal=causal, segment_ids=ids, scale=scale, window=window, interpret=device.platform != "tpu"),
            q, k, v, None, segment_ids)
    if _runs_blockwise(q, k, choice, window):
        B, T, N, d = q.shape
        o_BTKRMv = _blockwise(q.reshape(B, T, k.shape[2], -1, 1, d), k[:, :, :, None], v, causal, segment_ids, scale,
                              window)
        return o_BTKRMv.reshape(B, T, N, v.shape[-1])
    return dot_product_attention_xla(q, k, v, **kwargs)


__all__ = [
    "CUDNN_FASTER_ON_HOPPER", "DEVICES", "IMPLS", "AttentionCall", "Device", "attention_mask", "choose", "config_problems",
    "current_device", "diff_attention", "dot_product_attention",
]
