"""The backward's dk/dv kernel: one CTA per (batch, kv head, kv block), streaming (query head, query block) tiles."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.ops.pallas_gpu.common import (
    WGMMA,
    _args,
    _cols,
    _copy_query_rows,
    _exchange_sum,
    _in_refs,
    _launch,
    _name,
    _Ops,
    _producer_loop,
    _q_steps,
    _query_copies,
    _query_offset,
    _rendezvous,
    _run_steps,
    _score_mask,
    _set_registers,
    _Static,
    _tiled,
    _traced_indices,
    _transposed,
)

SUB = 64  # query rows of a single-map dk/dv sub-tile (one wgmma N tile of S^T, one contraction tile of dK and dV)
BK = 64  # kv rows of a consumer's dK / dV tiles


class _Smem(NamedTuple):
    """The kernel's SMEM scratch (None where a mode or schedule has no use for it)."""

    k: Any  # [2, BK, d]: K (a map's, or single: a consumer's rows), then dK's staging
    v: Any  # [2, BK, dvt]: V (a column half, or a consumer's rows), then dV's staging
    kvseg: Any  # [tiles, BK] kv segment ids
    q: Any  # ring [stages, tiles, bq_bwd, d]: the streamed query tiles (both maps, or the block's rows)
    do: Any  # ring [stages, tiles, bq_bwd, dvt]: dO (column halves, or whole)
    lse: Any  # ring [stages, tiles, bq_bwd]
    D: Any  # ring [stages, tiles, bq_bwd]
    lam: Any  # ring [stages, bq_bwd] (differential)
    qseg: Any  # ring [stages, 1, bq_bwd] query segment ids
    x_dp: Any  # [BK, bq_bwd] fp32: the dP halves' sum (exchange, lean)
    x_p: Any  # the P shares (differential): one [BK, bq_bwd] buffer, or one per consumer (whole dP)
    pos: Any  # [2, SUB] (single): 0 .. SUB - 1, the query positions of a sub-tile, a table per consumer


class _Barriers(NamedTuple):
    kv_ready: Any  # K, V and their segment ids are in SMEM
    q_ready: Any  # per ring slot: the producer's copies landed
    q_free: Any  # per ring slot: both consumers are done with it
    xbar: Any  # the consumers' meetings
    p_free: Any  # whole dP: both consumers are done with the last P shares (else None)


class _Consumer(NamedTuple):
    """What a consumer's step reads besides its ring slot and query block."""

    st: _Static
    ops: _Ops
    g: int  # the consumer: a map (differential) or its 64 kv rows of the CTA's 128 (single)
    smem: _Smem
    bars: _Barriers
    offset: Any  # the key position of query 0
    k0: Any  # the CTA's first kv row
    kv_seg: Any  # the consumer's kv segment ids (column layout), or None

    def col(self, ref):
        """A per-query vector from SMEM, broadcast over a (BK, bq_bwd) tile."""
        return _cols(self.ops.load(ref, WGMMA.reduce(0)), (BK, self.st.bq_bwd))

    def traced(self, ref):
        """ref, when a dK / dV run_state closes over it: its static indices traced outside (`_traced_indices`)."""
        return ref if self.ops.interpret else _traced_indices(ref)

    def mask(self, slot, i, masked: bool | str, shape):
        """The transposed mask (True = allowed; None: none) of query block i's tile in ring slot `slot` against the
        CTA's kv rows, for what `masked` asks (`_masking`)."""
        st = self.st
        q_seg = self.ops.load(self.smem.qseg.at[slot, 0], WGMMA.reduce(0)) if st.has_seg else None
        return _score_mask(self.ops, _masking(st, masked), self.offset, shape, i * st.bq_bwd, self.k0, q_seg, self.kv_seg,
                           transposed=True)


def _masking(st: _Static, masked: bool | str) -> _Static:
    """The configuration `_score_mask` masks by for a step's `masked`: True, the whole mask; "segments" (where the
    positions see every pair), segment ids and padding only."""
    return st if masked is True else st._replace(causal=False, window=None)


