"""Differential attention composed from existing flash kernels (no kernel of our own).

cudnn (GPU): jax.nn.dot_product_attention(implementation="cudnn") requires the value to have the
key's shape, so V (width dv = 2d in V1) is split into dv / d halves of width d (the paper's
appendix A / unilm multihead_flashdiff_2 recipe). The two maps are folded into the head axis
(query heads ordered map-major, [q1 heads..., q2 heads...], kv heads [k1 heads..., k2 heads...]),
so jax's GQA pairing n // n_rep sends map m of head h to map m of kv head h // n_rep: one call
per V half serves both maps. o = o1 - lam o2 is an XLA epilogue.

triton (GPU, any generation): JAX's Pallas Triton flash attention
(jax.experimental.pallas.ops.gpu.attention.mha), which takes segment ids, so packed batches get a
flash path where cuDNN has none. It needs q, k and v of one head dim and as many kv heads as query
heads, so the maps are folded into the head axis as for cudnn, K/V are repeated over each GQA group,
and V is split into d-wide pieces (one call per piece). Its causal mask is top-left aligned (equal
to ours for T == S) and it takes one segment-id array for queries and keys (self-attention only).

splash (TPU): splash attention accepts a value head dim different from q/k's, so each map is one
MQA splash call per kv head (vmapped over batch and kv heads: no repeated K/V), 2 calls in all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def lam_epilogue(o_BTH2v, lam, dtype):
    lam_BTH1 = jnp.asarray(lam, dtype)
    if lam_BTH1.ndim:
        lam_BTH1 = lam_BTH1[..., None]
    return (o_BTH2v[..., 0, :].astype(dtype) - lam_BTH1 * o_BTH2v[..., 1, :].astype(dtype))


# ------------------------------------------------------------------------------------------- cudnn


def cudnn_unsupported(q, k, v, causal, segment_ids, platform) -> str | None:
    """Why the cudnn composition cannot run this call (None when it can)."""
    d, dv = q.shape[-1], v.shape[-1]
    T, S = q.shape[1], k.shape[1]
    if platform != "gpu":
        return f"needs a CUDA GPU (platform is {platform!r})"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs float16 or bfloat16 inputs (got {q.dtype})"
    if d % 8 or d > 256:
        return f"needs a head dim that is a multiple of 8 and at most 256 (128 before Hopper), got {d}"
    # jax.nn.dot_product_attention takes value [B, S, K, H] with key's H only (jax/_src/nn/functions.py, 0.10.2 to
    # today's main), so V is split into d-wide pieces. cuDNN itself takes d_qk 192 / d_v 128 on Hopper, forward and
    # backward (its SDPA support matrix, backend 9.18.1), and jax's private cudnn path passes it for cuDNN >= 9.10
    # (fused_attention_stablehlo.check_is_flash_attention's "mla"; check_layout wants q / k head dims equal only):
    # not taken here, a private API; such calls (Motif 3's GDLA) run pallas_gpu on Hopper.
    if dv % d:
        return f"needs the value width ({dv}) to be a multiple of the q/k head dim ({d}) to split V"
    if segment_ids is not None:
        return "does not take segment_ids (jax.nn.dot_product_attention has no segment mask on cuDNN)"
    if causal and T != S:
        return f"causal with T != S (T={T}, S={S}): jax.nn's causal mask is top-left aligned, ours bottom-right"
    return None


def _cudnn_call(q, k, v, causal, scale, window=None):
    # jax.nn's local_window_size (left, right) counts keys besides the query's own: W keys are (W - 1, 0).
    local_window = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=local_window,
                                        implementation="cudnn")


def _fold_maps(q_BTH2d, k_BSKGd, v_BSKv, lam, call):
    """Both maps in one call per d-wide V piece: query heads map-major [q1 heads..., q2 heads...], kv heads
    [k1 heads..., k2 heads...], so GQA's pairing n // n_rep sends map m of head h to map m of kv head
    h // n_rep. call(q_BTNd, k_BSNd, v_BSNd) is one flash call; o = o1 - lam o2 is an XLA epilogue."""
    B, T, H, _, d = q_BTH2d.shape
    _, S, K, G, _ = k_BSKGd.shape
    dv = v_BSKv.shape[-1]
    q_BTNd = q_BTH2d.transpose(0, 1, 3, 2, 4).reshape(B, T, 2 * H, d)
    k_BS2Kd = jnp.broadcast_to(k_BSKGd.transpose(0, 1, 3, 2, 4), (B, S, 2, K, d)) if G == 1 else k_BSKGd.transpose(0, 1, 3, 2, 4)
    k_BSNd = k_BS2Kd.reshape(B, S, 2 * K, d)
    pieces = []
    for c in range(dv // d):  # V split in width-d pieces, tiled for the two maps' kv heads
        v_BSKd = v_BSKv[..., c * d : (c + 1) * d]
        pieces.append(call(q_BTNd, k_BSNd, jnp.concatenate([v_BSKd, v_BSKd], axis=2)))
    o_BTH2v = jnp.concatenate(pieces, axis=-1).reshape(B, T, 2, H, dv).transpose(0, 1, 3, 2, 4)
    return lam_epilogue(o_BTH2v, lam, v_BSKv.dtype)


def _split_values(q_BTNd, k_BSKd, v_BSKv, call):
    """Single-map attention with dv a multiple of d: one call per d-wide V piece."""
    d, dv = q_BTNd.shape[-1], v_BSKv.shape[-1]
    if dv == d:
        return call(q_BTNd, k_BSKd, v_BSKv)
    return jnp.concatenate([call(q_BTNd, k_BSKd, v_BSKv[..., c * d : (c + 1) * d]) for c in range(dv // d)], axis=-1)


def diff_attention_cudnn(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, window=None):
    scale = q_BTH2d.shape[-1] ** -0.5 if scale is None else scale
    return _fold_maps(q_BTH2d, k_BSKGd, v_BSKv, lam, lambda q, k, v: _cudnn_call(q, k, v, causal, scale, window))


def dot_product_attention_cudnn(q_BTNd, k_BSKd, v_BSKv, *, causal=True, segment_ids=None, scale=None, window=None):
    scale = q_BTNd.shape[-1] ** -0.5 if scale is None else scale
    return _split_values(q_BTNd, k_BSKd, v_BSKv, lambda q, k, v: _cudnn_call(q, k, v, causal, scale, window))


# ------------------------------------------------------------------------------------------ triton

TRITON_BLOCK = 128  # the kernel's default q / kv block; T is zero-padded to a multiple of it


def triton_unsupported(q, k, v, causal, segment_ids, platform, *, interpret=False, window=None) -> str | None:
    """Why the Pallas Triton composition cannot run this call (None when it can)."""
    d, dv = q.shape[-1], v.shape[-1]
    T, S = q.shape[1], k.shape[1]
    if platform != "gpu" and not interpret:
        return f"needs a CUDA GPU (platform is {platform!r})"
    if window is not None:
        return "takes no sliding window (JAX's Pallas Triton kernel has no local mask)"
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"needs float16, bfloat16 or float32 inputs (got {q.dtype})"
    if d % 16 or d > 128:  # the kernel pads d to a power of two (masked), so d = 96 runs as 128
        return f"needs a head dim that is a multiple of 16 and at most 128 (got {d})"
    if dv % d:
        return f"needs the value width ({dv}) to be a multiple of the q/k head dim ({d}) to split V"
    if T != S:
        return f"needs T == S (self-attention; got T={T}, S={S})"
    if isinstance(segment_ids, (tuple, list)):
        return "takes one segment-id array for queries and keys, not a (q ids, kv ids) pair"
    return None


def _triton_call(q_BTNd, k_BSKd, v_BSKd, segment_ids_BT, causal, scale, interpret):
    """One Pallas Triton flash call: K/V repeated to the query heads, T padded to a block multiple.
    Padded keys get a segment id no real one equals; with causal masking and no segment ids they sit
    after every real query and need none."""
    from jax.experimental.pallas.ops.gpu import attention

    B, T, N, d = q_BTNd.shape
    n_rep = N // k_BSKd.shape[2]
    k_BSNd, v_BSNd = (jnp.repeat(x, n_rep, axis=2) if n_rep > 1 else x for x in (k_BSKd, v_BSKd))
    Tp = max(16, 1 << (T - 1).bit_length()) if T < TRITON_BLOCK else -(-T // TRITON_BLOCK) * TRITON_BLOCK
    if Tp != T:
        if segment_ids_BT is None and not causal:
            segment_ids_BT = jnp.zeros((B, T), jnp.int32)
        pad = lambda x: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))  # noqa: E731
        q_BTNd, k_BSNd, v_BSNd = pad(q_BTNd), pad(k_BSNd), pad(v_BSNd)
        if segment_ids_BT is not None:
            pad_id = jnp.iinfo(jnp.int32).min
            segment_ids_BT = jnp.pad(segment_ids_BT.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=pad_id)
    o_BTNd = attention.mha(q_BTNd, k_BSNd, v_BSNd, segment_ids_BT, sm_scale=scale, causal=causal, interpret=interpret)
    return o_BTNd[:, :T]


def diff_attention_triton(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, interpret=False):
    scale = q_BTH2d.shape[-1] ** -0.5 if scale is None else scale
    return _fold_maps(q_BTH2d, k_BSKGd, v_BSKv, lam,
                      lambda q, k, v: _triton_call(q, k, v, segment_ids, causal, scale, interpret))


def dot_product_attention_triton(q_BTNd, k_BSKd, v_BSKv, *, causal=True, segment_ids=None, scale=None, interpret=False):
    scale = q_BTNd.shape[-1] ** -0.5 if scale is None else scale
    return _split_values(q_BTNd, k_BSKd, v_BSKv, lambda q, k, v: _triton_call(q, k, v, segment_ids, causal, scale, interpret))


# ------------------------------------------------------------------------------------------ splash


def splash_unsupported(q, k, v, causal, segment_ids, platform, *, interpret=False, block=128, window=None) -> str | None:
    """Why the splash composition cannot run this call (None when it can); any sliding window runs (LocalMask)."""
    T, S = q.shape[1], k.shape[1]
    if platform != "tpu" and not interpret:
        return f"needs a TPU (platform is {platform!r})"
    if T % block or S % block:
        return f"needs T and S to be multiples of the splash block size {block} (T={T}, S={S})"
    if causal and T > S:
        return f"causal with T > S leaves rows with no key, undefined in splash (T={T}, S={S})"
    return None


@functools.lru_cache(maxsize=64)
def _splash_kernel(T, S, causal, window, n_rep, interpret, block):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if window is not None:  # causal and windowed: keys S - T + t - (W - 1) .. S - T + t; splash skips other blocks
        mask_cls = splash.LocalMask((T, S), window_size=(window - 1, 0), offset=S - T)
    else:
        mask_cls = splash.CausalMask((T, S), offset=S - T) if causal else splash.FullMask((T, S))
    mask = splash.MultiHeadMask([mask_cls] * n_rep)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
        block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )
    return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def _splash_map(q_BKRTd, k_BKSd, v_BKSv, segment_ids, causal, window, interpret, block):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, K, R, T, d = q_BKRTd.shape
    S = k_BKSd.shape[2]
    kernel = _splash_kernel(T, S, causal, window, R, interpret, block)
    if segment_ids is None:
        f = lambda q, k, v: kernel(q, k, v)  # noqa: E731
        return jax.vmap(jax.vmap(f))(q_BKRTd, k_BKSd, v_BKSv)
    q_ids, kv_ids = segment_ids

    def per_batch(q_KRTd, k_KSd, v_KSv, q_ids_T, kv_ids_S):
        seg = splash.SegmentIds(q=q_ids_T, kv=kv_ids_S)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=seg))(q_KRTd, k_KSd, v_KSv)

    return jax.vmap(per_batch)(q_BKRTd, k_BKSd, v_BKSv, q_ids, kv_ids)


