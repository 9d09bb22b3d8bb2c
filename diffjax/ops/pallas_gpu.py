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
halves, one per consumer, and the halves are exchanged through SMEM (no duplicated matmul):
  dk/dv   one CTA per (batch, kv head, 64-row kv block); streams (query head of the group, q block)
          tiles; consumer g accumulates dK_g and the g-th column half of dV (exchanging P_m tiles).
  dq      one CTA per (batch, head, 64-row q block); streams K/V tiles; consumer g accumulates dQ_g.

Single-map mode (standard attention, `dot_product_attention_pallas_gpu`, dv == d; FA3's layout): the
same kernels with one map (M = 1), q and k carrying a map axis of size 1. The consumers take two
different 64-row tiles of one 128-row block and share every streamed tile: forward and dq, two query
tiles (own online softmax / full dP, own output rows, no O_2 hand-off, no exchange); dk/dv, two kv
tiles streaming the same q / dO tiles. Both consumers run the CTA's step range; each masks with its
own rows (`_q_tile`), so the diagonal step may be fully masked for one of them.

Conventions: bottom-right aligned causal masking (query t sits at key S - T + t, or q_offset + t when the
caller places the queries, as context parallelism does with each device's query chunks: then q_offset is a
traced int32 read from a one-element gmem operand, and the step ranges and masks follow it); kv steps above the
diagonal are never loaded; unmasked steps run without mask arithmetic. T and S are zero-padded to
the block sizes outside the kernels (no copy when they divide); padded keys are masked in the
forward and contribute nothing to the backward (their K and V rows are zero). A fully masked query
row gives o = 0 and zero gradients, like the reference.

Off GPU the same kernels run in Mosaic GPU interpret mode (`interpret=True`, for tests): the
primitives that have no interpreter rule (wgmma, layout casts, layout-aware loads) go through
`_Ops`, which uses plain jnp equivalents there; everything else (TMA copies, barriers, the
warpgroup schedule, masking, softmax, exchange) is the same code on both paths.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax import jax_compat
from diffjax.ops.reference import split_segment_ids

LOG2E = math.log2(math.e)
WGMMA = plgpu.Layout.WGMMA  # the register layout of wgmma accumulators; .reduce(1) rows, .reduce(0) columns
SMEM_BYTES = 227 * 1024  # Hopper: dynamic shared memory a CTA may use
SMEM_MARGIN = 2048  # barriers, alignment padding


class Tuning(NamedTuple):
    """Kernel settings. block_q = 64 (one wgmma row tile per consumer); the block sizes default to
    the larger of 128 / 64 whose tiles fit in shared memory (`default_tuning`)."""

    block_q: int = 64
    block_k: int = 64  # forward: keys per streamed step
    block_k_dq: int = 64  # dq kernel: keys per streamed step
    block_q_bwd: int = 64  # dk/dv kernel: query rows per streamed step
    stages: int = 2  # ring slots for streamed tiles
    pingpong: bool = True  # forward: alternate the consumers' softmax and wgmmas (FA3)


# ------------------------------------------------------------------------------ interpret shims


@dataclasses.dataclass(frozen=True)
class _Ops:
    """The few primitives whose compiled form (wgmma, register layouts) has no interpreter rule."""

    interpret: bool

    def full(self, shape, value, dtype=jnp.float32, layout=None):
        x = jnp.full(shape, value, dtype)
        return x if self.interpret else plgpu.layout_cast(x, layout or WGMMA)

    def load(self, ref, layout):
        """ref's whole contents in `layout` (row vectors: WGMMA.reduce(1), column vectors: .reduce(0))."""
        if self.interpret:
            return ref[...]
        return jax_compat.mosaic_gpu_load(plgpu, ref, layout)

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)

    def matmul(self, a, b_ref, shape, *, transpose_b=False, acc=None, after_issue=None):
        """acc + a @ b (fp32), a: an SMEM ref or a 16-bit register tile, b: an SMEM ref; b_ref^T if
        transpose_b. `after_issue` runs between issuing the wgmma and waiting for it."""
        if self.interpret:
            a_val = a[...] if hasattr(a, "at") else a
            b_val = b_ref[...]
            out = jnp.dot(a_val, b_val.T if transpose_b else b_val, preferred_element_type=jnp.float32)
            if after_issue is not None:
                after_issue()
            return out if acc is None else acc + out
        b = _transposed(b_ref) if transpose_b else b_ref

        def body(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            if after_issue is not None:
                after_issue()
            return acc_ref[...]

        if acc is None:
            return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))
        assert after_issue is None, "accumulating wgmmas run to completion inside run_state"
        b = _traced_indices(b)  # b is closed over by run_state: its indices become run_state operands
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))


    def matmuls(self, *products):
        """[a @ b (fp32) for (a, b_ref, shape, transpose_b) in products]: independent wgmmas issued back to
        back and waited for once, so that the tensor cores work on the second while the first drains."""
        if self.interpret:
            return [self.matmul(a, b_ref, shape, transpose_b=t) for a, b_ref, shape, t in products]

        def body(*acc_refs):
            for acc_ref, (a, b_ref, _, t) in zip(acc_refs, products):
                plgpu.wgmma(acc_ref, a, _transposed(b_ref) if t else b_ref)
            return tuple(acc_ref[...] for acc_ref in acc_refs)

        return list(pl.run_scoped(body, *(plgpu.ACC(shape, jnp.float32) for _, _, shape, _ in products)))


