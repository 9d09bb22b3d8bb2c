"""Fused differential flash attention for Hopper GPUs in Pallas Mosaic GPU (impl="pallas_gpu").

Forward, one CTA per (batch, head, 64-row query block), three warpgroups:
  producer   TMA-loads the query tiles once, then each K/V step into a ring of `stages` SMEM slots.
  consumer g computes map g (g = 0, 1) for the same query rows: S_g = q_g k_g^T on the tensor cores
             (wgmma), its own online softmax in base 2, O_g += P_g V. Both maps read the same V slot,
             so every K and V tile is loaded once for both maps; a slot is refilled once both consumers
             have released it.
  epilogue   consumer 1 hands its normalised O_2 (fp32) to consumer 0 through SMEM, d columns at a
             time; consumer 0 writes o = O_1 - lam O_2 through the query tiles' SMEM and TMA.
Why one map per warpgroup: with d = 128, dv = 256 one warpgroup cannot hold both maps' 64 x 256 fp32
accumulators (256 registers a thread); split this way each consumer holds one (128 registers).

Backward (custom VJP), with G the cotangent of o (the same algebra as diffjax.ops.pallas_tpu):
    dP = G V^T (shared by both maps), D_m = rowsum(G * O_m), P_m = exp2(S_m - lse_m)
    dS_1 = P_1 (dP - D_1),  dS_2 = -lam P_2 (dP - D_2),  dV = (P_1 - lam P_2)^T G
    dQ_m = scale dS_m K_m,  dK_m = scale dS_m^T Q_m,  dlam = -D_2
Two kernels, each with a producer and one consumer per map. dP's contraction over dv is split in two
halves, one per consumer, and the halves are exchanged through SMEM (no duplicated matmul; dk/dv's dp_whole and
dv_smem compute it whole):
  dk/dv   one CTA per (batch, kv head, 64-row kv block); streams (query head of the group, q block)
          tiles; consumer g accumulates dK_g and the g-th column half of dV (exchanging P_m tiles).
  dq      one CTA per (batch, head, 64-row q block); streams K/V tiles; consumer g accumulates dQ_g.

dk/dv's differential consumers, Tuning.dkdv (benchmarks/pallas_gpu_sweep.py times each): a consumer holds two
64 x 128 fp32 accumulators (dK_g, dV's half: 128 of its registers) beside the step's 64 x block_q_bwd fp32 tiles
(32 registers each), and in this transposed layout a per-query vector (lse, D, lambda) takes 16, so the step's live
set decides whether it spills: the first kernel ("exchange", both sums live at once in consumer 1) peaks far above
its 232 and spills every step. ptxas (sm_90a, d 128 / dv 256, causal; spill bytes a consumer thread stores + loads
in its step loop, consumer 0 / 1; stack frame; with segment ids, where every step is masked, the stack frame):
  exchange  96 + 204 / 288 + 380 B, 272 B (368 B); Nsight on the H100: long-scoreboard stalls, 26% tensor pipe.
  lean      (default) 4 + 8 / 0 + 16 B, 24 B (64 B). The same algebra, SMEM and two meetings a step, each value
            made where it is used: per-query vectors loaded from SMEM at their use; consumer 0 writes its dP half
            and P_1, consumer 1 adds its dP half, makes dS, issues the dK wgmma and, while it runs, adds its
            -lam P_2 to P_1 and meets 0 again; then dV. Registers 24 (producer) / 240 / 240, FA3's split; with
            segment ids, the causal mask only up to the diagonal.
  dp_whole  4 + 8 / 32 + 40 B, 48 B (32 B). Each consumer computes the whole dP (both halves of dv: +25% FLOPs a
            step), so only the P shares meet: each writes its 16-bit share to its own SMEM buffer, one meeting, each
            adds the other's (a p_free barrier keeps a buffer until both have read it). SMEM 8 KB less than lean.
  dv_smem   4 + 8 / 52 + 124 B, 136 B (120 B). The whole dP, and each consumer's dV takes both shares straight from
            SMEM (two wgmmas: +50% FLOPs a step, no P sum in registers; the most exact dV).

Single-map mode (standard attention, `dot_product_attention_pallas_gpu`; FA3's layout): the same
kernels with one map (M = 1), q and k carrying a map axis of size 1. The consumers take two
different 64-row tiles of one 128-row block and share every streamed tile: forward and dq, two query
tiles (own online softmax / full dP, own output rows, no O_2 hand-off, no exchange); dk/dv, two kv
tiles streaming the same q / dO tiles. Both consumers run the CTA's step range; each masks with its
own rows (`_q_tile`), so a step at either end of the range may be fully masked for one of them.
d and dv are each 64, 128 or 192 (SINGLE_HEAD_DIMS says why), Motif 3's GDLA's 192 / 128 among them:
only the forward's output staging depends on the pair (the query tile when dv == d, else a V ring slot,
free once both consumers are past their last step).

The single-map backward consumers (dq.single_step, dkdv._single_step) take each streamed step in 64-row sub-tiles
(dq: 64 keys, dk/dv: 64 queries; a loop, not unrolled, over a 128-row block's two), so the live set beside the fp32
accumulators is one sub-tile's S and dP (32 registers each) at any block size. A 128-row step used to hold two
64 x 128 fp32 tiles (64 registers each) beside dK and dV (128): ptxas spilled 1.8 KB a thread and serialized every
wgmma. Besides: setmaxnreg 24 / 240 as in the differential lean schedule; with segment ids dq too masks positions
only where they need it; dk/dv's masks read the query positions from an SMEM table where used (an iota's
per-element values are loop invariants that LLVM hoists out of the step loop, and ptxas then spills them); and
past d + dv = 256 (Motif 3's 192 / 128: dK and dV take 160 registers) P^T is held in float16 while dP^T is
computed after it, instead of both fp32 tiles at once (`dkdv._single_sub_tile`). ptxas 13.0 (sm_90a, B 2, T 8192,
causal, default blocks; stack frame a thread, before -> after): the twin (d 128, 128-row blocks) dq 144 -> 0 and
dk/dv 584 -> 0, packed 168 -> 0 and 784 -> 0; Motif 3 (192 / 128, GQA 5:1, packed, window 129) dk/dv 560 -> 40
with at most 8 B reloaded a step (benchmarks/results/kernel_resources.md).

Conventions: bottom-right aligned causal masking (query t sits at key S - T + t, or q_offset + t when the
caller places the queries, as context parallelism does with each device's query chunks: then q_offset is a
traced int32 read from a one-element gmem operand, and the step ranges and masks follow it); a static sliding
window W (each query sees keys q_pos - W + 1 .. q_pos, HF Mistral's sliding_window=W) gives the step ranges a
lower bound as well (`_kv_steps`; dk/dv's query range an upper bound, `_q_steps`): kv steps above the diagonal
or wholly behind every row's window are never loaded, so a windowed call costs T x W; steps where none of a
consumer's pairs is masked run without mask arithmetic, the rest (the diagonal, the window's lower edge,
padded keys, any step with segment ids) mask. T and S are zero-padded to
the block sizes outside the kernels (no copy when they divide); padded keys are masked in the
forward and contribute nothing to the backward (their K and V rows are zero). A fully masked query
row gives o = 0 and zero gradients, like the reference.

Off GPU the same kernels run in Mosaic GPU interpret mode (`interpret=True`, for tests): the
primitives that have no interpreter rule (wgmma, layout casts, layout-aware loads) go through
`_Ops`, which uses plain jnp equivalents there; everything else (TMA copies, barriers, the
warpgroup schedule, masking, softmax, exchange) is the same code on both paths.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from diffjax.ops.names import DIFF_RESIDUALS_NAME, KERNEL_RESIDUALS_NAME, OUTPUT_NAME
from diffjax.ops.pallas_gpu.common import (
    DKDV_VARIANTS,
    SMEM_BYTES,
    SMEM_MARGIN,
    Tuning,
    _cdiv,
    _Static,
)
from diffjax.ops.pallas_gpu.dkdv import _dkdv, _exchange_bytes
from diffjax.ops.pallas_gpu.dq import _dq
from diffjax.ops.pallas_gpu.forward import _forward
from diffjax.ops.pallas_gpu.tuning_table import swept_tuning
from diffjax.ops.reference import check_window, split_segment_ids
from diffjax.ops.target import interpreted

__all__ = ["SINGLE_HEAD_DIMS", "Tuning", "default_tuning", "diff_attention_pallas_gpu", "dot_product_attention_pallas_gpu",
           "unsupported"]


# The single-map mode's head dims, q / k and v in any pair (Motif 3's GDLA: d 192, dv 128). Multiples of 64: 16-bit
# tiles are 128-byte swizzled, which every wgmma contracting over d or dv needs. At most 192: a dk/dv consumer holds
# dK and dV of its 64 kv rows in fp32 registers, d / 2 + dv / 2 a thread, beside a 64-query sub-tile's S^T and dP^T
# (32 each; past d + dv = 256, P^T in float16 and dP^T: 48) in the 240 it gets: (192, 128) 208, 24 to 48 B of
# stack; (192, 192) 240, more than ptxas fits beside the step's addresses (it spills and serializes the wgmmas:
# kernel_resources.md); d 256 would need 128 for dK alone.
SINGLE_HEAD_DIMS = (64, 128, 192)


def _round_up(x: int, m: int) -> int:
    return _cdiv(x, m) * m


def _pad_axis(x, axis, size):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def unsupported(q, k, v, tuning=None) -> str | None:
    """Why impl="pallas_gpu" cannot run these shapes (None when it can): differential attention for
    q [B, T, H, 2, d], standard (single-map) attention for q [B, T, N, d]."""
    single = q.ndim == 4
    if single:
        if k.ndim != 4 or v.ndim != 4:
            return f"needs q [B, T, N, d], k [B, S, K, d] and v [B, S, K, dv], got {q.shape}, {k.shape} and {v.shape}"
        G = 1
    else:
        if q.shape[3] != 2 or k.ndim != 5 or k.shape[3] not in (1, 2):
            return f"needs q [B, T, H, 2, d] and k [B, S, Hkv, 1 or 2, d], got {q.shape} and {k.shape}"
        G = k.shape[3]
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs q, k, v in one of bfloat16 / float16, got {q.dtype}, {k.dtype}, {v.dtype}"
    head_dims = SINGLE_HEAD_DIMS if single else (64, 128)
    if d != dk or d not in head_dims:
        return f"needs the q and k head dim d in {head_dims}, got {d} and {dk}"
    if single and dv not in SINGLE_HEAD_DIMS:
        return f"needs the value head dim dv in {SINGLE_HEAD_DIMS} for standard attention, got dv = {dv} with d = {d}"
    if not single and dv not in (d, 2 * d):
        return f"needs dv = d or 2d, got dv = {dv} with d = {d}"
    if q.shape[2] % k.shape[2]:
        return f"needs query heads ({q.shape[2]}) to be a multiple of kv heads ({k.shape[2]})"
    bs = default_tuning(d, dv, G, q.dtype, single) if tuning is None else Tuning(*tuning)
    if bs.block_q != 64 or any(b not in (64, 128) for b in bs[1:4]) or bs.stages < 2:
        # 64: a wgmma row tile per consumer; the others are contraction sizes of 16-bit wgmmas with a
        # 128-byte swizzle, which must be multiples of 64
        return f"needs block_q = 64, block_k / block_k_dq / block_q_bwd in (64, 128) and stages >= 2, got {bs}"
    if bs.dkdv not in DKDV_VARIANTS:
        return f"needs dkdv in {DKDV_VARIANTS}, got {bs.dkdv!r}"
    need = _smem_bytes(d, dv, G, bs, q.dtype, single)
    over = {kernel: n for kernel, n in need.items() if n + SMEM_MARGIN > SMEM_BYTES}
    if over:
        return f"needs {over} bytes of shared memory with {bs}, more than the {SMEM_BYTES - SMEM_MARGIN} a Hopper CTA has for tiles; use smaller blocks or fewer stages"
    return None


def default_tuning(d, dv, G, dtype, single: bool = False, swept: bool = True) -> Tuning:
    """The sweep's measured best for the shape class where its table has one that fits (swept; see
    tuning_table.swept_tuning), else the largest block of each kernel (128 or 64) whose shared memory fits and whose
    consumers ptxas compiles without spilling in their step (`_spills`), with 2 stages."""
    fields = swept_tuning(d, dv, single, dtype) if swept else None
    if fields is not None and set(fields) <= set(Tuning._fields):
        bs = Tuning(**fields)
        if all(n + SMEM_MARGIN <= SMEM_BYTES for n in _smem_bytes(d, dv, G, bs, dtype, single).values()):
            return bs
    chosen = {}
    for field, kernel in (("block_k", "forward"), ("block_k_dq", "dq"), ("block_q_bwd", "dkdv")):
        for size in (128, 64):
            bs = Tuning(**{**chosen, field: size})
            fits = _smem_bytes(d, dv, G, bs, dtype, single)[kernel] + SMEM_MARGIN <= SMEM_BYTES
            if fits and not _spills(kernel, dv, bs, single):
                break
        chosen[field] = size
    return Tuning(**chosen)


def _spills(kernel: str, dv: int, bs: Tuning, single: bool) -> bool:
    """Whether ptxas spills in the kernel's step at these blocks (sm_90a, benchmarks/results/kernel_resources.md). The
    single-map forward's consumer holds O (dv / 2 fp32 registers a thread), S (block_k / 2) and P (block_k / 4): at
    block_k 128 with dv 192 (192 of its 232) it spills 24 B a step, at 64 nothing. The backward kernels' live sets do
    not grow with their blocks (single-map: 64-row sub-tiles; differential: 64-row blocks, all that SMEM leaves)."""
    return single and kernel == "forward" and bs.block_k == 128 and dv > 128


def _smem_bytes(d, dv, G, bs: Tuning, dtype, single: bool = False):
    """Shared memory each kernel allocates (tiles and exchange buffers; barriers are negligible)."""
    e = jnp.dtype(dtype).itemsize
    bq, bk, bkq, bqb, n = bs.block_q, bs.block_k, bs.block_k_dq, bs.block_q_bwd, bs.stages
    if single:  # two query tiles (forward, dq) or kv tiles (dk/dv) of 64 rows, no exchange buffers
        return {
            "forward": 2 * bq * d * e + n * bk * (d + dv) * e + n * bk * 4 + 4 * bq * 4,
            "dq": 2 * bq * (d + dv) * e + n * bkq * (d + dv) * e + n * bkq * 4 + 6 * bq * 4,
            "dkdv": 2 * 64 * (d + dv) * e + n * bqb * (d + dv) * e + n * bqb * 12 + 2 * 64 * 4,
        }
    return {
        "forward": 2 * bq * d * e + n * bk * (G * d + dv) * e + bq * d * 4 + n * bk * 4 + 3 * bq * 4,
        "dq": (2 * d + dv) * bq * e + n * bkq * (G * d + dv) * e + bq * bkq * 4 + n * bkq * 4 + 6 * bq * 4,
        "dkdv": (2 * d + dv) * 64 * e + n * bqb * (2 * d + dv) * e + 64 * bqb * _exchange_bytes(bs.dkdv, e) + n * bqb * 24 + 64 * 4,
    }


def diff_attention_pallas_gpu(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, tuning=None,
                              interpret=None, q_offset=None, window=None):
    """Fused differential attention on Hopper; same contract as diffjax.ops.diff_attention.
    tuning: a Tuning (or a tuple of its fields); default `default_tuning` for the shape.
    q_offset: the key position of query 0 under the causal mask (an int or a traced int32 scalar; default
    S - T): queries at q_offset + t, keys at 0 .. S - 1.
    window: None, or W: each query sees its W latest keys, itself included (causal only)."""
    why_not = unsupported(q_BTH2d, k_BSKGd, v_BSKv, tuning)
    if why_not:
        raise ValueError(f"diff_attention: impl='pallas_gpu' {why_not}")
    B, T, H = q_BTH2d.shape[:3]
    # lam rounded to the value dtype like the reference, then fp32; broadcasting to [B, T, H] makes
    # autodiff sum dlam for a scalar lambda.
    lam_BTH = jnp.broadcast_to(jnp.asarray(lam).astype(v_BSKv.dtype).astype(jnp.float32), (B, T, H))
    return _fused(q_BTH2d, k_BSKGd, v_BSKv, lam_BTH, False, causal, segment_ids, scale, tuning, interpret, q_offset,
                  window)


def dot_product_attention_pallas_gpu(q_BTNd, k_BSKd, v_BSKv, *, causal=True, segment_ids=None, scale=None, tuning=None,
                                     interpret=None, q_offset=None, window=None):
    """Fused standard attention on Hopper (the single-map mode of the same kernels: the two consumer
    warpgroups take two 64-row query tiles, or in dk/dv two 64-row kv tiles, sharing every streamed
    tile); same contract as diffjax.ops.dot_product_attention, segment ids included, with d and dv each in
    SINGLE_HEAD_DIMS. q_offset, window: as for diff_attention_pallas_gpu."""
    why_not = unsupported(q_BTNd, k_BSKd, v_BSKv, tuning)
    if why_not:
        raise ValueError(f"dot_product_attention: impl='pallas_gpu' {why_not}")
    return _fused(q_BTNd[:, :, :, None], k_BSKd[:, :, :, None], v_BSKv, None, True, causal, segment_ids, scale, tuning,
                  interpret, q_offset, window)


def _fused(q_BTHMd, k_BSKGd, v_BSKv, lam_BTH, single, causal, segment_ids, scale, tuning, interpret, q_offset, window):
    """Pad to the block sizes, run the custom-VJP kernels, crop: q with a map axis M (2, or 1 single)."""
    B, T, H, _, d = q_BTHMd.shape
    _, S, K, G, _ = k_BSKGd.shape
    bs = default_tuning(d, v_BSKv.shape[-1], G, q_BTHMd.dtype, single) if tuning is None else Tuning(*tuning)
    cta_q, cta_kv = (2 * bs.block_q, 128) if single else (bs.block_q, 64)
    Tp, Sp = _round_up(T, math.lcm(cta_q, bs.block_q_bwd)), _round_up(S, math.lcm(bs.block_k, bs.block_k_dq, cta_kv))
    lam_BHT = None if lam_BTH is None else _pad_axis(lam_BTH.transpose(0, 2, 1), 2, Tp)
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_ids, kv_ids = split_segment_ids(segment_ids, B, T, S)
        q_seg, kv_seg = _pad_axis(q_ids.astype(jnp.int32), 1, Tp), _pad_axis(kv_ids.astype(jnp.int32), 1, Sp)
    st = _Static(
        G=G, R=H // K, T=T, S=S, Sp=Sp, bq=bs.block_q, bk=bs.block_k, bk_dq=bs.block_k_dq, bq_bwd=bs.block_q_bwd, stages=bs.stages, pingpong=bool(bs.pingpong),
        causal=bool(causal), scale=float(d**-0.5 if scale is None else scale), has_seg=q_seg is not None,
        interpret=interpreted("gpu") if interpret is None else bool(interpret), single=single,
        traced_offset=bool(causal) and q_offset is not None, window=_window(window, causal), dkdv=bs.dkdv,
    )
    offset = jnp.full((1,), q_offset, jnp.int32) if st.traced_offset else None
    q = _pad_axis(q_BTHMd, 1, Tp)
    k = _pad_axis(k_BSKGd, 1, Sp)
    v = _pad_axis(v_BSKv, 1, Sp)
    o_BTHv = _flash(st, q, k, v, lam_BHT, q_seg, kv_seg, offset)
    return o_BTHv[:, :T]


def _window(window, causal):
    check_window(window, causal)
    return None if window is None else int(window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, lam, q_seg, kv_seg, offset):
    return _forward(st, q, k, v, lam, q_seg, kv_seg, offset, save_residuals=False)[0]


def _flash_fwd(st, q, k, v, lam, q_seg, kv_seg, offset):
    o, lse, *o2 = _forward(st, q, k, v, lam, q_seg, kv_seg, offset, save_residuals=True)
    # XLA's dynamic-slice fusion (jax 0.11) clones a custom call whose output is both used and written into a
    # slice (a scan's stack of saved residuals) so that the clone writes there in place: the forward kernel ran
    # once more per layer. o has both kinds of user, so it goes behind a barrier (one copy into the stack); lse and
    # O_2 have at most the stack, where the kernel then writes them in place.
    o = jax.lax.optimization_barrier(o)
    # Named here, on the values this backward reads, so that a remat policy keeping them (ops.names) saves them
    # instead of running the forward kernel again in the backward pass.
    o = checkpoint_name(o, OUTPUT_NAME)
    lse, *o2 = (checkpoint_name(x, KERNEL_RESIDUALS_NAME if st.single else DIFF_RESIDUALS_NAME) for x in (lse, *o2))
    return o, (q, k, v, lam, q_seg, kv_seg, offset, o, o2[0] if o2 else None, lse)


def _flash_bwd(st, res, do):
    q, k, v, lam, q_seg, kv_seg, offset, o, o2, lse = res
    do = do.astype(q.dtype)
    D_BHMT = _row_dots(do, o, o2, lam)
    dq = _dq(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D_BHMT)
    dk_BSKMd, dv = _dkdv(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D_BHMT)
    # differential with keys shared by both maps (G = 1): dK is the sum of the maps' slices
    dk = dk_BSKMd if st.M == st.G else dk_BSKMd.astype(jnp.float32).sum(axis=3, keepdims=True).astype(k.dtype)
    dlam = None if st.single else -D_BHMT[:, :, 1]
    return dq, dk, dv, dlam, None, None, None


def _row_dots(do_BTHv, o_BTHv, o2_BTHv, lam_BHT):
    """D_m = rowsum(dO * O_m) per map, [B, H, M, T] fp32 (dO as the kernels read it, in the value dtype). DIFF's first
    map O_1 = o + lam O_2 (from the rounded output) is never formed: D_1 = rowsum(dO * o) + lam D_2, both sums one
    reduction over dv of dO times the pair (o, O_2), which XLA runs as one pass over dO, o and O_2."""
    o_BTHMv = o_BTHv.astype(jnp.float32)[:, :, :, None]
    if o2_BTHv is not None:
        o_BTHMv = jnp.concatenate([o_BTHMv, o2_BTHv[:, :, :, None]], axis=3)
    D_BHMT = jnp.sum(do_BTHv.astype(jnp.float32)[:, :, :, None] * o_BTHMv, axis=-1).transpose(0, 2, 3, 1)
    if o2_BTHv is None:
        return D_BHMT
    return jnp.stack([D_BHMT[:, :, 0] + lam_BHT * D_BHMT[:, :, 1], D_BHMT[:, :, 1]], axis=2)


_flash.defvjp(_flash_fwd, _flash_bwd)
