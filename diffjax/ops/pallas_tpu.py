"""Fused flash-style Pallas TPU kernels for differential (and single-map) attention.

One pass over K/V blocks keeps M online-softmax states (M = 2 for differential attention, 1 for
the baseline), loads each K and V block once for both maps, and applies lambda in the epilogue:

    o = acc1 / l1 - lam * acc2 / l2

GQA: query head h reads kv head h // n_rep through the BlockSpec index map (no repeated K/V).
Causal: bottom-right aligned (query t sits at key position S - T + t, or q_offset + t when the caller places
the queries: a scalar-prefetch operand, so a traced offset costs no recompile); kv blocks above the
diagonal are skipped (no compute, and the index map clamps so no new DMA is issued). A sliding window
of W keys (query t sees positions S - T + t - W + 1 .. S - T + t) skips the kv blocks wholly behind it the
same way, so a windowed call costs T x W, not T x S.
Lengths that are not a multiple of the block size are zero-padded outside the kernel and the
padded keys are masked inside it. Fully masked rows (no key allowed) give o = 0 and zero grads.

Backward (custom VJP), with G the cotangent of o, dO_1 = G and dO_2 = -lam G:
    dP  = G V^T                                   one matmul shared by both maps
    dS1 = P1 * (dP - D1),  D1 = rowsum(G * O1)
    dS2 = -lam P2 * (dP - D2),  D2 = rowsum(G * O2)
    dV  = (P1 - lam P2)^T G                       one matmul for both maps
    dQi = scale dSi Ki,  dKi = scale dSi^T Qi
    dlam = -D2                                    (summed by autodiff for a scalar lambda)
Two kernels: dK/dV (grid over kv blocks, reducing over the n_rep query heads of the group and
the q blocks, so GQA gradients are summed in VMEM) and dQ (grid over q blocks). D1, D2 and dlam
are O(T dv) row reductions done by XLA before the kernels.

Kernel layout: q [B, H, M, T, d], k [B, Hkv, G, S, d], v [B, Hkv, S, dv], lam [B, H, T, 1] f32,
segment ids q [B, T, 1] / kv [B, 1, S] int32. Compiled for anything but a TPU (diffjax.ops.target) the kernels
run in Pallas interpret mode (slow; for tests). On a real TPU, block sizes must satisfy Mosaic's tiling
(block_q, block_k multiples of 128 are the safe choice; the defaults).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from diffjax.ops.reference import check_window, split_segment_ids
from diffjax.ops.target import compile_device, interpreted

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK - MASK) = 1, no inf - inf
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


class BlockSizes(NamedTuple):
    block_q: int = 128
    block_k: int = 128


def _interpret() -> bool:
    """Interpreted unless the call is compiled for a TPU (diffjax.ops.target: a TPU host, or a topology's device).
    Compiled for a topology's TPU with no abstract mesh to say which (one device: no shard_map), jax's Mosaic
    lowering would read the default device's generation ("Unsupported TPU device kind: cpu"): said here instead."""
    if interpreted("tpu"):
        return True
    if jax.sharding.get_abstract_mesh().abstract_device is None and jax.default_backend() != "tpu":
        raise ValueError(f"pallas_tpu: compiling for {compile_device().kind} on a {jax.default_backend()} machine "
                         "needs the device in the abstract mesh: lower and compile inside "
                         "diffjax.ops.aot.compile_for(target or mesh)")
    return False


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class _Static(NamedTuple):
    """Everything the kernels specialise on (hashable: passed as a nondiff custom_vjp arg)."""

    M: int  # maps: 2 differential, 1 standard
    G: int  # key groups: M, or 1 when the maps share keys
    R: int  # query heads per kv head
    T: int  # true query length
    S: int  # true key length
    bq: int
    bk: int
    causal: bool
    window: int | None  # sliding window: keys per query (causal only)
    scale: float
    has_seg: bool
    has_lam: bool
    interpret: bool


# ------------------------------------------------------------------------------------ helpers


def _mask(st: _Static, i, j, offset):
    """Boolean [bq, bk] mask for q block i and kv block j, or None when every entry is allowed. offset: the key
    position of query 0 (S - T unless the caller gave q_offset)."""
    need_pad = st.S % st.bk != 0
    if not (st.causal or need_pad):
        return None
    k_pos = j * st.bk + lax.broadcasted_iota(jnp.int32, (st.bq, st.bk), 1)
    mask = None
    if st.causal:
        q_pos = i * st.bq + lax.broadcasted_iota(jnp.int32, (st.bq, st.bk), 0) + offset
        mask = q_pos >= k_pos
        if st.window is not None:
            mask = mask & (q_pos - k_pos < st.window)
    if need_pad:
        valid = k_pos < st.S
        mask = valid if mask is None else mask & valid
    return mask


def _block_mask(st: _Static, r, i, j, offset):
    """_mask, and also same-segment pairs only when segment ids are given (None: all allowed)."""
    mask = _mask(st, i, j, offset)
    if not st.has_seg:
        return mask
    same = r["q_seg"][...] == r["kv_seg"][...]  # [bq, 1] == [1, bk]
    return same if mask is None else mask & same


def _block_needed(st: _Static, i, j, offset):
    """False when kv block j lies entirely above the causal diagonal of q block i, or entirely behind its
    sliding window."""
    if not st.causal:
        return True
    needed = j * st.bk <= i * st.bq + (st.bq - 1) + offset
    if st.window is not None:
        needed = needed & (j * st.bk + st.bk - 1 > i * st.bq + offset - st.window)
    return needed


def _last_kv_block(st: _Static, i, nk, offset):
    """Last kv block q block i needs (causal); used to clamp index maps so skipped blocks cost no DMA."""
    last = (i * st.bq + st.bq - 1 + offset) // st.bk
    return jnp.clip(last, 0, nk - 1)


def _first_kv_block(st: _Static, i, nk, offset):
    """First kv block q block i needs (0 without a window)."""
    if st.window is None:
        return 0
    first = (i * st.bq + offset - st.window + 1) // st.bk
    return jnp.clip(first, 0, nk - 1)


def _first_q_block(st: _Static, j, nq, offset):
    first = (j * st.bk - offset) // st.bq
    return jnp.clip(first, 0, nq - 1)


def _last_q_block(st: _Static, j, nq, offset):
    """Last q block that needs kv block j (the last without a window)."""
    if st.window is None:
        return nq - 1
    last = (j * st.bk + st.bk - 1 + st.window - 1 - offset) // st.bq
    return jnp.clip(last, 0, nq - 1)


def _split_refs(refs, names):
    return dict(zip(names, refs))


def _in_names(st: _Static, extra=()):
    names = ["q", "k", "v", *extra]
    if st.has_lam:
        names.append("lam")
    if st.has_seg:
        names += ["q_seg", "kv_seg"]
    return names


def _scores(st, q_ref, k_ref, m, mask):
    q = q_ref[m]
    k = k_ref[m if st.G == st.M else 0]
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * jnp.float32(st.scale)
    if mask is not None:
        s = jnp.where(mask, s, _MASK_VALUE)
    return s


def _compiler_params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


# ------------------------------------------------------------------------------------ forward


def _fwd_kernel(offset_ref, *refs, st: _Static, nk: int, save_residuals: bool):
    offset = offset_ref[0]
    n_in = len(_in_names(st))
    r = _split_refs(refs[:n_in], _in_names(st))
    outs = refs[n_in:]
    o_ref = outs[0]
    n_res = (st.M if save_residuals else 0)  # o2 (M = 2 only) and lse
    res_refs = outs[1 : 1 + n_res]
    m_scr, l_scr, acc_scr = outs[1 + n_res :]
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, _MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(_block_needed(st, i, j, offset))
    def _body():
        mask = _block_mask(st, r, i, j, offset)
        v = r["v"][...]
        for m in range(st.M):  # the V block is loaded once and used by every map
            s = _scores(st, r["q"], r["k"], m, mask)
            m_prev = m_scr[m]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(s - m_new)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)  # fully masked rows keep l = 0
            l_scr[m] = alpha * l_scr[m] + jnp.sum(p, axis=1, keepdims=True)
            acc_scr[m] = alpha * acc_scr[m] + lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            m_scr[m] = m_new

    @pl.when(j == nk - 1)
    def _epilogue():
        outs_m, lses = [], []
        for m in range(st.M):
            l = l_scr[m]
            empty = l == 0.0
            inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
            outs_m.append(acc_scr[m] * inv)
            lses.append(jnp.where(empty, jnp.inf, m_scr[m] + jnp.log(jnp.where(empty, 1.0, l))))
        if st.M == 2:
            lam = r["lam"][...] if st.has_lam else 1.0
            o = outs_m[0] - lam * outs_m[1]
        else:
            o = outs_m[0]
        o_ref[...] = o.astype(o_ref.dtype)
        if save_residuals:
            if st.M == 2:
                res_refs[0][...] = outs_m[1]
            res_refs[-1][...] = jnp.concatenate(lses, axis=1) if st.M == 2 else lses[0]