def _traced_indices(ref):
    """ref with every scalar index (e.g. the map g in `k_smem.at[slot, g]`) passed through an add, so
    that it is a variable of the jaxpr. A constant index of a ref that run_state closes over becomes a
    literal operand of run_state, which jax 0.11's Mosaic GPU lowering rejects ("Shaped arrays must be
    represented by ir.Values"); an int32 conversion alone is not enough (scalar constants are inlined as literals)."""

    def trace(transform):
        if not hasattr(transform, "int_indexer_shape"):  # not an indexer (tiling, swizzle, transpose)
            return transform
        scalar = lambda i: isinstance(i, int) or (hasattr(i, "shape") and i.shape == ())  # noqa: E731  (not a Slice)
        return dataclasses.replace(transform, indices=tuple(lax.add(jnp.int32(i), jnp.int32(0)) if scalar(i) else i for i in transform.indices))

    return dataclasses.replace(ref, transforms=tuple(map(trace, ref.transforms)))


def _transposed(ref):
    if "transpose_ref" in vars(plgpu):  # jax 0.10; 0.11 deprecates it for ref.transpose
        return plgpu.transpose_ref(ref, (1, 0))
    return ref.transpose((1, 0))


def _tiled(minor: int, dtype):
    """SMEM transforms for a wgmma / TMA operand whose minor dimension has `minor` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, minor * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _producer_loop(steps, stages, free, load):
    """The producer's ring of `stages` SMEM slots: before refilling a slot, wait until both consumers
    released it, then `load(step, slot)` issues the step's TMA copies. Ends by waiting for the last
    releases too: every thread that waits on a barrier observes all of its phases (the interpreter
    checks, and hardware parity tracking needs it)."""

    @pl.loop(0, steps)
    def _(step):
        slot = lax.rem(step, jnp.int32(stages))

        @pl.when(step >= stages)
        def _():
            plgpu.barrier_wait(free.at[slot])

        load(step, slot)

    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(step):
        plgpu.barrier_wait(free.at[lax.rem(step, jnp.int32(stages))])


def _copy_kv_rows(srcs, dsts, slot, b, kh, keys, barrier):
    """TMA copies of one kv step into ring slot `slot`: K for each key group, V (whole, or in two
    column halves when the slot holds [2, rows, dv / 2]), and the key segment ids when present."""
    k_ref, v_ref, kvseg_ref = srcs
    k_smem, v_smem, kvseg_smem = dsts
    for g in range(k_smem.shape[1]):
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, g], k_smem.at[slot, g], barrier)
    if v_smem.ndim == 3:
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], v_smem.at[slot], barrier)
    else:
        dvh = v_smem.shape[-1]
        for c in range(2):
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh, pl.ds(c * dvh, dvh)], v_smem.at[slot, c], barrier)
    if kvseg_ref is not None:
        plgpu.copy_gmem_to_smem(kvseg_ref.at[b, keys], kvseg_smem.at[slot], barrier)


def _set_registers(st: _Static, producer: bool):
    """Hand the producer's registers to the consumers (setmaxnreg; 2 x 232 + 40 per thread fits)."""
    if not st.interpret:
        plgpu.set_max_registers(40 if producer else 232, action="decrease" if producer else "increase")


