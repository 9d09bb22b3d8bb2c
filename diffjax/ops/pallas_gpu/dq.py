"""The backward's dq kernel: one CTA per (batch, head, query block), streaming K / V tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.ops.pallas_gpu.common import (
    WGMMA,
    _args,
    _copy_kv_rows,
    _copy_query_rows,
    _exchange_sum,
    _in_refs,
    _kv_steps,
    _launch,
    _name,
    _Ops,
    _producer_loop,
    _q_block,
    _q_tile,
    _query_copies,
    _query_offset,
    _rows,
    _run_steps,
    _score_mask,
    _set_registers,
    _Static,
    _tiled,
)

SUB = 64  # keys of a single-map dq sub-tile


def _dq(st: _Static, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D):
    """dq [B, Tp, H, M, d]: one CTA per (batch, head, query block); differential: consumer g
    accumulates dQ_g of the CTA's 64 rows; single: dQ of its own 64-row half of 128 rows."""
    st = st._replace(bk=st.bk_dq)
    B, Tp, H, _, d = q.shape
    Sp, dv = k.shape[1], v.shape[-1]
    dtype = q.dtype
    bq, bk, stages, G = st.bq, st.bk, st.stages, st.G
    dvt = dv if st.single else dv // 2  # dO tile columns: whole (single) or a half per consumer
    nk = Sp // bk
    ops = _Ops(st.interpret)

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref, qseg_ref, kvseg_ref, offset_ref = _in_refs(st, it)
        do_ref, lse_ref, D_ref, dq_ref = next(it), next(it), next(it), next(it)
        q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem, k_smem, v_smem, kvseg_smem, x_smem = next(it)
        q_ready, kv_ready, kv_free, xbar = next(it)

        b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), _q_block(st, Tp // st.cta_q)
        kh = lax.div(h, jnp.int32(st.R))
        t0 = i * st.cta_q
        wg = lax.axis_index("wg")
        offset = _query_offset(st, offset_ref)
        ring = _kv_steps(st, offset, t0, st.cta_q, nk)

        @pl.when(wg == 2)
        def _producer():
            _set_registers(st, producer=True, consumer=240 if st.single else 232)
            _copy_query_rows(
                st, (q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref), (q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem),
                b, h, t0, q_ready,
            )

            def load(step, slot):
                keys = pl.ds((ring.first + step) * bk, bk)
                _copy_kv_rows((k_ref, v_ref, kvseg_ref), (k_smem, v_smem, kvseg_smem), slot, b, kh, keys, kv_ready.at[slot])

            _producer_loop(ring.end - ring.first, stages, kv_free, load)

        def consumer(g: int):
            _set_registers(st, producer=False, consumer=240 if st.single else 232)
            plgpu.barrier_wait(q_ready)
            m, r0 = _q_tile(st, g, t0, bq)
            lse_g = ops.load(lse_smem.at[g], WGMMA.reduce(1))
            D_g = ops.load(D_smem.at[g], WGMMA.reduce(1))
            lam_row = None if st.single else ops.load(lam_smem, WGMMA.reduce(1))
            q_seg = ops.load(qseg_smem.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None

            def diff_step(step, dq_acc, *, masked: bool):  # differential consumer g: dQ_g of the CTA's rows
                slot = lax.rem(step - ring.first, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[slot])
                k_g = k_smem.at[slot, g if G == 2 else 0]
                # S and this consumer's part of dP = dO V^T are independent: one wait for both wgmmas.
                s, dp = ops.matmuls((q_smem.at[g], k_g, (bq, bk), True),
                                    (do_smem.at[g], v_smem.at[slot, g], (bq, bk), True))
                s = s * st.scale2
                if masked:
                    kv_seg = ops.load(kvseg_smem.at[slot], WGMMA.reduce(0)) if st.has_seg else None
                    mask = _score_mask(ops, st, offset, (bq, bk), r0, step * bk, q_seg, kv_seg)
                    if mask is not None:
                        s = jnp.where(mask, s, -jnp.inf)
                p = jnp.exp2(s - _rows(lse_g, (bq, bk)))
                (dp,) = _exchange_sum(ops, g, [(x_smem, dp)], xbar)
                ds = p * (dp - _rows(D_g, (bq, bk)))
                if g == 1:
                    ds = ds * _rows(-lam_row, (bq, bk))
                dq_acc = ops.matmul(ds.astype(dtype), k_g, (bq, d), acc=dq_acc)
                plgpu.barrier_arrive(kv_free.at[slot])
                return dq_acc

            def single_step(step, dq_acc, *, masked: bool | str):
                """One kv step of single-map consumer g in 64-key sub-tiles (the live set of a 64-key step whatever
                block_k_dq: dQ's d / 2 registers beside S and dP, 32 each). masked: True, "segments" (segment ids and
                padding only: the positions see every pair), False."""
                slot = lax.rem(step - ring.first, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[slot])

                def sub_tile(h, dq_acc):
                    keys = pl.ds(h * SUB, SUB)
                    k_h = k_smem.at[slot, 0, keys]
                    # S and dP = dO V^T are independent: one wait for both wgmmas
                    s, dp = ops.matmuls((q_smem.at[g], k_h, (bq, SUB), True),
                                        (do_smem.at[g], v_smem.at[slot, keys], (bq, SUB), True))
                    s = s * st.scale2
                    if masked:
                        kv_seg = ops.load(kvseg_smem.at[slot, keys], WGMMA.reduce(0)) if st.has_seg else None
                        mst = st if masked is True else st._replace(causal=False, window=None)
                        mask = _score_mask(ops, mst, offset, (bq, SUB), r0, step * bk + h * SUB, q_seg, kv_seg)
                        if mask is not None:
                            s = jnp.where(mask, s, -jnp.inf)
                    ds = jnp.exp2(s - _rows(lse_g, (bq, SUB))) * (dp - _rows(D_g, (bq, SUB)))
                    return ops.matmul(ds.astype(dtype), k_h, (bq, d), acc=dq_acc)

                if bk == SUB:
                    dq_acc = sub_tile(0, dq_acc)
                else:
                    dq_acc = lax.fori_loop(0, bk // SUB, sub_tile, dq_acc)
                plgpu.barrier_arrive(kv_free.at[slot])
                return dq_acc

            own = _kv_steps(st, offset, r0, bq, nk)
            acc = ops.full((bq, d), 0.0)
            if not st.single:
                dq_acc = _run_steps(diff_step, ring, own, acc)
            elif st.has_seg:  # the causal / window mask only where the positions need it, segment ids on every step
                by_position = _kv_steps(st._replace(has_seg=False), offset, r0, bq, nk)
                dq_acc = _run_steps(single_step, ring, by_position, acc, unmasked="segments")
            else:
                dq_acc = _run_steps(single_step, ring, own, acc)
            q_smem.at[g][...] = (dq_acc * st.scale).astype(dtype)  # only this consumer reads q tile g
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[g], dq_ref.at[b, pl.ds(r0, bq), h, m])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: consumer(0))
        pl.when(wg == 1)(lambda: consumer(1))

    qk_tf, vt_tf = _tiled(d, dtype), _tiled(dvt, dtype)
    seg_tiles = 2 if st.single else 1
    smem = (
        plgpu.SMEM((2, bq, d), dtype, transforms=qk_tf),
        plgpu.SMEM((2, bq, dvt), dtype, transforms=vt_tf),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((2, bq), jnp.float32),
        None if st.single else plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((seg_tiles, bq), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((stages, G, bk, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, bk, dv), dtype, transforms=_tiled(dv, dtype)) if st.single else plgpu.SMEM((stages, 2, bk, dvt), dtype, transforms=vt_tf),
        plgpu.SMEM((stages, bk), jnp.int32) if st.has_seg else None,
        None if st.single else plgpu.SMEM((bq, bk), jnp.float32, transforms=_tiled(bk, jnp.float32)),
    )
    barriers = (
        plgpu.Barrier(num_arrivals=_query_copies(st, 2)),
        plgpu.Barrier(num_arrivals=G + (1 if st.single else 2) + st.has_seg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    )
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    grid = (H, Tp // st.cta_q, B)
    return _launch(st, kernel, out_type, (smem, barriers), grid, ("heads", "q_blocks", "batch"), _name(st, "bwd_dq"))(*_args(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D))