def _query_major_index_maps(st: _Static, nk: int):
    """Block index maps for a (B, H, q blocks, kv blocks) grid; causal grids re-use the last needed kv
    block past the diagonal (so skipped steps fetch nothing new)."""

    def q_index(b, h, i, j, offset_ref):
        return b, h, i

    def kv_index(b, h, i, j, offset_ref):
        if st.causal:
            offset = offset_ref[0]
            j = jnp.clip(j, _first_kv_block(st, i, nk, offset), _last_kv_block(st, i, nk, offset))
        return b, h // st.R, j

    return q_index, kv_index


def _specs(st: _Static, d: int, dv: int, q_index, kv_index, row_index):
    """BlockSpecs for q, k, v, lam, segment ids given index maps returning (b, h, q_blk), (b, kh, kv_blk)."""

    def q_map(*g):
        b, h, i = q_index(*g)
        return (b, h, 0, i, 0)

    def k_map(*g):
        b, kh, j = kv_index(*g)
        return (b, kh, 0, j, 0)

    def v_map(*g):
        b, kh, j = kv_index(*g)
        return (b, kh, j, 0)

    def row_map(*g):  # [B, H, T, X] arrays indexed like q
        b, h, i = q_index(*g)
        return (b, h, i, 0)

    specs = {
        "q": pl.BlockSpec((None, None, st.M, st.bq, d), q_map),
        "k": pl.BlockSpec((None, None, st.G, st.bk, d), k_map),
        "v": pl.BlockSpec((None, None, st.bk, dv), v_map),
        "lam": pl.BlockSpec((None, None, st.bq, 1), row_map),
        "q_seg": pl.BlockSpec((None, st.bq, 1), lambda *g: (q_index(*g)[0], q_index(*g)[2], 0)),
        "kv_seg": pl.BlockSpec((None, 1, st.bk), lambda *g: (kv_index(*g)[0], 0, kv_index(*g)[2])),
        "row_M": pl.BlockSpec((None, None, st.bq, st.M), row_map),
        "row_dv": pl.BlockSpec((None, None, st.bq, dv), row_map),
    }
    return specs