def _masked(sT, mask):
    return sT if mask is None else jnp.where(mask, sT, -jnp.inf)


def _dkdv(st: _Static, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D):
    """dk [B, Sp, K, M, d] and dv [B, Sp, K, dv]: one CTA per (batch, kv head, kv block), streaming
    (query head of the group, q block) tiles. Differential: 64 kv rows, consumer g accumulates dK_g
    and the g-th column half of dV in the schedule Tuning.dkdv names (`_SCHEDULES`); single: 128 kv rows,
    consumer g owns dK and dV of the g-th 64 (`_single_step`)."""
    B, Tp, H, _, d = q.shape
    Sp, K, dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = q.dtype
    bqb, stages, G, R = st.bq_bwd, st.stages, st.G, st.R
    dvt = dv if st.single else dv // 2  # each consumer's dV columns
    tiles = 1 if st.single else 2  # streamed query tiles per step: the block's rows, or both maps
    nq = Tp // bqb
    ops = _Ops(st.interpret)
    schedule = _single_step if st.single else _SCHEDULES[st.dkdv]
    # each consumer computes the whole dP; the P shares then meet in SMEM, a buffer per consumer guarded by p_free
    whole_dp = not st.single and st.dkdv in ("dp_whole", "dv_smem")

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref, qseg_ref, kvseg_ref, offset_ref = _in_refs(st, it)
        do_ref, lse_ref, D_ref, dk_ref, dv_ref = next(it), next(it), next(it), next(it), next(it)
        smem, bars = _Smem(*next(it)), _Barriers(*next(it))

        b, kh, j = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("kv_blocks")
        k0 = j * st.cta_kv
        wg = lax.axis_index("wg")
        offset = _query_offset(st, offset_ref)
        ring = _q_steps(st, offset, k0, st.cta_kv, nq)  # per query head of the group
        first, per_rep = ring.first, ring.end - ring.first
        steps = R * per_rep

        def kv_rows(g: int):  # (map, first kv row) of consumer g's K / V tiles
            return (0, k0 + g * BK) if st.single else (g, k0)

        @pl.when(wg == 2)
        def _producer():
            _registers(st, producer=True)
            if st.single:
                for g in range(2):
                    keys = pl.ds(kv_rows(g)[1], BK)
                    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, 0], smem.k.at[g], bars.kv_ready)
                    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], smem.v.at[g], bars.kv_ready)
            else:
                keys = pl.ds(k0, BK)
                for g in range(G):
                    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, g], smem.k.at[g], bars.kv_ready)
                for c in range(2):
                    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh, pl.ds(c * dvt, dvt)], smem.v.at[c], bars.kv_ready)
            if st.has_seg:
                for g in range(smem.kvseg.shape[0]):
                    plgpu.copy_gmem_to_smem(kvseg_ref.at[b, pl.ds(kv_rows(g)[1], BK)], smem.kvseg.at[g], bars.kv_ready)

            def load(step, slot):
                h = kh * R + lax.div(step, per_rep)
                r0 = (first + lax.rem(step, per_rep)) * bqb
                slots = [None if ref is None else ref.at[slot] for ref in (smem.q, smem.do, smem.lse, smem.D, smem.lam, smem.qseg)]
                _copy_query_rows(st, (q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref), slots, b, h, r0, bars.q_ready.at[slot])

            _producer_loop(steps, stages, bars.q_free, load)

        def consumer(g: int):
            _registers(st, producer=False)
            plgpu.barrier_wait(bars.kv_ready)
            if whole_dp:
                plgpu.barrier_arrive(bars.p_free)  # the first shares overwrite nothing
            m, k0_g = kv_rows(g)
            if st.single:  # the query positions of a sub-tile, for its masks (read back by the threads that wrote them)
                smem.pos.at[g][...] = ops.iota((SUB,), 0, WGMMA.reduce(0))
            own = _q_steps(st, offset, k0_g, BK, nq)
            kv_seg = ops.load(smem.kvseg.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None
            me = _Consumer(st, ops, g, smem, bars, offset, k0, kv_seg)
            # with segment ids: the causal / window mask only where the rows' positions need it (fewer values live in
            # the other steps, and ptxas spills fewer); segment ids and padding on every step. Not in the exchange
            # schedule, the sweep's baseline.
            segments_apart = st.has_seg and (st.single or st.dkdv != "exchange")
            by_position = _q_steps(st._replace(has_seg=False), offset, k0_g, BK, nq) if segments_apart else own

            def rep_body(rep, carry):
                def body(i, carry, masked):  # one streamed q step: query head kh R + rep, q block i
                    slot = lax.rem(rep * per_rep + i - first, jnp.int32(stages))
                    plgpu.barrier_wait(bars.q_ready.at[slot])
                    carry = schedule(me, slot, i, carry, masked)
                    plgpu.barrier_arrive(bars.q_free.at[slot])
                    return carry

                if by_position is own:
                    return _run_steps(body, ring, own, carry)
                return _run_steps(body, ring, by_position, carry, unmasked="segments")

            dk_acc, dv_acc = lax.fori_loop(0, R, rep_body, (ops.full((BK, d), 0.0), ops.full((BK, dvt), 0.0)))
            if whole_dp:
                plgpu.barrier_wait(bars.p_free)  # its last phase: every waiter observes every phase
            _rendezvous(bars.xbar)  # both consumers are done with k and v: stage the results there
            smem.k.at[g][...] = (dk_acc * st.scale).astype(dtype)
            smem.v.at[g][...] = dv_acc.astype(dtype)
            plgpu.commit_smem()
            keys = pl.ds(k0_g, BK)
            plgpu.copy_smem_to_gmem(smem.k.at[g], dk_ref.at[b, keys, kh, m])
            plgpu.copy_smem_to_gmem(smem.v.at[g], dv_ref.at[b, keys, kh, pl.ds(0 if st.single else g * dvt, dvt)])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: consumer(0))
        pl.when(wg == 1)(lambda: consumer(1))

    qk_tf, vt_tf = _tiled(d, dtype), _tiled(dvt, dtype)
    x_tf = _tiled(bqb, jnp.float32)
    smem = _Smem(
        k=plgpu.SMEM((2, BK, d), dtype, transforms=qk_tf),
        v=plgpu.SMEM((2, BK, dvt), dtype, transforms=vt_tf),
        kvseg=plgpu.SMEM((2 if st.single else 1, BK), jnp.int32) if st.has_seg else None,
        q=plgpu.SMEM((stages, tiles, bqb, d), dtype, transforms=qk_tf),
        do=plgpu.SMEM((stages, tiles, bqb, dvt), dtype, transforms=vt_tf),
        lse=plgpu.SMEM((stages, tiles, bqb), jnp.float32),
        D=plgpu.SMEM((stages, tiles, bqb), jnp.float32),
        lam=None if st.single else plgpu.SMEM((stages, bqb), jnp.float32),
        qseg=plgpu.SMEM((stages, 1, bqb), jnp.int32) if st.has_seg else None,
        x_dp=None if st.single or whole_dp else plgpu.SMEM((BK, bqb), jnp.float32, transforms=x_tf),
        # P shares, rounded for the dV wgmma anyway: one buffer that consumer 1 sums into, or one per consumer (whole dP;
        # dv_smem: the dV wgmmas' lhs, whose swizzle must match dO's)
        x_p=None if st.single else plgpu.SMEM((2, BK, bqb) if whole_dp else (BK, bqb), dtype, transforms=_tiled(min(bqb, dvt) if whole_dp else bqb, dtype)),
        pos=plgpu.SMEM((2, SUB), jnp.int32) if st.single else None,
    )
    kv_copies = 4 + 2 * st.has_seg if st.single else G + 2 + st.has_seg
    barriers = _Barriers(
        kv_ready=plgpu.Barrier(num_arrivals=kv_copies),
        q_ready=plgpu.Barrier(num_arrivals=_query_copies(st, tiles), num_barriers=stages),
        q_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        xbar=plgpu.Barrier(num_arrivals=2),
        p_free=plgpu.Barrier(num_arrivals=2) if whole_dp else None,
    )
    out_type = [jax.ShapeDtypeStruct((B, Sp, K, st.M, d), dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    grid = (K, Sp // st.cta_kv, B)
    return _launch(st, kernel, out_type, (tuple(smem), tuple(barriers)), grid, ("kv_heads", "kv_blocks", "batch"), _name(st, "bwd_dkdv"))(*_args(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D))


# ------------------------------------------------------------------------------ the consumers' steps
# Each runs one streamed q step, schedule(consumer, slot, i, (dK, dV), masked) -> (dK, dV), between the kernel's wait for
# the slot and its release: ring slot `slot` holds query block i's tiles.


def _diff_scores(me: _Consumer, slot, i, masked: bool | str, halves):
    """(P^T, dP^T) of differential consumer g's step: S^T = K_g Q_g^T masked, P^T = exp2(S^T scale2 - lse_g), and dP^T =
    the sum of V_c dO_c^T over the dv column halves c in `halves` (this consumer's, or both: the whole dP)."""
    s, g = me.smem, me.g
    q_t = s.q.at[slot, g]
    pairs = [(s.v.at[c], s.do.at[slot, c]) for c in halves]
    sT, dpT = _scores(me.ops, s.k.at[g if me.st.G == 2 else 0], q_t, pairs, (BK, me.st.bq_bwd))
    sT = sT * me.st.scale2
    if masked:
        sT = _masked(sT, me.mask(slot, i, masked, sT.shape))
    return jnp.exp2(sT - me.col(s.lse.at[slot, g])), dpT


def _diff_ds(me: _Consumer, slot, pT, dpT):
    """(dS^T in the input dtype, this map's share of P_1 - lam P_2): dS_1 = P_1 (dP - D_1), dS_2 = -lam P_2 (dP - D_2)."""
    s, g = me.smem, me.g
    dsT = pT * (dpT - me.col(s.D.at[slot, g]))
    if g == 1:
        dsT = dsT * -me.col(s.lam.at[slot])
    dsT = dsT.astype(s.q.dtype)
    return dsT, pT if g == 0 else pT * -me.col(s.lam.at[slot])


def _lean_step(me: _Consumer, slot, i, carry, masked: bool | str):
    """lean (the default): the exchange's algebra, SMEM and two meetings a step, every value made where it is used so
    that the live set stays small next to the two fp32 accumulators: S^T and this consumer's dP^T half, P^T; consumer 0
    writes its dP half and P_1, consumer 1 adds its dP half and writes the sum back (asymmetric as `_exchange_sum`: 0
    writes, 1 adds, 0 reads); dS^T; the dK wgmma, and while it runs consumer 1 adds its -lam P_2 to P_1
    (`_p_share_exchange`) and they meet again; then the dV wgmma; one wait for both."""
    s, ops, xbar = me.smem, me.ops, me.bars.xbar
    pT, dpT = _diff_scores(me, slot, i, masked, [me.g])
    if me.g == 0:
        s.x_dp[...] = dpT
        s.x_p[...] = pT.astype(s.x_p.dtype)  # P_1, map 1's share of P_1 - lam P_2, for consumer 1 to add to
        _rendezvous(xbar)
        _rendezvous(xbar)  # consumer 1 has summed both
        dpT = ops.load(s.x_dp, WGMMA)
    else:
        _rendezvous(xbar)
        dpT = dpT + ops.load(s.x_dp, WGMMA)
        s.x_dp[...] = dpT
    dsT, share = _diff_ds(me, slot, pT, dpT)
    p_shares = functools.partial(_p_share_exchange, ops, me.g, share, s.x_p, xbar, me.traced(s.do.at[slot, me.g]))
    return _dk_then_dv(ops, *carry, dsT, s.q.at[slot, me.g], p_shares)


def _dp_whole_step(me: _Consumer, slot, i, carry, masked: bool | str, from_smem: bool = False):
    """dp_whole: each consumer computes the whole dP (both dv halves: +25% FLOPs a step), so only the P shares meet:
    each writes its 16-bit share to its own buffer and they meet once (`_p_share_swap`); the dK wgmma runs meanwhile.
    from_smem: the dV wgmmas read both shares from SMEM (dv_smem)."""
    s, dtype = me.smem, me.smem.q.dtype
    pT, dpT = _diff_scores(me, slot, i, masked, [0, 1])
    dsT, share = _diff_ds(me, slot, pT, dpT)
    buffers = (me.traced(s.x_p.at[0]), me.traced(s.x_p.at[1]))
    p_shares = functools.partial(_p_share_swap, me.ops, me.g, share.astype(dtype), buffers, me.bars.xbar, me.bars.p_free,
                                 me.traced(s.do.at[slot, me.g]), from_smem)
    return _dk_then_dv(me.ops, *carry, dsT, s.q.at[slot, me.g], p_shares)


def _dv_smem_step(me: _Consumer, slot, i, carry, masked: bool | str):
    """dv_smem: dp_whole whose dV takes both P shares straight from SMEM (two wgmmas: +50% FLOPs a step, no P sum in
    registers; the most exact dV), so a share buffer is free only once both dV wgmmas have read it."""
    carry = _dp_whole_step(me, slot, i, carry, masked, from_smem=True)
    plgpu.barrier_arrive(me.bars.p_free)
    return carry


def _exchange_step(me: _Consumer, slot, i, carry, masked: bool):
    """exchange: the first differential schedule, kept as the sweep's baseline (it spills: the package docstring):
    per-query vectors loaded up front, the dP half and the P share summed at once through `_exchange_sum`."""
    st, ops, s, g = me.st, me.ops, me.smem, me.g
    shape = (BK, st.bq_bwd)
    dk_acc, dv_acc = carry
    cols = lambda ref: ops.load(ref, WGMMA.reduce(0))  # noqa: E731
    lse_t, D_t = cols(s.lse.at[slot, g]), cols(s.D.at[slot, g])
    q_t, do_t = s.q.at[slot, g], s.do.at[slot, g]
    # S^T and this consumer's part of dP^T = V dO^T are independent: one wait for both wgmmas.
    sT, dpT = ops.matmuls((s.k.at[g if st.G == 2 else 0], q_t, shape, True), (s.v.at[g], do_t, shape, True))
    sT = sT * st.scale2
    if masked:
        sT = _masked(sT, me.mask(slot, i, masked, shape))
    pT = jnp.exp2(sT - _cols(lse_t, shape))
    neg_lam = _cols(-cols(s.lam.at[slot]), shape)
    cpT = pT if g == 0 else pT * neg_lam  # this map's share of P_1 - lam P_2
    dpT, pcT = _exchange_sum(ops, g, [(s.x_dp, dpT), (s.x_p, cpT)], me.bars.xbar)
    dsT = pT * (dpT - _cols(D_t, shape))
    if g == 1:
        dsT = dsT * neg_lam
    dk_acc = ops.matmul(dsT.astype(s.q.dtype), q_t, None, acc=dk_acc)
    dv_acc = ops.matmul(pcT.astype(s.q.dtype), do_t, None, acc=dv_acc)
    return dk_acc, dv_acc


# Tuning.dkdv -> the differential consumers' step
_SCHEDULES = {"lean": _lean_step, "dp_whole": _dp_whole_step, "dv_smem": _dv_smem_step, "exchange": _exchange_step}


def _single_step(me: _Consumer, slot, i, carry, masked: bool | str):
    """One q step of single-map consumer g (its 64 kv rows) in SUB-row query sub-tiles, a loop (not unrolled) when
    block_q_bwd is larger: whatever the block, the step's live set beside dK and dV is one sub-tile's
    (`_single_sub_tile`)."""
    s, g, bqb = me.smem, me.g, me.st.bq_bwd

    def sub_tile(h, carry):
        rows = pl.ds(h * SUB, SUB)
        vec = lambda ref: me.ops.load(ref.at[slot, 0, rows], WGMMA.reduce(0))  # noqa: E731 (a per-query vector)
        mask = lambda: _score_mask(  # noqa: E731 (made once S^T is there, from vectors loaded then)
            me.ops, _masking(me.st, masked), me.offset, (BK, SUB), i * bqb + h * SUB, me.k0 + g * BK,
            vec(s.qseg) if me.st.has_seg else None, me.kv_seg, transposed=True, q_iota=me.ops.load(s.pos.at[g], WGMMA.reduce(0)))
        tiles = (s.k.at[g], s.v.at[g], s.q.at[slot, 0, rows], s.do.at[slot, 0, rows])
        col = lambda ref: _cols(vec(ref), (BK, SUB))  # noqa: E731
        return _single_sub_tile(me.ops, me.st, carry, tiles, mask if masked else None, col, s.lse, s.D)

    return sub_tile(0, carry) if bqb == SUB else lax.fori_loop(0, bqb // SUB, sub_tile, carry)


def _registers(st: _Static, producer: bool):
    """setmaxnreg for the dk/dv warpgroups. The lean family and the single-map step give the consumers 240 registers
    and the producer 24 (FA3's split for two consumer warpgroups; 24 + 2 x 240 = 504 of the 512 a thread of each
    warpgroup may hold): ptxas compiles the producer's TMA loop at 24 without spilling more than at 40, and each
    consumer's step keeps its two fp32 accumulators (128 registers; single-map d 192 / dv 128: 160) beside 64 x 64
    (single) or 64 x bqb (differential) fp32 tiles. The differential "exchange" keeps 40 / 232."""
    _set_registers(st, producer, 232 if not st.single and st.dkdv == "exchange" else 240)


def _exchange_bytes(dkdv: str, e: int) -> int:
    """Bytes per element of a q step's (64, block_q_bwd) tile that the differential consumers exchange through SMEM
    (dtype size e): the fp32 dP half and one 16-bit P share buffer (exchange, lean), or a 16-bit P share buffer per
    consumer (dp_whole, dv_smem: each consumer computes the whole dP)."""
    return 2 * e if dkdv in ("dp_whole", "dv_smem") else 4 + e


def _scores(ops: _Ops, k_g, q_t, halves, shape):
    """S^T = K_g Q_t^T and dP^T = sum of V_c dO_c^T over `halves` [(V_c, dO_c)] (dv's column halves: this
    consumer's, or both for the whole dP), issued back to back and waited for once."""
    if ops.interpret:
        return ops.matmul(k_g, q_t, shape, transpose_b=True), sum(ops.matmul(v, do, shape, transpose_b=True) for v, do in halves)

    def body(s_ref, dp_ref):
        plgpu.wgmma(s_ref, k_g, _transposed(q_t))
        for v, do in halves:
            plgpu.wgmma(dp_ref, v, _transposed(do))
        return s_ref[...], dp_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _single_sub_tile(ops: _Ops, st: _Static, carry, tiles, mask, col, lse_smem, D_smem):
    """(dK, dV) + one single-map sub-tile's (dS^T Q, P^T dO) for tiles (K, V, Q, dO) in SMEM, `mask()` the tile's mask
    (True = allowed; mask None: none), `col(ref)` a per-query vector from SMEM broadcast over the tile: S^T = K Q^T
    and dP^T = V dO^T, P^T = exp2(S^T scale2 - lse), dS^T = P^T (dP^T - D). dK and dV hold (d + dv) / 2 registers a
    thread: up to 128 (d + dv <= 256), S^T and dP^T (32 each) live beside them, issued back to back with one wait;
    past that (d 192 / dv 128: 160) they do not fit in 240 with the step's addresses and masks (ptxas serialized every
    wgmma and spilled: kernel_resources.md), so P^T is held in float16 (16 registers; 11 bits, finer than the 16-bit
    dS it makes) while dP^T is computed after it."""
    k_g, v_g, q_h, do_h = tiles
    shape, dtype = (k_g.shape[0], q_h.shape[0]), q_h.dtype
    joint = k_g.shape[-1] + v_g.shape[-1] <= 256
    if joint:
        sT, dpT = _scores(ops, k_g, q_h, [(v_g, do_h)], shape)
    else:
        sT = ops.matmul(k_g, q_h, shape, transpose_b=True)
    sT = sT * st.scale2
    allowed = None if mask is None else mask()
    if allowed is not None:
        sT = jnp.where(allowed, sT, -jnp.inf)
    pT = jnp.exp2(sT - col(lse_smem))
    if not joint:
        pT = pT.astype(jnp.float16)
        dpT = ops.matmul(v_g, do_h, shape, transpose_b=True)
    dsT = (pT.astype(jnp.float32) * (dpT - col(D_smem))).astype(dtype)
    do_h = do_h if ops.interpret else _traced_indices(do_h)  # closed over by the dK / dV run_state
    return _dk_then_dv(ops, *carry, dsT, q_h, lambda: [(pT.astype(jnp.float32).astype(dtype), do_h)])


def _dk_then_dv(ops: _Ops, dk_acc, dv_acc, dsT, q_t, p_shares):
    """(dk_acc + dS^T Q_t, dv_acc + sum of a @ b over p_shares()): the dK wgmma is issued first, and `p_shares`
    (where the consumers meet over their P shares) runs while the tensor cores work on it; then the dV wgmmas,
    and one wait for all. Refs used in here are closed over by run_state: their static indices must be traced."""
    if ops.interpret:
        dk_acc = ops.matmul(dsT, q_t, None, acc=dk_acc)
        for a, b in p_shares():
            dv_acc = ops.matmul(a, b, None, acc=dv_acc)
        return dk_acc, dv_acc
    q_t = _traced_indices(q_t)

    def body(refs):
        dk_ref, dv_ref = refs
        plgpu.wgmma(dk_ref, dsT, q_t)
        for a, b in p_shares():
            plgpu.wgmma(dv_ref, a, b)

    return pl.run_state(body)((plgpu.ACC.init(dk_acc), plgpu.ACC.init(dv_acc)))


def _p_share_exchange(ops: _Ops, g: int, share, x_p, xbar, do_t):
    """lean: [(P_1 - lam P_2, dO_t)], the sum made by consumer 1 in the single buffer x_p where consumer 0 put
    P_1 before their first meeting; their second meeting (here, for consumer 1; before the dP read, for 0) hands
    it back. `share`: consumer 1's -lam P_2 (fp32); consumer 0's was written already."""
    if g == 0:
        return [(ops.load(x_p, WGMMA), do_t)]
    total = (share + ops.load(x_p, WGMMA).astype(jnp.float32)).astype(x_p.dtype)
    x_p[...] = total
    _rendezvous(xbar)
    return [(total, do_t)]


def _p_share_swap(ops: _Ops, g: int, share, buffers, xbar, p_free, do_t, from_smem: bool):
    """dp_whole / dv_smem: each consumer writes its 16-bit P share to its own buffer, buffers[g] (once both are
    done with the last ones: p_free), and they meet once. from_smem (dv_smem): [(buffers[0], dO_t), (buffers[1],
    dO_t)], two dV wgmmas reading both shares from SMEM; else the other's share is loaded and added, [(sum, dO_t)]."""
    plgpu.barrier_wait(p_free)
    buffers[g][...] = share
    if from_smem:
        plgpu.commit_smem()  # visible to the wgmmas (async proxy) of both consumers
    _rendezvous(xbar)
    if from_smem:
        return [(buffer, do_t) for buffer in buffers]
    theirs = ops.load(buffers[1 - g], WGMMA)
    plgpu.barrier_arrive(p_free)  # read: consumer 1 - g may write its next share
    return [((share.astype(jnp.float32) + theirs.astype(jnp.float32)).astype(share.dtype), do_t)]