def _rendezvous(barrier):
    """Both consumers arrive, then both wait: everything either wrote to SMEM before is visible."""
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


# ------------------------------------------------------------------------------ static config


class _Static(NamedTuple):
    """What the kernels specialise on (hashable: a nondiff custom_vjp argument)."""

    G: int  # key groups: 2, or 1 when both maps share keys
    R: int  # query heads per kv head
    T: int  # true lengths
    S: int
    Sp: int  # padded key length (a multiple of every kv block size)
    bq: int
    bk: int
    bk_dq: int
    bq_bwd: int
    stages: int
    pingpong: bool
    causal: bool
    scale: float
    has_seg: bool
    interpret: bool
    single: bool = False  # standard attention: one map, the consumers on different rows
    traced_offset: bool = False  # q_offset comes as a gmem operand (else the static S - T)

    @property
    def M(self):  # maps: lse / D / dq / dk carry a map axis of this size
        return 1 if self.single else 2

    @property
    def cta_q(self):  # query rows of a forward / dq CTA: a 64-row tile per consumer in the single mode
        return 2 * self.bq if self.single else self.bq

    @property
    def cta_kv(self):  # kv rows of a dk/dv CTA
        return 128 if self.single else 64

    @property
    def offset(self):  # key position of query 0 (bottom-right aligned causal) when no q_offset is passed
        return self.S - self.T

    @property
    def scale2(self):  # scores in base 2: exp2(s scale log2 e) = exp(s scale)
        return self.scale * LOG2E