def diff_attention_splash(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, window=None,
                          interpret=False, block=128):
    """Two splash MQA calls (one per map); splash does not scale q, so q is scaled first (in q's dtype)."""
    B, T, H, _, d = q_BTH2d.shape
    _, S, K, G, _ = k_BSKGd.shape
    scale = d**-0.5 if scale is None else scale
    if segment_ids is not None and not isinstance(segment_ids, (tuple, list)):
        segment_ids = (segment_ids, segment_ids)
    q_BKR2Td = (q_BTH2d * jnp.asarray(scale, q_BTH2d.dtype)).reshape(B, T, K, H // K, 2, d).transpose(0, 2, 3, 4, 1, 5)
    k_BKGSd = k_BSKGd.transpose(0, 2, 3, 1, 4)
    v_BKSv = v_BSKv.transpose(0, 2, 1, 3)
    outs = [
        _splash_map(q_BKR2Td[:, :, :, m], k_BKGSd[:, :, m if G == 2 else 0], v_BKSv, segment_ids, causal, window, interpret,
                    block)
        for m in range(2)
    ]
    o_BTH2v = jnp.stack(outs, axis=3).transpose(0, 4, 1, 2, 3, 5).reshape(B, T, H, 2, -1)
    return lam_epilogue(o_BTH2v, lam, v_BSKv.dtype)


def dot_product_attention_splash(q_BTNd, k_BSKd, v_BSKv, *, causal=True, segment_ids=None, scale=None, window=None,
                                 interpret=False, block=128):
    B, T, N, d = q_BTNd.shape
    _, S, K, _ = k_BSKd.shape
    scale = d**-0.5 if scale is None else scale
    if segment_ids is not None and not isinstance(segment_ids, (tuple, list)):
        segment_ids = (segment_ids, segment_ids)
    q_BKRTd = (q_BTNd * jnp.asarray(scale, q_BTNd.dtype)).reshape(B, T, K, N // K, d).transpose(0, 2, 3, 1, 4)
    o_BKRTv = _splash_map(q_BKRTd, k_BSKd.transpose(0, 2, 1, 3), v_BSKv.transpose(0, 2, 1, 3), segment_ids, causal, window,
                          interpret, block)
    return o_BKRTv.transpose(0, 3, 1, 2, 4).reshape(B, T, N, -1)