def _forward(st: _Static, q, k, v, lam, q_seg, kv_seg, offset, *, save_residuals: bool):
    B, H, M, Tp, d = q.shape
    Sp, dv = k.shape[3], v.shape[-1]
    nq, nk = Tp // st.bq, Sp // st.bk

    q_index, kv_index = _query_major_index_maps(st, nk)
    sp = _specs(st, d, dv, q_index, kv_index, None)
    names = _in_names(st)
    args = {"q": q, "k": k, "v": v, "lam": lam, "q_seg": q_seg, "kv_seg": kv_seg}
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, dv), q.dtype)]
    out_specs = [sp["row_dv"]]
    if save_residuals:
        if M == 2:  # o2 in fp32: D2 = rowsum(dO * o2) and dlam = -D2 in the backward
            out_shape.append(jax.ShapeDtypeStruct((B, H, Tp, dv), jnp.float32))
            out_specs.append(sp["row_dv"])
        out_shape.append(jax.ShapeDtypeStruct((B, H, Tp, M), jnp.float32))  # log-sum-exp per map
        out_specs.append(sp["row_M"])
    kernel = functools.partial(_fwd_kernel, st=st, nk=nk, save_residuals=save_residuals)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, H, nq, nk),
            in_specs=[sp[n] for n in names],
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((M, st.bq, 1), jnp.float32),
                pltpu.VMEM((M, st.bq, 1), jnp.float32),
                pltpu.VMEM((M, st.bq, dv), jnp.float32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=st.interpret,
        name=f"diffjax_flash_fwd_m{M}",
    )(offset, *[args[n] for n in names])
    return outs