def _cdiv(a, b):
    return -(-a // b)


def _q_tile(st: _Static, g: int, r0, rows: int):
    """(map, first row) of consumer g's query tile in a block of query rows starting at r0: both maps
    of the same rows (differential), or the g-th `rows`-row tile (single)."""
    return (0, r0 + g * rows) if st.single else (g, r0)


def _query_offset(st: _Static, offset_ref):
    """The key position of query 0: the gmem operand's value, or the static S - T."""
    return offset_ref[0] if st.traced_offset else st.offset


def _kv_steps(st: _Static, offset, t0, rows, nk):
    """(unmasked steps, all steps) for the query rows [t0, t0 + rows): kv blocks past the causal
    diagonal are skipped; the first `unmasked` need no mask at all."""
    if st.causal:
        last = t0 + rows + offset  # one past the last key the block's last row sees
        steps = jnp.clip(_cdiv_dyn(last, st.bk), 0, nk)
        unmasked = jnp.clip(jnp.maximum(t0 + offset + 1, 0) // st.bk, 0, steps)
    else:
        steps = jnp.int32(nk)
        unmasked = steps
    if st.has_seg:
        unmasked = jnp.int32(0)
    elif st.Sp != st.S:
        unmasked = jnp.minimum(unmasked, st.S // st.bk)  # blocks from here on hold padded keys
    return unmasked, steps


def _q_block(st: _Static, nq):
    """This CTA's query block. Causal: the last (longest) blocks are launched first, so the short ones
    fill the tail of the grid."""
    i = lax.axis_index("q_blocks")
    return nq - 1 - i if st.causal else i


def _cdiv_dyn(a, b):
    return lax.div(jnp.maximum(a, 0) + (b - 1), jnp.int32(b))


def _score_mask(ops, st: _Static, offset, shape, q0, k0, q_seg=None, kv_seg=None, *, transposed=False):
    """Boolean mask (True = allowed) for a tile whose rows are queries q0.. and columns keys k0..
    (or the transpose). Segment ids are row/column vectors already in the matching layouts."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    q_pos = ops.iota(shape, q_dim) + q0
    k_pos = ops.iota(shape, k_dim) + k0
    mask = None
    if st.causal:
        mask = q_pos + offset >= k_pos
    if st.Sp != st.S:
        valid = k_pos < st.S
        mask = valid if mask is None else mask & valid
    if st.has_seg:
        same = lax.broadcast_in_dim(q_seg, shape, [q_dim]) == lax.broadcast_in_dim(kv_seg, shape, [k_dim])
        mask = same if mask is None else mask & same
    return mask


def _rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


# ------------------------------------------------------------------------------ forward


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
        _, steps = _kv_steps(st, offset, t0, st.cta_q, nk)  # both consumers run the CTA's steps (one ring)

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
                _copy_kv_rows((k_ref, v_ref, kvseg_ref), (k_smem, v_smem, kvseg_smem), slot, b, kh, pl.ds(step * bk, bk), kv_ready.at[slot])

            _producer_loop(steps, stages, kv_free, load)

        def consumer(g: int):
            _set_registers(st, producer=False)
            plgpu.barrier_wait(q_ready)
            q_g = q_smem.at[g]
            m, r0 = _q_tile(st, g, t0, bq)
            unmasked, _ = _kv_steps(st, offset, r0, bq, nk)
            q_seg = ops.load(qseg_smem.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None
            carry = (
                ops.full((bq,), -jnp.inf, layout=WGMMA.reduce(1)),  # running max (base 2)
                ops.full((bq,), 0.0, layout=WGMMA.reduce(1)),  # running sum
                ops.full((bq, dv), 0.0),  # O_g accumulator
            )

            def step_body(step, carry, *, masked: bool):
                m_i, l_i, acc = carry
                slot = lax.rem(step, jnp.int32(stages))
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
            carry = lax.fori_loop(0, unmasked, functools.partial(step_body, masked=False), carry)
            m_i, l_i, acc = lax.fori_loop(unmasked, steps, functools.partial(step_body, masked=True), carry)
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
            if st.single:  # dv == d: this consumer's rows leave through its own query tile
                q_g[...] = o_g.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_g, o_ref.at[b, rows, h])
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


# ------------------------------------------------------------------------------ backward


def _exchange_sum(ops, g, pairs, barrier):
    """[mine + the other consumer's tile for (buffer, mine) in pairs], through one SMEM buffer per
    tile (summed in fp32, rounded to the buffer's dtype): consumer 0 writes, both meet, consumer 1 adds its own and writes the sum back, both
    meet, consumer 0 reads the sum. Consumer 0's next write follows its read, and consumer 1's next
    read-modify-write waits for that write's meeting, so two meetings a step suffice."""
    if g == 0:
        for buf, mine in pairs:
            buf[...] = mine.astype(buf.dtype)
    _rendezvous(barrier)
    if g == 1:
        totals = [mine + ops.load(buf, WGMMA).astype(jnp.float32) for buf, mine in pairs]
        for (buf, _), total in zip(pairs, totals):
            buf[...] = total.astype(buf.dtype)
        totals = [total.astype(buf.dtype).astype(jnp.float32) for (buf, _), total in zip(pairs, totals)]
    _rendezvous(barrier)
    if g == 0:
        totals = [ops.load(buf, WGMMA).astype(jnp.float32) for buf, _ in pairs]
    return totals


def _in_refs(st: _Static, it):
    """The kernels' first gmem refs, in `_args` order: (q, k, v, lam or None, q_seg or None, kv_seg or None,
    q_offset or None)."""
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    lam_ref = None if st.single else next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if st.has_seg else (None, None)
    offset_ref = next(it) if st.traced_offset else None
    return q_ref, k_ref, v_ref, lam_ref, qseg_ref, kvseg_ref, offset_ref


def _copy_query_rows(st: _Static, srcs, dsts, b, h, r0, barrier):
    """TMA copies of one block of query rows from r0 for the backward kernels, into query tiles t of
    `_q_tile` (the tiles' leading axis): q, dO (differential: the t-th column half; single: whole),
    lse and D; lambda (differential) and the query segment ids when present."""
    q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref = srcs
    q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem = dsts
    n, dvt = q_smem.shape[-2], do_smem.shape[-1]
    for t in range(q_smem.shape[0]):
        m, r = _q_tile(st, t, r0, n)
        rows = pl.ds(r, n)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h, m], q_smem.at[t], barrier)
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h, pl.ds(0 if st.single else t * dvt, dvt)], do_smem.at[t], barrier)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, m, rows], lse_smem.at[t], barrier)
        plgpu.copy_gmem_to_smem(D_ref.at[b, h, m, rows], D_smem.at[t], barrier)
    if lam_ref is not None:
        plgpu.copy_gmem_to_smem(lam_ref.at[b, h, pl.ds(r0, n)], lam_smem, barrier)
    if qseg_ref is not None:
        for t in range(qseg_smem.shape[0]):
            plgpu.copy_gmem_to_smem(qseg_ref.at[b, pl.ds(_q_tile(st, t, r0, n)[1], n)], qseg_smem.at[t], barrier)


