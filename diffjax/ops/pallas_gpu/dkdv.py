"""The backward's dk/dv kernel: one CTA per (batch, kv head, kv block), streaming (query head, query block) tiles."""

from __future__ import annotations

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
)


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

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref, qseg_ref, kvseg_ref, offset_ref = _in_refs(st, it)
        do_ref, lse_ref, D_ref, dk_ref, dv_ref = next(it), next(it), next(it), next(it), next(it)
        k_smem, v_smem, kvseg_smem, q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem, x_dp, x_p = next(it)
        kv_ready, q_ready, q_free, xbar = next(it)

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
            _set_registers(st, producer=True)
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

        def consumer(g: int):
            _set_registers(st, producer=False)
            plgpu.barrier_wait(kv_ready)
            m, k0_g = kv_rows(g)
            own = _q_steps(st, offset, k0_g, bk, nq)
            k_g = k_smem.at[g if st.single or G == 2 else 0]
            t = 0 if st.single else g  # this consumer's streamed query tile
            kv_seg = ops.load(kvseg_smem.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None

            def step_body(i, carry, *, rep, masked: bool):
                dk_acc, dv_acc = carry
                step = rep * per_rep + i - first
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(q_ready.at[slot])
                cols = lambda ref: ops.load(ref, WGMMA.reduce(0))
                lse_t, D_t = cols(lse_smem.at[slot, t]), cols(D_smem.at[slot, t])
                q_t, do_t = q_smem.at[slot, t], do_smem.at[slot, t]
                # S^T and (this consumer's part of) dP^T = V dO^T are independent: one wait for both wgmmas.
                sT, dpT = ops.matmuls((k_g, q_t, (bk, bqb), True), (v_smem.at[g], do_t, (bk, bqb), True))
                sT = sT * st.scale2
                if masked:
                    q_seg = cols(qseg_smem.at[slot, 0]) if st.has_seg else None
                    mask = _score_mask(ops, bst, offset, (bk, bqb), i * bqb, k0_g, q_seg, kv_seg, transposed=True)
                    if mask is not None:
                        sT = jnp.where(mask, sT, -jnp.inf)
                pT = jnp.exp2(sT - _cols(lse_t, (bk, bqb)))
                if st.single:
                    dsT, pcT = pT * (dpT - _cols(D_t, (bk, bqb))), pT
                else:
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

            def rep_body(rep, carry):
                return _run_steps(lambda i, carry, masked: step_body(i, carry, rep=rep, masked=masked), ring, own, carry)

            dk_acc, dv_acc = lax.fori_loop(0, R, rep_body, (ops.full((bk, d), 0.0), ops.full((bk, dvt), 0.0)))
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
        None if st.single else plgpu.SMEM((bk, bqb), jnp.float32, transforms=x_tf),
        None if st.single else plgpu.SMEM((bk, bqb), dtype, transforms=_tiled(bqb, dtype)),  # P shares: rounded for the dV wgmma anyway
    )
    kv_copies = 4 + 2 * st.has_seg if st.single else G + 2 + st.has_seg
    barriers = (
        plgpu.Barrier(num_arrivals=kv_copies),
        plgpu.Barrier(num_arrivals=_query_copies(st, tiles), num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    )
    out_type = [jax.ShapeDtypeStruct((B, Sp, K, st.M, d), dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    grid = (K, Sp // st.cta_kv, B)
    return _launch(st, kernel, out_type, (smem, barriers), grid, ("kv_heads", "kv_blocks", "batch"), _name(st, "bwd_dkdv"))(*_args(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D))