# ------------------------------------------------------------------------------------ backward


def _bwd_common(st: _Static, r, mask, dP, m):
    """P_m and dS_m (fp32, [bq, bk]) for map m from the saved log-sum-exps and row sums."""
    s = _scores(st, r["q"], r["k"], m, mask)
    lse = r["lse"][...][:, m : m + 1]
    p = jnp.exp(s - lse)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    ds = p * (dP - r["D"][...][:, m : m + 1])
    if m == 1:
        lam = r["lam"][...] if st.has_lam else 1.0
        ds = -lam * ds
        p = -lam * p  # P2's contribution to dV carries -lam
    return p, ds


def _dq_kernel(offset_ref, *refs, st: _Static, nk: int):
    offset = offset_ref[0]
    names = _in_names(st, extra=("do", "lse", "D"))
    r = _split_refs(refs[: len(names)], names)
    dq_ref, dq_scr = refs[len(names)], refs[len(names) + 1]
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when(_block_needed(st, i, j, offset))
    def _body():
        mask = _block_mask(st, r, i, j, offset)
        do = r["do"][...]
        dP = lax.dot_general(do, r["v"][...], _NT, preferred_element_type=jnp.float32)  # shared by both maps
        for m in range(st.M):
            _, ds = _bwd_common(st, r, mask, dP, m)
            k = r["k"][m if st.G == st.M else 0]
            dq_scr[m] += lax.dot_general(
                ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )

    @pl.when(j == nk - 1)
    def _write():
        dq_ref[...] = (dq_scr[...] * jnp.float32(st.scale)).astype(dq_ref.dtype)