def _query_copies(st: _Static, tiles: int):
    """How many TMA copies `_copy_query_rows` issues for `tiles` query tiles (a barrier's arrivals)."""
    return 4 * tiles + (not st.single) + st.has_seg * (tiles if st.single else 1)


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
        _, steps = _kv_steps(st, offset, t0, st.cta_q, nk)

        @pl.when(wg == 2)
        def _producer():
            _set_registers(st, producer=True)
            _copy_query_rows(
                st, (q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref), (q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem),
                b, h, t0, q_ready,
            )

            def load(step, slot):
                _copy_kv_rows((k_ref, v_ref, kvseg_ref), (k_smem, v_smem, kvseg_smem), slot, b, kh, pl.ds(step * bk, bk), kv_ready.at[slot])

            _producer_loop(steps, stages, kv_free, load)

        def consumer(g: int):
            _set_registers(st, producer=False)
            plgpu.barrier_wait(q_ready)
            m, r0 = _q_tile(st, g, t0, bq)
            unmasked, _ = _kv_steps(st, offset, r0, bq, nk)
            lse_g = ops.load(lse_smem.at[g], WGMMA.reduce(1))
            D_g = ops.load(D_smem.at[g], WGMMA.reduce(1))
            lam_row = None if st.single else ops.load(lam_smem, WGMMA.reduce(1))
            q_seg = ops.load(qseg_smem.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None

            def step_body(step, dq_acc, *, masked: bool):
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[slot])
                k_g = k_smem.at[slot, g if G == 2 else 0]
                # S and (this consumer's part of) dP = dO V^T are independent: one wait for both wgmmas.
                s, dp = ops.matmuls((q_smem.at[g], k_g, (bq, bk), True),
                                    (do_smem.at[g], v_smem.at[slot] if st.single else v_smem.at[slot, g], (bq, bk), True))
                s = s * st.scale2
                if masked:
                    kv_seg = ops.load(kvseg_smem.at[slot], WGMMA.reduce(0)) if st.has_seg else None
                    mask = _score_mask(ops, st, offset, (bq, bk), r0, step * bk, q_seg, kv_seg)
                    if mask is not None:
                        s = jnp.where(mask, s, -jnp.inf)
                p = jnp.exp2(s - _rows(lse_g, (bq, bk)))
                if not st.single:
                    (dp,) = _exchange_sum(ops, g, [(x_smem, dp)], xbar)
                ds = p * (dp - _rows(D_g, (bq, bk)))
                if g == 1 and not st.single:
                    ds = ds * _rows(-lam_row, (bq, bk))
                dq_acc = ops.matmul(ds.astype(dtype), k_g, (bq, d), acc=dq_acc)
                plgpu.barrier_arrive(kv_free.at[slot])
                return dq_acc

            dq_acc = lax.fori_loop(0, unmasked, functools.partial(step_body, masked=False), ops.full((bq, d), 0.0))
            dq_acc = lax.fori_loop(unmasked, steps, functools.partial(step_body, masked=True), dq_acc)
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


def _q_steps(st: _Static, offset, k0, rows: int, nq):
    """For the kv rows [k0, k0 + rows) of the dk/dv kernel: (first q block, first q block that needs no mask)."""
    bqb = st.bq_bwd
    if st.causal:
        first = jnp.clip(jnp.maximum(k0 - offset, 0) // bqb, 0, nq)
        full = jnp.clip(_cdiv_dyn(k0 + rows - 1 - offset, bqb), first, nq)
    else:
        first, full = jnp.int32(0), jnp.int32(0)
    if st.has_seg:
        full = jnp.int32(nq)
    elif st.Sp != st.S:
        full = jnp.where(k0 + rows > st.S, nq, full)  # these rows hold padded keys
    return first, full


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
        first, _ = _q_steps(st, offset, k0, st.cta_kv, nq)
        per_rep = nq - first
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
            _, full = _q_steps(st, offset, k0_g, bk, nq)
            k_g = k_smem.at[g if st.single or G == 2 else 0]
            t = 0 if st.single else g  # this consumer's streamed query tile
            kv_seg = ops.load(kvseg_smem.at[g if st.single else 0], WGMMA.reduce(1)) if st.has_seg else None

            def step_body(i, carry, *, rep, masked: bool):
                dk_acc, dv_acc = carry
                step = rep * per_rep + i - first
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(q_ready.at[slot])
                cols = lambda ref: ops.load(ref, WGMMA.reduce(0))  # noqa: E731  (per-query vectors)
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
                carry = lax.fori_loop(first, full, functools.partial(step_body, rep=rep, masked=True), carry)
                return lax.fori_loop(full, nq, functools.partial(step_body, rep=rep, masked=False), carry)

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


def _args(st: _Static, q, k, v, lam, q_seg, kv_seg, offset, *rest):
    """The kernels' gmem operands: lam only in the differential mode, segment ids when present, the query
    offset [1] when traced."""
    return ([q, k, v] + ([] if st.single else [lam]) + ([q_seg, kv_seg] if st.has_seg else [])
            + ([offset] if st.traced_offset else []) + list(rest))


def _name(st: _Static, kernel: str):
    return f"diffjax_mgpu{'_single' if st.single else ''}_{kernel}"


def _launch(st, kernel, out_type, scratch, grid, grid_names, name):
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=jax_compat.mosaic_gpu_interpret_params(plgpu) if st.interpret else None,
        kernel_name=name,
    )


