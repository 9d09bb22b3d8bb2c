"""Attention over a sequence split across the mesh's `context` axis (context parallelism).

Layout. With C devices on the context axis the length axis is cut into 2C chunks and device i holds chunks
i and 2C-1-i (`context_order`, the "zig-zag" layout of Llama 3 and ring-flash-attention): under a causal
mask a query chunk's work grows with its index, so each device pairs an early chunk with a late one and every
device does the same work. The train and eval steps put a batch in this order (tokens, positions, segment ids,
targets and loss weights alike: diffjax.train.step); token-wise layers do not care, and attention alone needs
each token's place in the sequence, which `context_order` gives.

Attention. Each device all-gathers K, V and the key segment ids over the context axis and attends its own
queries to them blockwise (`blockwise_attention`): a scan over key blocks with an online softmax per map,
blocks wholly in a query chunk's future skipped, and a flash-style custom backward that recomputes each
block's probabilities from the saved log-sum-exp. No device holds more than one query chunk x one key block
of scores, forward or backward. Why an all-gather rather than a ring of K/V blocks: it is exact for any mask
(packed documents need no special case), it is one collective per layer that XLA's scheduler can overlap with
the previous layer, and with GQA the gathered K/V are a fraction of the activations (Llama 3 trains its 128K
stage this way); a ring's memory advantage (K/V of T / C tokens, not T) matters only when K/V of the whole
sequence do not fit, which the memory benchmark (benchmarks/context_memory.py) shows they do for the paper's
64K recipe. The gradient of the all-gather is a reduce-scatter (JAX derives it).

The per-block computation is XLA's (`context_parallel_attention`), except with the fused kernels (impl
"pallas_tpu" / "pallas_gpu", or "auto" on a TPU / a Hopper GPU: `context_parallel_fused`): they take the query
chunk's place in the sequence as an offset (TPU: a scalar-prefetch operand; Mosaic GPU: a one-element gmem
operand), so each device runs its two chunks against the gathered K/V in sequence order with the kernels' own
causal block skipping; no log-sum-exp merging is needed with an all-gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import sharding

CONTEXT_AXIS = "context"
DEFAULT_BLOCK = 512  # keys per block of the inner scan
QUERY_BLOCK = 2048  # queries per piece: one piece x one key block of scores exist at a time
# The XLA path attends blockwise from this sequence length on (self-attention): the reference's T x T float32
# scores would be 256 MiB per head and map there.
BLOCKWISE_FROM = 8192
_MASKED = jnp.finfo(jnp.float32).min


def context_order(length: int, context: int) -> np.ndarray:
    """[length] int: the sequence index of each position of the context layout (device i holds chunks i and
    2C-1-i of 2C equal chunks, in that order). context 1: 0..length-1."""
    if context == 1:
        return np.arange(length)
    if length % (2 * context):
        raise ValueError(f"a sequence of length {length} cannot be split over context={context} devices: the length "
                         f"must be a multiple of 2 x context = {2 * context} (data.seq_len, or parallel.context)")
    chunks = np.arange(length).reshape(2 * context, length // (2 * context))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)])


def context_size(mesh=None) -> int:
    """The size of the context axis of `mesh` (default: the active activation-sharding mesh); 1 when none."""
    mesh = sharding.active_mesh() if mesh is None else mesh
    return 1 if mesh is None else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def to_context_order(x, context: int, axis: int = 1):
    """x with its `axis` (the sequence) permuted into the context layout (a no-op for context 1)."""
    if context == 1:
        return x
    return jnp.take(x, jnp.asarray(context_order(x.shape[axis], context)), axis=axis)


# --- blockwise attention with an online softmax and a flash-style backward --------------------------------


def _block_visible(q_index, kv_index_block, causal, window):
    """Whether any query may see any key of the block (causally, and within the sliding window); segment ids are
    left to the mask. Blocks that fail are skipped: attention costs T x window, not T^2, under a window."""
    if not causal:
        return jnp.bool_(True)
    visible = jnp.min(kv_index_block) <= jnp.max(q_index)
    if window is not None:
        visible = visible & (jnp.max(kv_index_block) > jnp.min(q_index) - window)
    return visible


def _block_mask(q_index, kv_index, q_seg, kv_seg, causal, window):
    """[B, T, S] bool: key s visible to query t."""
    mask = jnp.ones((1, q_index.shape[0], kv_index.shape[0]), bool)
    if causal:
        distance = q_index[:, None] - kv_index[None, :]
        mask = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
        mask = mask[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
    return mask


def _scores(q, k, scale):
    """[B, K, R, M, T, S] float32 scores; q [B, T, K, R, M, d], k [B, S, K, G, d] (G 1 broadcasts over maps)."""
    return jnp.einsum("btkrmd,bskmd->bkrmts", q, k, preferred_element_type=jnp.float32) * jnp.float32(scale)


def _blocks(x, block):
    """[B, S, ...] -> [S / block, B, block, ...] (the scan's leading axis)."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:]), 1, 0)


def _kv_blocks(k, v, kv_index, kv_seg, block):
    index = kv_index.reshape(-1, block)
    return _blocks(k, block), _blocks(v, block), index, None if kv_seg is None else _blocks(kv_seg, block)


def _tied_to_the_queries(q, q_index, kv_index, q_seg, kv_seg):
    """The masks depend on indices and segment ids alone, which do not change from layer to layer: inside a scan
    over layers, differentiating would hoist every block's mask out of the loop and keep them all (T x T values;
    measured: 24 GiB at T = 16384). Passing them through one barrier with q makes them loop-variant."""
    return jax.lax.optimization_barrier((q, q_index, kv_index, q_seg, kv_seg))


def _forward(q, k, v, q_index, kv_index, q_seg, kv_seg, causal, window, scale, block):
    """(o [B, T, K, R, M, dv] float32, lse [B, K, R, M, T] float32; _MASKED where a query sees no key)."""
    q, q_index, kv_index, q_seg, kv_seg = _tied_to_the_queries(q, q_index, kv_index, q_seg, kv_seg)
    B, T, K, R, M, _ = q.shape
    dv = v.shape[-1]

    def step(carry, kv_block):
        k_b, v_b, index_b, seg_b = kv_block

        def attend(carry):
            m, l, acc = carry
            s = _scores(q, k_b, scale)
            mask = _block_mask(q_index, index_b, q_seg, seg_b, causal, window)[:, None, None, None]
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkrmts,bskv->btkrmv", p.astype(v_b.dtype), v_b, preferred_element_type=jnp.float32)
            acc = acc * jnp.moveaxis(correction, -1, 1)[..., None] + pv
            return m_new, l, acc

        return jax.lax.cond(_block_visible(q_index, index_b, causal, window), attend, lambda c: c, carry), None

    init = (jnp.full((B, K, R, M, T), _MASKED), jnp.zeros((B, K, R, M, T), jnp.float32),
            jnp.zeros((B, T, K, R, M, dv), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, _kv_blocks(k, v, kv_index, kv_seg, block))
    seen = l > 0
    o = acc / jnp.moveaxis(jnp.where(seen, l, 1.0), -1, 1)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _MASKED)
    return o, lse


def _pieces(x, size):
    """[B, T, ...] -> [T / size, B, size, ...] (None stays None)."""
    return None if x is None else _blocks(x, size)


def _unpieces(x):
    """[N, B, size, ...] -> [B, N size, ...]."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def blockwise_attention(q, k, v, q_index, kv_index, q_seg, kv_seg, causal, window, scale, q_block, kv_block):
    """Softmax attention of M maps, normalized per map: o [B, T, K, R, M, dv] float32.

    q [B, T, K, R, M, d] (kv head, GQA repeat, map); k [B, S, K, G, d] (G = M, or 1 shared by the maps);
    v [B, S, K, dv]; q_index [T] / kv_index [S]: each token's place in the sequence (the causal mask compares
    them); q_seg [B, T] / kv_seg [B, S] or None: segment ids; window: None or W (causal only: query i sees keys
    i - W < j <= i, and key blocks wholly outside every piece's window are skipped). Queries go in pieces of
    q_block and keys in blocks of kv_block (dividing T and S; pieces and blocks of contiguous indices skip the
    most). Numerics as the fused kernels': float32 scores and softmax statistics, the unnormalized P rounded to v's dtype for P V, float32
    accumulation, normalized at the end (so in 16-bit it differs from the XLA reference by a rounding of P); a
    query that sees no key gives 0."""
    return _blockwise_fwd(q, k, v, q_index, kv_index, q_seg, kv_seg, causal, window, scale, q_block, kv_block)[0]


def _blockwise_fwd(q, k, v, q_index, kv_index, q_seg, kv_seg, causal, window, scale, q_block, kv_block):
    pieces = (_pieces(q, q_block), q_index.reshape(-1, q_block), _pieces(q_seg, q_block))
    o_pieces, lse_pieces = jax.lax.map(
        lambda piece: _forward(piece[0], k, v, piece[1], kv_index, piece[2], kv_seg, causal, window, scale, kv_block),
        pieces)
    return _unpieces(o_pieces), (pieces, k, v, kv_index, kv_seg, o_pieces, lse_pieces)


def _piece_grads(q, k, v, q_index, kv_index, q_seg, kv_seg, o, lse, do, causal, window, scale, kv_block):
    """(dq, dk, dv) float32 of one query piece: per key block, P = exp(s - lse) again, dS = P (dP - D) with
    D = rowsum(dO O) (the flash backward)."""
    q, q_index, kv_index, q_seg, kv_seg = _tied_to_the_queries(q, q_index, kv_index, q_seg, kv_seg)
    G = k.shape[3]
    D = jnp.moveaxis(jnp.sum(do * o, axis=-1), 1, -1)  # [B, K, R, M, T]
    do_v = do.astype(v.dtype)

    def step(dq, kv_block_arrays):
        k_b, v_b, index_b, seg_b = kv_block_arrays

        def grads(dq):
            mask = _block_mask(q_index, index_b, q_seg, seg_b, causal, window)[:, None, None, None]
            p = jnp.where(mask, jnp.exp(_scores(q, k_b, scale) - lse[..., None]), 0.0)
            dv_b = jnp.einsum("bkrmts,btkrmv->bskv", p.astype(v.dtype), do_v, preferred_element_type=jnp.float32)
            dp = jnp.einsum("btkrmv,bskv->bkrmts", do_v, v_b, preferred_element_type=jnp.float32)
            ds = (p * (dp - D[..., None]) * jnp.float32(scale)).astype(q.dtype)
            dq = dq + jnp.einsum("bkrmts,bskmd->btkrmd", ds, k_b, preferred_element_type=jnp.float32)
            dk_b = jnp.einsum("bkrmts,btkrmd->bskmd", ds, q, preferred_element_type=jnp.float32)
            return dq, (jnp.sum(dk_b, axis=3, keepdims=True) if G == 1 else dk_b, dv_b)

        def skip(dq):
            return dq, (jnp.zeros(k_b.shape, jnp.float32), jnp.zeros(v_b.shape, jnp.float32))

        return jax.lax.cond(_block_visible(q_index, index_b, causal, window), grads, skip, dq)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), _kv_blocks(k, v, kv_index, kv_seg, kv_block))
    return dq, _unpieces(dk), _unpieces(dv)


def _blockwise_bwd(causal, window, scale, q_block, kv_block, residuals, do):
    (q_pieces, index_pieces, seg_pieces), k, v, kv_index, kv_seg, o_pieces, lse_pieces = residuals

    def piece(dkv, x):
        q_p, index_p, seg_p, o_p, lse_p, do_p = x
        dq_p, dk_p, dv_p = _piece_grads(q_p, k, v, index_p, kv_index, seg_p, kv_seg, o_p, lse_p, do_p, causal, window,
                                        scale, kv_block)
        return (dkv[0] + dk_p, dkv[1] + dv_p), dq_p

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dk, dv), dq_pieces = jax.lax.scan(
        piece, zeros, (q_pieces, index_pieces, seg_pieces, o_pieces, lse_pieces, _pieces(do, q_block)))
    return (_unpieces(dq_pieces).astype(q_pieces.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None)


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)


# --- the op over the context axis -------------------------------------------------------------------------


def _divisor_block(length: int, block: int) -> int:
    """The largest divisor of `length` not above `block` (pieces and blocks must not straddle chunks)."""
    return max(b for b in range(1, min(length, block) + 1) if length % b == 0)


def _segment_pair(segment_ids):
    """(query ids, key ids) of None, one [B, T] array (self-attention) or a pair."""
    if isinstance(segment_ids, (tuple, list)):
        return tuple(jnp.asarray(ids) for ids in segment_ids)
    return (None, None) if segment_ids is None else (jnp.asarray(segment_ids),) * 2


def blockwise_xla_attention(q_BTKRMd, k_BSKGd, v_BSKv, *, causal, segment_ids, scale, window=None):
    """Per-map outputs [B, T, K, R, M, dv] (v's dtype) of self-attention on one device (or partitioned by XLA),
    blockwise: what the XLA path runs for long sequences, where the reference's T x S scores would not fit."""
    T = q_BTKRMd.shape[1]
    index = jnp.arange(T, dtype=jnp.int32)
    o = blockwise_attention(q_BTKRMd, k_BSKGd, v_BSKv, index, index, *_segment_pair(segment_ids), causal, window,
                            scale, _divisor_block(T, QUERY_BLOCK), _divisor_block(T, DEFAULT_BLOCK))
    return o.astype(v_BSKv.dtype)


def context_parallel_fused(attend_chunk, q, k, v, lam, *, segment_ids, mesh, q_axes, kv_axes, lam_axes):
    """The output [B, T, heads, dv] of self-attention in the context layout, with each device's two query chunks
    attended by a fused kernel: K, V and key segment ids are all-gathered over the context axis and put back in
    sequence order, then `attend_chunk(q_chunk, k_all, v_all, lam_chunk, ids, q_offset)` runs once per chunk with
    the chunk's place in the sequence as the kernel's query offset (a traced scalar: the causal mask, the window
    and the blocks skipped follow it, so each device does only its chunks' causal work). ids: None or
    (chunk's query ids, all key ids). q_axes / kv_axes / lam_axes: the logical axes of q, of k and v (trailing
    dims None), and of lam (() for a scalar)."""
    T = q.shape[1]
    if k.shape[1] != T:
        raise ValueError(f"context parallelism needs self-attention (as many keys as queries), got T={T} and S={k.shape[1]}")
    C = context_size(mesh)
    order = context_order(T, C)
    chunk = T // (2 * C)
    sequence_order = jnp.asarray(np.argsort(order), jnp.int32)
    q_ids, kv_ids = _segment_pair(segment_ids)
    has_lam = lam is not None and jnp.ndim(lam) > 0

    def per_device(q, k, v, lam, *ids):
        gather = lambda x: jnp.take(jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True), sequence_order, axis=1)  # noqa: E731
        k_all, v_all = gather(k), gather(v)
        kv_all = gather(ids[1]) if ids else None
        device = jax.lax.axis_index(CONTEXT_AXIS)
        outs = []
        for half, chunk_index in enumerate((device, 2 * C - 1 - device)):  # device i holds chunks i and 2C-1-i
            rows = slice(half * chunk, (half + 1) * chunk)
            lam_chunk = lam[:, rows] if has_lam else lam
            chunk_ids = None if not ids else (ids[0][:, rows], kv_all)
            outs.append(attend_chunk(q[:, rows], k_all, v_all, lam_chunk, chunk_ids, chunk_index * chunk))
        return jnp.concatenate(outs, axis=1)

    arrays = [(q, q_axes), (k, kv_axes), (v, kv_axes[: v.ndim]), (jnp.asarray(0.0 if lam is None else lam), lam_axes)]
    if q_ids is not None:
        arrays += [(q_ids, ("batch", "length")), (kv_ids, ("batch", "length"))]
    out = jax.ShapeDtypeStruct(q.shape[:3] + v.shape[-1:], v.dtype)
    return sharding.shard_map_by_logical_axes(per_device, mesh, arrays, ("batch", "length", "act_heads", None),
                                              out_shape=out)


def context_parallel_attention(q_BTKRMd, k_BSKGd, v_BSKv, *, causal, segment_ids, scale, mesh, window=None):
    """Per-map outputs o [B, T, K, R, M, dv] (v's dtype) of queries and keys in the context layout, computed
    with the length axis split over the mesh's context axis (batch and heads split as the rules say)."""
    T = q_BTKRMd.shape[1]
    if k_BSKGd.shape[1] != T:
        raise ValueError(f"context parallelism needs self-attention (as many keys as queries), got T={T} and "
                         f"S={k_BSKGd.shape[1]}")
    C = context_size(mesh)
    context_order(T, C)  # checks that T splits
    chunk = T // (2 * C)
    q_block, kv_block = _divisor_block(chunk, QUERY_BLOCK), _divisor_block(chunk, DEFAULT_BLOCK)
    q_ids, kv_ids = _segment_pair(segment_ids)

    def per_device(q, k, v, q_seg=None, kv_seg=None):
        order = jnp.asarray(context_order(T, C), jnp.int32)
        q_index = jax.lax.dynamic_slice_in_dim(order, jax.lax.axis_index(CONTEXT_AXIS) * 2 * chunk, 2 * chunk)
        gather = lambda x: None if x is None else jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)  # noqa: E731
        o = blockwise_attention(q, gather(k), gather(v), q_index, order, q_seg, gather(kv_seg), causal, window,
                                scale, q_block, kv_block)
        return o.astype(v.dtype)

    arrays = [(q_BTKRMd, ("batch", "length", "act_kv_heads", None, None, None)),
              (k_BSKGd, ("batch", "length", "act_kv_heads", None, None)),
              (v_BSKv, ("batch", "length", "act_kv_heads", None))]
    if q_ids is not None:
        arrays += [(q_ids, ("batch", "length")), (kv_ids, ("batch", "length"))]
    out = jax.ShapeDtypeStruct(q_BTKRMd.shape[:-1] + v_BSKv.shape[-1:], v_BSKv.dtype)
    return sharding.shard_map_by_logical_axes(per_device, mesh, arrays,
                                              ("batch", "length", "act_kv_heads", None, None, None), out_shape=out)