def _dkv_kernel(offset_ref, *refs, st: _Static, nq: int):
    offset = offset_ref[0]
    names = _in_names(st, extra=("do", "lse", "D"))
    r = _split_refs(refs[: len(names)], names)
    dk_ref, dv_ref, dk_scr, dv_scr = refs[len(names) :]
    j, rep, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((rep == 0) & (i == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(_block_needed(st, i, j, offset))
    def _body():
        mask = _block_mask(st, r, i, j, offset)
        do = r["do"][...]
        dP = lax.dot_general(do, r["v"][...], _NT, preferred_element_type=jnp.float32)
        p_combined = None
        for m in range(st.M):
            p, ds = _bwd_common(st, r, mask, dP, m)
            q = r["q"][m]
            g = m if st.G == st.M else 0
            dk_scr[g] += lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)
            p_combined = p if p_combined is None else p_combined + p
        # dV = (P1 - lam P2)^T dO: one matmul for both maps
        dv_scr[...] += lax.dot_general(p_combined.astype(do.dtype), do, _TN, preferred_element_type=jnp.float32)

    @pl.when((rep == st.R - 1) & (i == nq - 1))
    def _write():
        dk_ref[...] = (dk_scr[...] * jnp.float32(st.scale)).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward(st: _Static, q, k, v, lam, q_seg, kv_seg, offset, o, o2, lse, do):
    B, H, M, Tp, d = q.shape
    K, G, Sp, dv = k.shape[1], k.shape[2], k.shape[3], v.shape[-1]
    nq, nk = Tp // st.bq, Sp // st.bk
    do = do.astype(q.dtype)
    do32 = do.astype(jnp.float32)
    if M == 2:
        lam_f = lam if st.has_lam else 1.0
        o2 = o2.astype(jnp.float32)
        o1 = o.astype(jnp.float32) + lam_f * o2
        D2 = jnp.sum(do32 * o2, axis=-1, keepdims=True)
        D = jnp.concatenate([jnp.sum(do32 * o1, axis=-1, keepdims=True), D2], axis=-1)
        dlam = -D2 if st.has_lam else None
    else:
        D = jnp.sum(do32 * o.astype(jnp.float32), axis=-1, keepdims=True)
        dlam = None
    names = _in_names(st, extra=("do", "lse", "D"))
    args = {"q": q, "k": k, "v": v, "lam": lam, "q_seg": q_seg, "kv_seg": kv_seg, "do": do, "lse": lse, "D": D}

    # dQ: grid (B, H, q blocks, kv blocks)
    q_index, kv_index = _query_major_index_maps(st, nk)
    sp = _specs(st, d, dv, q_index, kv_index, None)
    in_specs = {**sp, "do": sp["row_dv"], "lse": sp["row_M"], "D": sp["row_M"]}
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, nk=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, H, nq, nk),
            in_specs=[in_specs[n] for n in names],
            out_specs=sp["q"],
            scratch_shapes=[pltpu.VMEM((M, st.bq, d), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=st.interpret,
        name=f"diffjax_flash_bwd_dq_m{M}",
    )(offset, *[args[n] for n in names])

    # dK, dV: grid (B, Hkv, kv blocks, n_rep, q blocks); the last two reduce into VMEM scratch
    def q_index2(b, kh, j, rep, i, offset_ref):
        if st.causal:
            offset = offset_ref[0]
            i = jnp.clip(i, _first_q_block(st, j, nq, offset), _last_q_block(st, j, nq, offset))
        return b, kh * st.R + rep, i

    def kv_index2(b, kh, j, rep, i, offset_ref):
        return b, kh, j

    sp2 = _specs(st, d, dv, q_index2, kv_index2, None)
    in_specs2 = {**sp2, "do": sp2["row_dv"], "lse": sp2["row_M"], "D": sp2["row_M"]}
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, nq=nq),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, K, nk, st.R, nq),
            in_specs=[in_specs2[n] for n in names],
            out_specs=[sp2["k"], sp2["v"]],
            scratch_shapes=[pltpu.VMEM((G, st.bk, d), jnp.float32), pltpu.VMEM((st.bk, dv), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=st.interpret,
        name=f"diffjax_flash_bwd_dkv_m{M}",
    )(offset, *[args[n] for n in names])
    return dq, dk, dv_, dlam


# ------------------------------------------------------------------------------------ custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, lam, q_seg, kv_seg, offset):
    return _forward(st, q, k, v, lam, q_seg, kv_seg, offset, save_residuals=False)[0]


def _flash_fwd(st, q, k, v, lam, q_seg, kv_seg, offset):
    outs = _forward(st, q, k, v, lam, q_seg, kv_seg, offset, save_residuals=True)
    o, lse = outs[0], outs[-1]
    o2 = outs[1] if st.M == 2 else None
    return o, (q, k, v, lam, q_seg, kv_seg, offset, o, o2, lse)


def _flash_bwd(st, res, do):
    q, k, v, lam, q_seg, kv_seg, offset, o, o2, lse = res
    dq, dk, dv, dlam = _backward(st, q, k, v, lam, q_seg, kv_seg, offset, o, o2, lse, do)
    return dq, dk, dv, dlam, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------ public


def _segments(segment_ids, B, T, S, Tp, Sp):
    if segment_ids is None:
        return None, None
    q_ids, kv_ids = split_segment_ids(segment_ids, B, T, S)
    q_ids = jnp.pad(q_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)))[:, :, None]
    kv_ids = jnp.pad(kv_ids.astype(jnp.int32), ((0, 0), (0, Sp - S)))[:, None, :]
    return q_ids, kv_ids


def _blocks(block_sizes, T, S, dtype):
    bs = BlockSizes() if block_sizes is None else BlockSizes(*block_sizes)
    sub = 16 if jnp.dtype(dtype).itemsize < 4 else 8  # sublane tiling; a block never exceeds the padded length
    return min(bs.block_q, _round_up(T, sub)), min(bs.block_k, _round_up(S, sub))


def _window(window, causal):
    check_window(window, causal)
    return None if window is None else int(window)


def _check(name, q, k, v, d, dk_, H, K):
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name} (impl='pallas_tpu'): q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d != dk_:
        raise ValueError(f"{name} (impl='pallas_tpu'): q and k head dims differ ({d} vs {dk_})")
    if H % K:
        raise ValueError(f"{name} (impl='pallas_tpu'): query heads ({H}) must be a multiple of kv heads ({K})")


