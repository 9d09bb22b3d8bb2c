"""The forward kernel: one CTA per (batch, head, query block), a producer and one consumer per map (or per
64-row query tile in the single-map mode)."""

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
    _in_refs,
    _kv_steps,
    _launch,
    _name,
    _Ops,
    _producer_loop,
    _q_block,
    _q_tile,
    _query_offset,
    _rendezvous,
    _rows,
    _run_steps,
    _score_mask,
    _set_registers,
    _Static,
    _tiled,
)


def _forward(st: _Static, q, k, v, lam, q_seg, kv_seg, offset, *, save_residuals: bool):
    """[o [B, Tp, H, dv]]; with residuals also lse [B, H, M, Tp] f32 (base 2) and, differential only,
    o2 [B, Tp, H, dv] f32."""
    B, Tp, H, _, d = q.shape
    Sp, dv = k.shape[1], v.shape[-1]
    dtype = q.dtype
    bq, bk, stages, G = st.bq, st.bk, st.stages, st.G
    nk = Sp // bk
    chunks = dv // d  # the output leaves SMEM in d-wide chunks staged in the query tiles
    ops = _Ops(st.interpret)

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref, qseg_ref, kvseg_ref, offset_ref = _in_refs(st, it)
        o_ref = next(it)
        lse_ref = next(it) if save_residuals else None
        o2_ref = next(it) if save_residuals and not st.single else None
        q_smem, k_smem, v_smem, lam_smem, qseg_smem, kvseg_smem, o2_smem, lse_smem = next(it)
        q_ready, kv_ready, kv_free, o2_ready, o2_free, sched = next(it)

        b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), _q_block(st, Tp // st.cta_q)
        kh = lax.div(h, jnp.int32(st.R))
        t0 = i * st.cta_q
        wg = lax.axis_index("wg")
        offset = _query_offset(st, offset_ref)
        ring = _kv_steps(st, offset, t0, st.cta_q, nk)  # both consumers run the CTA's steps (one ring)

        def schedule():  # pingpong: one consumer's softmax overlaps the other's wgmmas
            if st.pingpong:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        @pl.when(wg == 2)
        def _producer():
            _set_registers(st, producer=True)
            for g in range(2):
                m, r0 = _q_tile(st, g, t0, bq)
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(r0, bq), h, m], q_smem.at[g], q_ready)
            if not st.single:
                plgpu.copy_gmem_to_smem(lam_ref.at[b, h, pl.ds(t0, bq)], lam_smem, q_ready)
            if st.has_seg:
                for g in range(qseg_smem.shape[0]):
                    plgpu.copy_gmem_to_smem(qseg_ref.at[b, pl.ds(_q_tile(st, g, t0, bq)[1], bq)], qseg_smem.at[g], q_ready)

            def load(step, slot):
                keys = pl.ds((ring.first + step) * bk, bk)
                _copy_kv_rows((k_ref, v_ref, kvseg_ref), (k_smem, v_smem, kvseg_smem), slot, b, kh, keys, kv_ready.at[slot])

            _producer_loop(ring.end - ring.first, stages, kv_free, load)

        def consumer(g: int):
            _set_registers(st, producer=False)
            plgpu.barrier_wait(q_ready)
            q_g = q_smem.at[g]
            m, r0 = _q_tile(st, g, t0, bq)
            q_seg = ops.load(qseg_smem.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None
            carry = (
                ops.full((bq,), -jnp.inf, layout=WGMMA.reduce(1)),  # running max (base 2)
                ops.full((bq,), 0.0, layout=WGMMA.reduce(1)),  # running sum
                ops.full((bq, dv), 0.0),  # O_g accumulator
            )

            def step_body(step, carry, *, masked: bool):
                m_i, l_i, acc = carry
                slot = lax.rem(step - ring.first, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[slot])
                k_g = k_smem.at[slot, g if G == 2 else 0]
                s = ops.matmul(q_g, k_g, (bq, bk), transpose_b=True, after_issue=schedule) * st.scale2
                if masked:
                    kv_seg = ops.load(kvseg_smem.at[slot], WGMMA.reduce(0)) if st.has_seg else None
                    mask = _score_mask(ops, st, offset, (bq, bk), r0, step * bk, q_seg, kv_seg)
                    if mask is not None:
                        s = jnp.where(mask, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
                alpha = jnp.exp2(m_i - m_safe)
                p = jnp.exp2(s - _rows(m_safe, (bq, bk)))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * _rows(alpha, (bq, dv))
                schedule()
                acc = ops.matmul(p.astype(dtype), v_smem.at[slot], (bq, dv), acc=acc)
                plgpu.barrier_arrive(kv_free.at[slot])
                return m_new, l_i, acc

            if g == 1:
                schedule()  # consumer 1 starts half a step behind consumer 0
            m_i, l_i, acc = _run_steps(step_body, ring, _kv_steps(st, offset, r0, bq, nk), carry)
            if g == 0:
                schedule()

            empty = l_i == 0.0  # fully masked rows: o = 0, lse = +inf (so the backward's P is 0)
            l_safe = jnp.where(empty, 1.0, l_i)
            o_g = acc * _rows(1.0 / l_safe, (bq, dv))
            rows = pl.ds(r0, bq)
            if save_residuals:
                lse_smem.at[g][...] = jnp.where(empty, jnp.inf, m_i + jnp.log2(l_safe))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lse_smem.at[g], lse_ref.at[b, h, m, rows])
            if st.single:  # this consumer's rows leave through its own query tile (dv == d) or a ring slot of V
                if dv == d:
                    o_smem = q_g
                else:  # every V slot is free once both consumers are past their last step
                    _rendezvous(sched)  # (the consumers arrive on `sched` equally often)
                    o_smem = v_smem.at[g, pl.ds(0, bq)]
                o_smem[...] = o_g.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, rows, h])
            elif g == 1:  # hand O_2 to consumer 0, d columns at a time; also the fp32 residual
                for c in range(chunks):
                    if c:
                        plgpu.barrier_wait(o2_free)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o2_smem[...] = o_g[:, c * d : (c + 1) * d]
                    if save_residuals:
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o2_smem, o2_ref.at[b, rows, h, pl.ds(c * d, d)])
                    plgpu.barrier_arrive(o2_ready)
                plgpu.barrier_wait(o2_free)  # every waiter observes every phase (the interpreter checks)
            else:
                lam_row = ops.load(lam_smem, WGMMA.reduce(1))
                for c in range(chunks):
                    plgpu.barrier_wait(o2_ready)
                    o2_c = ops.load(o2_smem, WGMMA)
                    out_c = o_g[:, c * d : (c + 1) * d] - _rows(lam_row, (bq, d)) * o2_c
                    plgpu.barrier_arrive(o2_free)
                    q_smem.at[c][...] = out_c.astype(dtype)  # consumer 1 is past its last q_2 read
                plgpu.commit_smem()
                for c in range(chunks):
                    plgpu.copy_smem_to_gmem(q_smem.at[c], o_ref.at[b, rows, h, pl.ds(c * d, d)])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: consumer(0))
        pl.when(wg == 1)(lambda: consumer(1))

    qk_tf, v_tf = _tiled(d, dtype), _tiled(dv, dtype)
    seg_tiles = 2 if st.single else 1
    smem = (
        plgpu.SMEM((2, bq, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, G, bk, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, bk, dv), dtype, transforms=v_tf),
        None if st.single else plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((seg_tiles, bq), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((stages, bk), jnp.int32) if st.has_seg else None,
        None if st.single else plgpu.SMEM((bq, d), jnp.float32, transforms=_tiled(d, jnp.float32)),
        plgpu.SMEM((2, bq), jnp.float32) if save_residuals else None,
    )
    barriers = (
        plgpu.Barrier(num_arrivals=2 + (not st.single) + seg_tiles * st.has_seg),
        plgpu.Barrier(num_arrivals=G + 1 + st.has_seg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2),
    )
    out_type = [jax.ShapeDtypeStruct((B, Tp, H, dv), dtype)]
    if save_residuals:
        out_type.append(jax.ShapeDtypeStruct((B, H, st.M, Tp), jnp.float32))
    if save_residuals and not st.single:
        out_type.append(jax.ShapeDtypeStruct((B, Tp, H, dv), jnp.float32))
    grid = (H, Tp // st.cta_q, B)
    return _launch(st, kernel, out_type, (smem, barriers), grid, ("heads", "q_blocks", "batch"), _name(st, "fwd"))(*_args(st, q, k, v, lam, q_seg, kv_seg, offset))