# ------------------------------------------------------------------------------ public


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
    if d != dk or d not in (64, 128):
        return f"needs the q and k head dim d in (64, 128), got {d} and {dk}"
    if single and dv != d:
        return f"needs dv = d for standard attention, got dv = {dv} with d = {d} ({q.dtype})"
    if dv not in (d, 2 * d):
        return f"needs dv = d or 2d, got dv = {dv} with d = {d}"
    if q.shape[2] % k.shape[2]:
        return f"needs query heads ({q.shape[2]}) to be a multiple of kv heads ({k.shape[2]})"
    bs = default_tuning(d, dv, G, q.dtype, single) if tuning is None else Tuning(*tuning)
    if bs.block_q != 64 or any(b not in (64, 128) for b in bs[1:4]) or bs.stages < 2:
        # 64: a wgmma row tile per consumer; the others are contraction sizes of 16-bit wgmmas with a
        # 128-byte swizzle, which must be multiples of 64
        return f"needs block_q = 64, block_k / block_k_dq / block_q_bwd in (64, 128) and stages >= 2, got {bs}"
    need = _smem_bytes(d, dv, G, bs, q.dtype, single)
    over = {kernel: n for kernel, n in need.items() if n + SMEM_MARGIN > SMEM_BYTES}
    if over:
        return f"needs {over} bytes of shared memory with {bs}, more than the {SMEM_BYTES - SMEM_MARGIN} a Hopper CTA has for tiles; use smaller blocks or fewer stages"
    return None


def default_tuning(d, dv, G, dtype, single: bool = False, swept: bool = True) -> Tuning:
    """The sweep's measured best for the shape class where its table has one that fits (swept; see
    choice.swept_tuning), else the largest block of each kernel (128 or 64) whose shared memory fits, with 2 stages."""
    from diffjax.ops.choice import swept_tuning  # same layer; choice imports this module lazily too

    fields = swept_tuning(d, dv, single, dtype) if swept else None
    if fields is not None and set(fields) <= set(Tuning._fields):
        bs = Tuning(**fields)
        if all(n + SMEM_MARGIN <= SMEM_BYTES for n in _smem_bytes(d, dv, G, bs, dtype, single).values()):
            return bs
    chosen = {}
    for field, kernel in (("block_k", "forward"), ("block_k_dq", "dq"), ("block_q_bwd", "dkdv")):
        for size in (128, 64):
            bs = Tuning(**{**chosen, field: size})
            if _smem_bytes(d, dv, G, bs, dtype, single)[kernel] + SMEM_MARGIN <= SMEM_BYTES:
                break
        chosen[field] = size
    return Tuning(**chosen)


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
        "dkdv": (2 * d + dv) * 64 * e + n * bqb * (2 * d + dv) * e + 64 * bqb * (4 + e) + n * bqb * 24 + 64 * 4,
    }