def _offset(q_offset, T, S):
    """[1] int32: the key position of query 0 (the kernels' scalar-prefetch operand): S - T (causal alignment
    bottom-right) unless given, e.g. a context-parallel device's query chunk at a traced place in the sequence."""
    return jnp.full((1,), S - T if q_offset is None else q_offset, jnp.int32)


def diff_attention_pallas(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, block_sizes=None,
                          interpret=None, window=None, q_offset=None):
    """Fused differential attention; same contract as diffjax.ops.diff_attention. q_offset: the key position of
    query 0 (an int or a traced int32 scalar; default S - T): queries at q_offset + t, keys at 0 .. S - 1."""
    B, T, H, two, d = q_BTH2d.shape
    _, S, K, G, dk_ = k_BSKGd.shape
    if two != 2 or G not in (1, 2):
        raise ValueError(f"diff_attention (impl='pallas_tpu'): q must be [B, T, H, 2, d] and k [B, S, Hkv, 1 or 2, d], got {q_BTH2d.shape} and {k_BSKGd.shape}")
    _check("diff_attention", q_BTH2d, k_BSKGd, v_BSKv, d, dk_, H, K)
    bq, bk = _blocks(block_sizes, T, S, q_BTH2d.dtype)
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)
    # lam rounded to the value dtype like the reference, then fp32 in the kernel; broadcasting it to
    # [B, T, H] makes autodiff sum dlam for a scalar lambda.
    lam_BTH = jnp.broadcast_to(jnp.asarray(lam).astype(v_BSKv.dtype).astype(jnp.float32), (B, T, H))
    lam_BHT1 = jnp.pad(lam_BTH.transpose(0, 2, 1), ((0, 0), (0, 0), (0, Tp - T)))[..., None]
    q = jnp.pad(q_BTH2d.transpose(0, 2, 3, 1, 4), ((0, 0),) * 3 + ((0, Tp - T), (0, 0)))
    k = jnp.pad(k_BSKGd.transpose(0, 2, 3, 1, 4), ((0, 0),) * 3 + ((0, Sp - S), (0, 0)))
    v = jnp.pad(v_BSKv.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
    q_seg, kv_seg = _segments(segment_ids, B, T, S, Tp, Sp)
    st = _Static(
        M=2, G=G, R=H // K, T=T, S=S, bq=bq, bk=bk, causal=bool(causal), window=_window(window, causal),
        scale=float(d**-0.5 if scale is None else scale), has_seg=q_seg is not None, has_lam=True,
        interpret=_interpret() if interpret is None else bool(interpret),
    )
    o_BHTv = _flash(st, q, k, v, lam_BHT1, q_seg, kv_seg, _offset(q_offset, T, S))
    return o_BHTv[:, :, :T].transpose(0, 2, 1, 3)


def dot_product_attention_pallas(q_BTNd, k_BSKd, v_BSKv, *, causal=True, segment_ids=None, scale=None, block_sizes=None,
                                 interpret=None, window=None, q_offset=None):
    """Single-map flash attention with the same kernels (M = 1): the baseline's flash path. q_offset: as for
    diff_attention_pallas."""
    B, T, N, d = q_BTNd.shape
    _, S, K, dk_ = k_BSKd.shape
    _check("dot_product_attention", q_BTNd, k_BSKd, v_BSKv, d, dk_, N, K)
    bq, bk = _blocks(block_sizes, T, S, q_BTNd.dtype)
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)
    q = jnp.pad(q_BTNd.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))[:, :, None]
    k = jnp.pad(k_BSKd.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))[:, :, None]
    v = jnp.pad(v_BSKv.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
    q_seg, kv_seg = _segments(segment_ids, B, T, S, Tp, Sp)
    st = _Static(
        M=1, G=1, R=N // K, T=T, S=S, bq=bq, bk=bk, causal=bool(causal), window=_window(window, causal),
        scale=float(d**-0.5 if scale is None else scale), has_seg=q_seg is not None, has_lam=False,
        interpret=_interpret() if interpret is None else bool(interpret),
    )
    o_BNTv = _flash(st, q, k, v, None, q_seg, kv_seg, _offset(q_offset, T, S))
    return o_BNTv[:, :, :T].transpose(0, 2, 1, 3)
