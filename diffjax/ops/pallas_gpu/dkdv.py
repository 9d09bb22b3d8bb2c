"""The backward's dk/dv kernel: one CTA per (batch, kv head, kv block), streaming (query head, query block) tiles."""

from __future__ import annotations

import functools

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


def _dkdv(st: _Static, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D):
    """dk [B, Sp, K, M, d] and dv [B, Sp, K, dv]: one CTA per (batch, kv head, kv block), streaming
    (query head of the group, q block) tiles. Differential: 64 kv rows, consumer g accumulates dK_g
    and the g-th column half of dV; single: 128 kv rows, consumer g owns dK and dV of the g-th 64."""
    B, Tp, H, _, d = q.shape
    Sp, K, dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = q.dtype
    bk, bqb, stages, G, R = 64, st.bq_bwd, st.stages, st.G, st.R
    dvt = dv if st.single else dv // 2  # each consumer's dV columns
    tiles = 1 if st.single else 2  # streamed query tiles per step: the block's rows, or both maps
    nq = Tp // bqb
    ops = _Ops(st.interpret)
    bst = st._replace(bk=bk, bq=bqb)  # masks in this kernel: kv rows of 64, q columns of bqb
    lean = st.single or st.dkdv != "exchange"  # single_step, or the differential lean family's diff_step
    # each consumer computes the whole dP; the P shares then meet in SMEM, a buffer per consumer guarded by p_free
    whole_dp = not st.single and st.dkdv in ("dp_whole", "dv_smem")

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref, qseg_ref, kvseg_ref, offset_ref = _in_refs(st, it)
        do_ref, lse_ref, D_ref, dk_ref, dv_ref = next(it), next(it), next(it), next(it), next(it)
        k_smem, v_smem, kvseg_smem, q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem, x_dp, x_p, pos_smem = (
            next(it))
        kv_ready, q_ready, q_free, xbar, p_free = next(it)

        b, kh, j = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("kv_blocks")
        k0 = j * st.cta_kv
        wg = lax.axis_index("wg")
        offset = _query_offset(st, offset_ref)
        ring = _q_steps(st, offset, k0, st.cta_kv, nq)  # per query head of the group
        first, per_rep = ring.first, ring.end - ring.first
        steps = R * per_rep

        def kv_rows(g: int):  # (map, first kv row) of consumer g's K / V tiles
            return (0, k0 + g * bk) if st.single else (g, k0)

        @pl.when(wg == 2)
        def _producer():
            _registers(st, producer=True)
            if st.single:
                for g in range(2):
                    keys = pl.ds(kv_rows(g)[1], bk)
                    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, 0], k_smem.at[g], kv_ready)
                    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], v_smem.at[g], kv_ready)
            else:
                keys = pl.ds(k0, bk)
                for g in range(G):
                    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, g], k_smem.at[g], kv_ready)
                for c in range(2):
                    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh, pl.ds(c * dvt, dvt)], v_smem.at[c], kv_ready)
            if st.has_seg:
                for g in range(kvseg_smem.shape[0]):
                    plgpu.copy_gmem_to_smem(kvseg_ref.at[b, pl.ds(kv_rows(g)[1], bk)], kvseg_smem.at[g], kv_ready)

            def load(step, slot):
                h = kh * R + lax.div(step, per_rep)
                r0 = (first + lax.rem(step, per_rep)) * bqb
                slots = [None if ref is None else ref.at[slot] for ref in (q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem)]
                _copy_query_rows(st, (q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref), slots, b, h, r0, q_ready.at[slot])

            _producer_loop(steps, stages, q_free, load)

        def diff_step(g: int, kv_seg, i, carry, *, rep, masked: bool | str):
            """One q step of differential consumer g in the lean family (st.dkdv), every value made where it is
            used so that the step's live set stays small next to the two fp32 accumulators: S^T and dP^T (this
            consumer's half, or whole), P^T, the dP sum (lean), dS^T; then the dK wgmma, and while it runs the
            P shares meet (`_p_share_exchange` / `_p_share_swap`), then the dV wgmma(s); one wait for both.
            masked: True (the whole mask), "segments" (where the positions see every pair: segment ids and padding
            only), False."""
            dk_acc, dv_acc = carry
            step = rep * per_rep + i - first
            slot = lax.rem(step, jnp.int32(stages))
            plgpu.barrier_wait(q_ready.at[slot])
            col = lambda ref: _cols(ops.load(ref, WGMMA.reduce(0)), (bk, bqb))  # a per-query vector, as loaded
            q_t, do_t = q_smem.at[slot, g], do_smem.at[slot, g]
            halves = [(v_smem.at[c], do_smem.at[slot, c]) for c in (range(2) if whole_dp else [g])]
            sT, dpT = _scores(ops, k_smem.at[g if G == 2 else 0], q_t, halves, (bk, bqb))
            sT = sT * st.scale2
            if masked:
                q_seg = ops.load(qseg_smem.at[slot, 0], WGMMA.reduce(0)) if st.has_seg else None
                mst = bst if masked is True else bst._replace(causal=False, window=None)
                mask = _score_mask(ops, mst, offset, (bk, bqb), i * bqb, k0, q_seg, kv_seg, transposed=True)
                if mask is not None:
                    sT = jnp.where(mask, sT, -jnp.inf)
            pT = jnp.exp2(sT - col(lse_smem.at[slot, g]))
            if not whole_dp:  # the dP halves' sum, asymmetric as `_exchange_sum`: 0 writes, 1 adds, 0 reads
                if g == 0:
                    x_dp[...] = dpT
                    x_p[...] = pT.astype(dtype)  # P_1, map 1's share of P_1 - lam P_2, for g == 1 to add to
                    _rendezvous(xbar)
                    _rendezvous(xbar)  # consumer 1 has summed both
                    dpT = ops.load(x_dp, WGMMA)
                else:
                    _rendezvous(xbar)
                    dpT = dpT + ops.load(x_dp, WGMMA)
                    x_dp[...] = dpT
            dsT = pT * (dpT - col(D_smem.at[slot, g]))
            if g == 1:
                dsT = dsT * -col(lam_smem.at[slot])
            dsT = dsT.astype(dtype)
            share = pT if g == 0 else pT * -col(lam_smem.at[slot])  # this map's share of P_1 - lam P_2
            # refs that the dK / dV run_state closes over: static indices traced outside it (`_traced_indices`)
            trace = (lambda ref: ref) if ops.interpret else _traced_indices
            if whole_dp:
                buffers = (trace(x_p.at[0]), trace(x_p.at[1]))
                p_shares = functools.partial(_p_share_swap, ops, g, share.astype(dtype), buffers, xbar, p_free, trace(do_t), st.dkdv == "dv_smem")
            else:
                p_shares = functools.partial(_p_share_exchange, ops, g, share, x_p, xbar, trace(do_t))
            carry = _dk_then_dv(ops, dk_acc, dv_acc, dsT, q_t, p_shares)
            plgpu.barrier_arrive(q_free.at[slot])
            if st.dkdv == "dv_smem":  # both dV wgmmas have read the shares
                plgpu.barrier_arrive(p_free)
            return carry

        def single_step(g: int, kv_seg, i, carry, *, rep, masked: bool | str):
            """One q step of single-map consumer g (its 64 kv rows) in SUB-row query sub-tiles, a loop (not unrolled)
            when block_q_bwd is larger: whatever the block, the step's live set beside dK and dV is one sub-tile's
            (`_single_sub_tile`). masked: as in diff_step."""
            step = rep * per_rep + i - first
            slot = lax.rem(step, jnp.int32(stages))
            plgpu.barrier_wait(q_ready.at[slot])

            def sub_tile(h, carry):
                rows = pl.ds(h * SUB, SUB)
                vec = lambda ref: ops.load(ref.at[slot, 0, rows], WGMMA.reduce(0))  # a per-query vector
                mst = bst if masked is True else bst._replace(causal=False, window=None)
                mask = lambda: _score_mask(  # made once S^T is there, from vectors loaded then
                    ops, mst, offset, (bk, SUB), i * bqb + h * SUB, k0 + g * bk, vec(qseg_smem) if st.has_seg else None,
                    kv_seg, transposed=True, q_iota=ops.load(pos_smem.at[g], WGMMA.reduce(0)))
                tiles = (k_smem.at[g], v_smem.at[g], q_smem.at[slot, 0, rows], do_smem.at[slot, 0, rows])
                col = lambda ref: _cols(vec(ref), (bk, SUB))
                return _single_sub_tile(ops, st, carry, tiles, mask if masked else None, col, lse_smem, D_smem)

            carry = sub_tile(0, carry) if bqb == SUB else lax.fori_loop(0, bqb // SUB, sub_tile, carry)
            plgpu.barrier_arrive(q_free.at[slot])
            return carry

        def consumer(g: int):
            _registers(st, producer=False)
            plgpu.barrier_wait(kv_ready)
            if whole_dp:
                plgpu.barrier_arrive(p_free)  # the first shares overwrite nothing
            m, k0_g = kv_rows(g)
            if st.single:  # the query positions of a sub-tile, for its masks (read back by the threads that wrote them)
                pos_smem.at[g][...] = ops.iota((SUB,), 0, WGMMA.reduce(0))
            own = _q_steps(st, offset, k0_g, bk, nq)
            k_g = k_smem.at[g if G == 2 else 0]
            kv_seg = ops.load(kvseg_smem.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None

            def exchange_step(i, carry, *, rep, masked: bool):  # the first differential schedule, the sweep's baseline
                dk_acc, dv_acc = carry
                step = rep * per_rep + i - first
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(q_ready.at[slot])
                cols = lambda ref: ops.load(ref, WGMMA.reduce(0))
                lse_t, D_t = cols(lse_smem.at[slot, g]), cols(D_smem.at[slot, g])
                q_t, do_t = q_smem.at[slot, g], do_smem.at[slot, g]
                # S^T and this consumer's part of dP^T = V dO^T are independent: one wait for both wgmmas.
                sT, dpT = ops.matmuls((k_g, q_t, (bk, bqb), True), (v_smem.at[g], do_t, (bk, bqb), True))
                sT = sT * st.scale2
                if masked:
                    q_seg = cols(qseg_smem.at[slot, 0]) if st.has_seg else None
                    mask = _score_mask(ops, bst, offset, (bk, bqb), i * bqb, k0_g, q_seg, kv_seg, transposed=True)
                    if mask is not None:
                        sT = jnp.where(mask, sT, -jnp.inf)
                pT = jnp.exp2(sT - _cols(lse_t, (bk, bqb)))
                neg_lam = _cols(-cols(lam_smem.at[slot]), (bk, bqb))
                cpT = pT if g == 0 else pT * neg_lam  # this map's share of P_1 - lam P_2
                dpT, pcT = _exchange_sum(ops, g, [(x_dp, dpT), (x_p, cpT)], xbar)
                dsT = pT * (dpT - _cols(D_t, (bk, bqb)))
                if g == 1:
                    dsT = dsT * neg_lam
                dk_acc = ops.matmul(dsT.astype(dtype), q_t, (bk, d), acc=dk_acc)
                dv_acc = ops.matmul(pcT.astype(dtype), do_t, (bk, dvt), acc=dv_acc)
                plgpu.barrier_arrive(q_free.at[slot])
                return dk_acc, dv_acc

            step = functools.partial(single_step if st.single else diff_step, g, kv_seg) if lean else exchange_step
            # with segment ids: the causal / window mask only where the rows' positions need it (fewer values live in
            # the other steps, and ptxas spills fewer); segment ids and padding on every step
            by_position = _q_steps(st._replace(has_seg=False), offset, k0_g, bk, nq) if lean and st.has_seg else own

            def rep_body(rep, carry):
                body = lambda i, carry, masked: step(i, carry, rep=rep, masked=masked)  # noqa: E731
                if by_position is own:
                    return _run_steps(body, ring, own, carry)
                return _run_steps(body, ring, by_position, carry, unmasked="segments")

            dk_acc, dv_acc = lax.fori_loop(0, R, rep_body, (ops.full((bk, d), 0.0), ops.full((bk, dvt), 0.0)))
            if whole_dp:
                plgpu.barrier_wait(p_free)  # its last phase: every waiter observes every phase
            _rendezvous(xbar)  # both consumers are done with k and v: stage the results there
            k_smem.at[g][...] = (dk_acc * st.scale).astype(dtype)
            v_smem.at[g][...] = dv_acc.astype(dtype)
            plgpu.commit_smem()
            keys = pl.ds(k0_g, bk)
            plgpu.copy_smem_to_gmem(k_smem.at[g], dk_ref.at[b, keys, kh, m])
            plgpu.copy_smem_to_gmem(v_smem.at[g], dv_ref.at[b, keys, kh, pl.ds(0 if st.single else g * dvt, dvt)])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: consumer(0))
        pl.when(wg == 1)(lambda: consumer(1))

    qk_tf, vt_tf = _tiled(d, dtype), _tiled(dvt, dtype)
    x_tf = _tiled(bqb, jnp.float32)
    smem = (
        plgpu.SMEM((2, bk, d), dtype, transforms=qk_tf),
        plgpu.SMEM((2, bk, dvt), dtype, transforms=vt_tf),
        plgpu.SMEM((2 if st.single else 1, bk), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((stages, tiles, bqb, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, tiles, bqb, dvt), dtype, transforms=vt_tf),
        plgpu.SMEM((stages, tiles, bqb), jnp.float32),
        plgpu.SMEM((stages, tiles, bqb), jnp.float32),
        None if st.single else plgpu.SMEM((stages, bqb), jnp.float32),
        plgpu.SMEM((stages, 1, bqb), jnp.int32) if st.has_seg else None,
        None if st.single or whole_dp else plgpu.SMEM((bk, bqb), jnp.float32, transforms=x_tf),
        # P shares, rounded for the dV wgmma anyway: one buffer that consumer 1 sums into, or one per consumer (whole dP;
        # dv_smem: the dV wgmmas' lhs, whose swizzle must match dO's)
        None if st.single else plgpu.SMEM((2, bk, bqb) if whole_dp else (bk, bqb), dtype, transforms=_tiled(min(bqb, dvt) if whole_dp else bqb, dtype)),
        plgpu.SMEM((2, SUB), jnp.int32) if st.single else None,  # single: 0 .. SUB - 1, a table per consumer
    )
    kv_copies = 4 + 2 * st.has_seg if st.single else G + 2 + st.has_seg
    barriers = (
        plgpu.Barrier(num_arrivals=kv_copies),
        plgpu.Barrier(num_arrivals=_query_copies(st, tiles), num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2) if whole_dp else None,  # p_free: both consumers are done with the last P shares
    )
    out_type = [jax.ShapeDtypeStruct((B, Sp, K, st.M, d), dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    grid = (K, Sp // st.cta_kv, B)
    return _launch(st, kernel, out_type, (smem, barriers), grid, ("kv_heads", "kv_blocks", "batch"), _name(st, "bwd_dkdv"))(*_args(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D))


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