def diff_attention_pallas_gpu(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, tuning=None,
                              interpret=None, q_offset=None):
    """Fused differential attention on Hopper; same contract as diffjax.ops.diff_attention.
    tuning: a Tuning (or a tuple of its fields); default `default_tuning` for the shape.
    q_offset: the key position of query 0 under the causal mask (an int or a traced int32 scalar; default
    S - T): queries at q_offset + t, keys at 0 .. S - 1."""
    why_not = unsupported(q_BTH2d, k_BSKGd, v_BSKv, tuning)
    if why_not:
        raise ValueError(f"diff_attention: impl='pallas_gpu' {why_not}")
    B, T, H = q_BTH2d.shape[:3]
    # lam rounded to the value dtype like the reference, then fp32; broadcasting to [B, T, H] makes
    # autodiff sum dlam for a scalar lambda.
    lam_BTH = jnp.broadcast_to(jnp.asarray(lam).astype(v_BSKv.dtype).astype(jnp.float32), (B, T, H))
    return _fused(q_BTH2d, k_BSKGd, v_BSKv, lam_BTH, False, causal, segment_ids, scale, tuning, interpret, q_offset)


def dot_product_attention_pallas_gpu(q_BTNd, k_BSKd, v_BSKd, *, causal=True, segment_ids=None, scale=None, tuning=None,
                                     interpret=None, q_offset=None):
    """Fused standard attention on Hopper (the single-map mode of the same kernels: the two consumer
    warpgroups take two 64-row query tiles, or in dk/dv two 64-row kv tiles, sharing every streamed
    tile); same contract as diffjax.ops.dot_product_attention with dv == d, segment ids included.
    q_offset: as for diff_attention_pallas_gpu."""
    why_not = unsupported(q_BTNd, k_BSKd, v_BSKd, tuning)
    if why_not:
        raise ValueError(f"dot_product_attention: impl='pallas_gpu' {why_not}")
    return _fused(q_BTNd[:, :, :, None], k_BSKd[:, :, :, None], v_BSKd, None, True, causal, segment_ids, scale, tuning,
                  interpret, q_offset)


def _fused(q_BTHMd, k_BSKGd, v_BSKv, lam_BTH, single, causal, segment_ids, scale, tuning, interpret, q_offset):
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
        interpret=(jax.default_backend() != "gpu") if interpret is None else bool(interpret), single=single,
        traced_offset=bool(causal) and q_offset is not None,
    )
    offset = jnp.full((1,), q_offset, jnp.int32) if st.traced_offset else None
    q = _pad_axis(q_BTHMd, 1, Tp)
    k = _pad_axis(k_BSKGd, 1, Sp)
    v = _pad_axis(v_BSKv, 1, Sp)
    o_BTHv = _flash(st, q, k, v, lam_BHT, q_seg, kv_seg, offset)
    return o_BTHv[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, lam, q_seg, kv_seg, offset):
    return _forward(st, q, k, v, lam, q_seg, kv_seg, offset, save_residuals=False)[0]


def _flash_fwd(st, q, k, v, lam, q_seg, kv_seg, offset):
    o, lse, *o2 = _forward(st, q, k, v, lam, q_seg, kv_seg, offset, save_residuals=True)
    return o, (q, k, v, lam, q_seg, kv_seg, offset, o, o2[0] if o2 else None, lse)


def _flash_bwd(st, res, do):
    q, k, v, lam, q_seg, kv_seg, offset, o, o2, lse = res
    do = do.astype(q.dtype)
    do32 = do.astype(jnp.float32)
    if st.single:
        D_BHMT = jnp.einsum("bthv,bthv->bht", do32, o.astype(jnp.float32))[:, :, None]
    else:
        lam_BTH1 = lam.transpose(0, 2, 1)[..., None]
        o1 = o.astype(jnp.float32) + lam_BTH1 * o2  # the un-mixed first map, from the rounded output
        D_BHMT = jnp.stack([jnp.einsum("bthv,bthv->bht", do32, o1), jnp.einsum("bthv,bthv->bht", do32, o2)], axis=2)
    dq = _dq(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D_BHMT)
    dk_BSKMd, dv = _dkdv(st, q, k, v, lam, q_seg, kv_seg, offset, do, lse, D_BHMT)
    # differential with keys shared by both maps (G = 1): dK is the sum of the maps' slices
    dk = dk_BSKMd if st.M == st.G else dk_BSKMd.astype(jnp.float32).sum(axis=3, keepdims=True).astype(k.dtype)
    dlam = None if st.single else -D_BHMT[:, :, 1]
    return dq, dk, dv, dlam, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
