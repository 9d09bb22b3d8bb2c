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

Conventions: bottom-right aligned causal masking (query t sits at key S - T + t); kv steps above the
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
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from diffjax.ops.reference import split_segment_ids

LOG2E = math.log2(math.e)
WGMMA = plgpu.Layout.WGMMA  # the register layout of wgmma accumulators; .reduce(1) rows, .reduce(0) columns
SMEM_BYTES = 227 * 1024  # Hopper: dynamic shared memory a CTA may use
SMEM_MARGIN = 2048  # barriers, alignment padding
_LOAD_TAKES_IDX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty  # jax 0.10


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
        return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_IDX else plgpu.load(ref, layout=layout)

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

    @property
    def offset(self):  # key position of query 0 (bottom-right aligned causal)
        return self.S - self.T

    @property
    def scale2(self):  # scores in base 2: exp2(s scale log2 e) = exp(s scale)
        return self.scale * LOG2E


def _cdiv(a, b):
    return -(-a // b)


def _kv_steps(st: _Static, t0, nk):
    """(unmasked steps, all steps) for the query rows [t0, t0 + bq): kv blocks past the causal
    diagonal are skipped; the first `unmasked` need no mask at all."""
    if st.causal:
        last = t0 + st.bq + st.offset  # one past the last key the block's last row sees
        steps = jnp.clip(_cdiv_dyn(last, st.bk), 0, nk)
        unmasked = jnp.clip(jnp.maximum(t0 + st.offset + 1, 0) // st.bk, 0, steps)
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


def _score_mask(ops, st: _Static, shape, q0, k0, q_seg=None, kv_seg=None, *, transposed=False):
    """Boolean mask (True = allowed) for a tile whose rows are queries q0.. and columns keys k0..
    (or the transpose). Segment ids are row/column vectors already in the matching layouts."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    q_pos = ops.iota(shape, q_dim) + q0
    k_pos = ops.iota(shape, k_dim) + k0
    mask = None
    if st.causal:
        mask = q_pos + st.offset >= k_pos
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


def _forward(st: _Static, q, k, v, lam, q_seg, kv_seg, *, save_residuals: bool):
    """o [B, Tp, H, dv]; with residuals also o2 [B, Tp, H, dv] f32 and lse [B, H, 2, Tp] f32 (base 2)."""
    B, Tp, H, _, d = q.shape
    Sp, dv = k.shape[1], v.shape[-1]
    dtype = q.dtype
    bq, bk, stages, G = st.bq, st.bk, st.stages, st.G
    nk = Sp // bk
    chunks = dv // d  # the output leaves SMEM in d-wide chunks staged in the query tiles
    ops = _Ops(st.interpret)

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref = next(it), next(it), next(it), next(it)
        qseg_ref, kvseg_ref = (next(it), next(it)) if st.has_seg else (None, None)
        o_ref = next(it)
        o2_ref, lse_ref = (next(it), next(it)) if save_residuals else (None, None)
        q_smem, k_smem, v_smem, lam_smem, qseg_smem, kvseg_smem, o2_smem, lse_smem = next(it)
        q_ready, kv_ready, kv_free, o2_ready, o2_free, sched = next(it)

        b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), _q_block(st, Tp // bq)
        kh = lax.div(h, jnp.int32(st.R))
        t0 = i * bq
        wg = lax.axis_index("wg")
        unmasked, steps = _kv_steps(st, t0, nk)

        def schedule():  # pingpong: one consumer's softmax overlaps the other's wgmmas
            if st.pingpong:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        @pl.when(wg == 2)
        def _producer():
            _set_registers(st, producer=True)
            rows = pl.ds(t0, bq)
            for m in range(2):
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h, m], q_smem.at[m], q_ready)
            plgpu.copy_gmem_to_smem(lam_ref.at[b, h, rows], lam_smem, q_ready)
            if st.has_seg:
                plgpu.copy_gmem_to_smem(qseg_ref.at[b, rows], qseg_smem, q_ready)

            def load(step, slot):
                _copy_kv_rows((k_ref, v_ref, kvseg_ref), (k_smem, v_smem, kvseg_smem), slot, b, kh, pl.ds(step * bk, bk), kv_ready.at[slot])

            _producer_loop(steps, stages, kv_free, load)

        def consumer(g: int):
            _set_registers(st, producer=False)
            plgpu.barrier_wait(q_ready)
            q_g = q_smem.at[g]
            q_seg = ops.load(qseg_smem, WGMMA.reduce(1)) if st.has_seg else None
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
                    mask = _score_mask(ops, st, (bq, bk), t0, step * bk, q_seg, kv_seg)
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
            rows = pl.ds(t0, bq)
            if save_residuals:
                lse_smem.at[g][...] = jnp.where(empty, jnp.inf, m_i + jnp.log2(l_safe))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lse_smem.at[g], lse_ref.at[b, h, g, rows])
            if g == 1:  # hand O_2 to consumer 0, d columns at a time; also the fp32 residual
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
    smem = (
        plgpu.SMEM((2, bq, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, G, bk, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, bk, dv), dtype, transforms=v_tf),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((bq,), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((stages, bk), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((bq, d), jnp.float32, transforms=_tiled(d, jnp.float32)),
        plgpu.SMEM((2, bq), jnp.float32) if save_residuals else None,
    )
    barriers = (
        plgpu.Barrier(num_arrivals=3 + st.has_seg),
        plgpu.Barrier(num_arrivals=G + 1 + st.has_seg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2),
    )
    out_type = [jax.ShapeDtypeStruct((B, Tp, H, dv), dtype)]
    if save_residuals:
        out_type += [jax.ShapeDtypeStruct((B, Tp, H, dv), jnp.float32), jax.ShapeDtypeStruct((B, H, 2, Tp), jnp.float32)]
    args = [q, k, v, lam] + ([q_seg, kv_seg] if st.has_seg else [])
    return _launch(st, kernel, out_type, (smem, barriers), (H, Tp // bq, B), ("heads", "q_blocks", "batch"), "diffjax_mgpu_fwd")(*args)


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


def _copy_query_rows(srcs, dsts, b, h, rows, barrier):
    """TMA copies of one block of query rows for the backward kernels: q for both maps, dO in two
    column halves, lse and D per map, lambda, and the query segment ids when present."""
    q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref = srcs
    q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem = dsts
    dvh = do_ref.shape[-1] // 2
    for m in range(2):
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h, m], q_smem.at[m], barrier)
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h, pl.ds(m * dvh, dvh)], do_smem.at[m], barrier)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, m, rows], lse_smem.at[m], barrier)
        plgpu.copy_gmem_to_smem(D_ref.at[b, h, m, rows], D_smem.at[m], barrier)
    plgpu.copy_gmem_to_smem(lam_ref.at[b, h, rows], lam_smem, barrier)
    if qseg_ref is not None:
        plgpu.copy_gmem_to_smem(qseg_ref.at[b, rows], qseg_smem, barrier)


def _dq(st: _Static, q, k, v, lam, q_seg, kv_seg, do, lse, D):
    """dq [B, Tp, H, 2, d]: one CTA per (batch, head, q block); consumer g accumulates dQ_g."""
    st = st._replace(bk=st.bk_dq)
    B, Tp, H, _, d = q.shape
    Sp, dv = k.shape[1], v.shape[-1]
    dtype = q.dtype
    bq, bk, stages, G = st.bq, st.bk, st.stages, st.G
    dvh = dv // 2
    nk = Sp // bk
    ops = _Ops(st.interpret)

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref = next(it), next(it), next(it), next(it)
        qseg_ref, kvseg_ref = (next(it), next(it)) if st.has_seg else (None, None)
        do_ref, lse_ref, D_ref, dq_ref = next(it), next(it), next(it), next(it)
        q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem, k_smem, v_smem, kvseg_smem, x_smem = next(it)
        q_ready, kv_ready, kv_free, xbar = next(it)

        b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), _q_block(st, Tp // bq)
        kh = lax.div(h, jnp.int32(st.R))
        t0 = i * bq
        wg = lax.axis_index("wg")
        unmasked, steps = _kv_steps(st, t0, nk)

        @pl.when(wg == 2)
        def _producer():
            _set_registers(st, producer=True)
            _copy_query_rows(
                (q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref), (q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem),
                b, h, pl.ds(t0, bq), q_ready,
            )

            def load(step, slot):
                _copy_kv_rows((k_ref, v_ref, kvseg_ref), (k_smem, v_smem, kvseg_smem), slot, b, kh, pl.ds(step * bk, bk), kv_ready.at[slot])

            _producer_loop(steps, stages, kv_free, load)

        def consumer(g: int):
            _set_registers(st, producer=False)
            plgpu.barrier_wait(q_ready)
            lse_g = ops.load(lse_smem.at[g], WGMMA.reduce(1))
            D_g = ops.load(D_smem.at[g], WGMMA.reduce(1))
            lam_row = ops.load(lam_smem, WGMMA.reduce(1))
            q_seg = ops.load(qseg_smem, WGMMA.reduce(1)) if st.has_seg else None

            def step_body(step, dq_acc, *, masked: bool):
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[slot])
                k_g = k_smem.at[slot, g if G == 2 else 0]
                s = ops.matmul(q_smem.at[g], k_g, (bq, bk), transpose_b=True) * st.scale2
                if masked:
                    kv_seg = ops.load(kvseg_smem.at[slot], WGMMA.reduce(0)) if st.has_seg else None
                    mask = _score_mask(ops, st, (bq, bk), t0, step * bk, q_seg, kv_seg)
                    if mask is not None:
                        s = jnp.where(mask, s, -jnp.inf)
                p = jnp.exp2(s - _rows(lse_g, (bq, bk)))
                dp_half = ops.matmul(do_smem.at[g], v_smem.at[slot, g], (bq, bk), transpose_b=True)
                (dp,) = _exchange_sum(ops, g, [(x_smem, dp_half)], xbar)
                ds = p * (dp - _rows(D_g, (bq, bk)))
                if g == 1:
                    ds = ds * _rows(-lam_row, (bq, bk))
                dq_acc = ops.matmul(ds.astype(dtype), k_g, (bq, d), acc=dq_acc)
                plgpu.barrier_arrive(kv_free.at[slot])
                return dq_acc

            dq_acc = lax.fori_loop(0, unmasked, functools.partial(step_body, masked=False), ops.full((bq, d), 0.0))
            dq_acc = lax.fori_loop(unmasked, steps, functools.partial(step_body, masked=True), dq_acc)
            q_smem.at[g][...] = (dq_acc * st.scale).astype(dtype)  # only this consumer reads q_g
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[g], dq_ref.at[b, pl.ds(t0, bq), h, g])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: consumer(0))
        pl.when(wg == 1)(lambda: consumer(1))

    qk_tf, vh_tf = _tiled(d, dtype), _tiled(dvh, dtype)
    smem = (
        plgpu.SMEM((2, bq, d), dtype, transforms=qk_tf),
        plgpu.SMEM((2, bq, dvh), dtype, transforms=vh_tf),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((bq,), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((stages, G, bk, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, 2, bk, dvh), dtype, transforms=vh_tf),
        plgpu.SMEM((stages, bk), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((bq, bk), jnp.float32, transforms=_tiled(bk, jnp.float32)),
    )
    barriers = (
        plgpu.Barrier(num_arrivals=9 + st.has_seg),
        plgpu.Barrier(num_arrivals=G + 2 + st.has_seg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    )
    args = [q, k, v, lam] + ([q_seg, kv_seg] if st.has_seg else []) + [do, lse, D]
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    return _launch(st, kernel, out_type, (smem, barriers), (H, Tp // bq, B), ("heads", "q_blocks", "batch"), "diffjax_mgpu_bwd_dq")(*args)


def _q_steps(st: _Static, j, nq):
    """For kv block j of the dk/dv kernel: (first q block, first q block that needs no mask, q blocks)."""
    bk, bqb = 64, st.bq_bwd
    k0 = j * bk
    if st.causal:
        first = jnp.clip(jnp.maximum(k0 - st.offset, 0) // bqb, 0, nq)
        full = jnp.clip(_cdiv_dyn(k0 + bk - 1 - st.offset, bqb), first, nq)
    else:
        first, full = jnp.int32(0), jnp.int32(0)
    if st.has_seg:
        full = jnp.int32(nq)
    elif st.Sp != st.S:
        full = jnp.where(k0 + bk > st.S, nq, full)  # this block holds padded keys
    return first, full


def _dkdv(st: _Static, q, k, v, lam, q_seg, kv_seg, do, lse, D):
    """dk [B, Sp, K, 2, d] (one slice per map) and dv [B, Sp, K, dv]: one CTA per (batch, kv head,
    64-row kv block), streaming (query head of the group, q block) tiles; consumer g accumulates dK_g
    and the g-th column half of dV."""
    B, Tp, H, _, d = q.shape
    Sp, K, dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = q.dtype
    bk, bqb, stages, G, R = 64, st.bq_bwd, st.stages, st.G, st.R
    dvh = dv // 2
    nq = Tp // bqb
    ops = _Ops(st.interpret)
    bst = st._replace(bk=bk, bq=bqb)  # masks in this kernel: kv rows of 64, q columns of bqb

    def kernel(*refs):
        it = iter(refs)
        q_ref, k_ref, v_ref, lam_ref = next(it), next(it), next(it), next(it)
        qseg_ref, kvseg_ref = (next(it), next(it)) if st.has_seg else (None, None)
        do_ref, lse_ref, D_ref, dk_ref, dv_ref = next(it), next(it), next(it), next(it), next(it)
        k_smem, v_smem, kvseg_smem, q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem, x_dp, x_p = next(it)
        kv_ready, q_ready, q_free, xbar = next(it)

        b, kh, j = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("kv_blocks")
        k0 = j * bk
        wg = lax.axis_index("wg")
        first, full = _q_steps(st, j, nq)
        per_rep = nq - first
        steps = R * per_rep

        @pl.when(wg == 2)
        def _producer():
            _set_registers(st, producer=True)
            keys = pl.ds(k0, bk)
            for g in range(G):
                plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, g], k_smem.at[g], kv_ready)
            for c in range(2):
                plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh, pl.ds(c * dvh, dvh)], v_smem.at[c], kv_ready)
            if st.has_seg:
                plgpu.copy_gmem_to_smem(kvseg_ref.at[b, keys], kvseg_smem, kv_ready)

            def load(step, slot):
                h = kh * R + lax.div(step, per_rep)
                rows = pl.ds((first + lax.rem(step, per_rep)) * bqb, bqb)
                slots = [None if ref is None else ref.at[slot] for ref in (q_smem, do_smem, lse_smem, D_smem, lam_smem, qseg_smem)]
                _copy_query_rows((q_ref, do_ref, lse_ref, D_ref, lam_ref, qseg_ref), slots, b, h, rows, q_ready.at[slot])

            _producer_loop(steps, stages, q_free, load)

        def consumer(g: int):
            _set_registers(st, producer=False)
            plgpu.barrier_wait(kv_ready)
            k_g = k_smem.at[g if G == 2 else 0]
            kv_seg = ops.load(kvseg_smem, WGMMA.reduce(1)) if st.has_seg else None

            def step_body(i, carry, *, rep, masked: bool):
                dk_acc, dv_acc = carry
                step = rep * per_rep + i - first
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(q_ready.at[slot])
                cols = lambda ref: ops.load(ref, WGMMA.reduce(0))  # noqa: E731  (per-query vectors)
                lse_g, D_g, lam_col = cols(lse_smem.at[slot, g]), cols(D_smem.at[slot, g]), cols(lam_smem.at[slot])
                sT = ops.matmul(k_g, q_smem.at[slot, g], (bk, bqb), transpose_b=True) * st.scale2
                if masked:
                    q_seg = cols(qseg_smem.at[slot]) if st.has_seg else None
                    mask = _score_mask(ops, bst, (bk, bqb), i * bqb, k0, q_seg, kv_seg, transposed=True)
                    if mask is not None:
                        sT = jnp.where(mask, sT, -jnp.inf)
                pT = jnp.exp2(sT - _cols(lse_g, (bk, bqb)))
                neg_lam = _cols(-lam_col, (bk, bqb))
                cpT = pT if g == 0 else pT * neg_lam  # this map's share of P_1 - lam P_2
                dpT_half = ops.matmul(v_smem.at[g], do_smem.at[slot, g], (bk, bqb), transpose_b=True)
                dpT, pcT = _exchange_sum(ops, g, [(x_dp, dpT_half), (x_p, cpT)], xbar)
                dsT = pT * (dpT - _cols(D_g, (bk, bqb)))
                if g == 1:
                    dsT = dsT * neg_lam
                dk_acc = ops.matmul(dsT.astype(dtype), q_smem.at[slot, g], (bk, d), acc=dk_acc)
                dv_acc = ops.matmul(pcT.astype(dtype), do_smem.at[slot, g], (bk, dvh), acc=dv_acc)
                plgpu.barrier_arrive(q_free.at[slot])
                return dk_acc, dv_acc

            def rep_body(rep, carry):
                carry = lax.fori_loop(first, full, functools.partial(step_body, rep=rep, masked=True), carry)
                return lax.fori_loop(full, nq, functools.partial(step_body, rep=rep, masked=False), carry)

            dk_acc, dv_acc = lax.fori_loop(0, R, rep_body, (ops.full((bk, d), 0.0), ops.full((bk, dvh), 0.0)))
            _rendezvous(xbar)  # both consumers are done with k and v: stage the results there
            k_smem.at[g][...] = (dk_acc * st.scale).astype(dtype)
            v_smem.at[g][...] = dv_acc.astype(dtype)
            plgpu.commit_smem()
            keys = pl.ds(k0, bk)
            plgpu.copy_smem_to_gmem(k_smem.at[g], dk_ref.at[b, keys, kh, g])
            plgpu.copy_smem_to_gmem(v_smem.at[g], dv_ref.at[b, keys, kh, pl.ds(g * dvh, dvh)])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: consumer(0))
        pl.when(wg == 1)(lambda: consumer(1))

    qk_tf, vh_tf = _tiled(d, dtype), _tiled(dvh, dtype)
    x_tf = _tiled(bqb, jnp.float32)
    smem = (
        plgpu.SMEM((2, bk, d), dtype, transforms=qk_tf),
        plgpu.SMEM((2, bk, dvh), dtype, transforms=vh_tf),
        plgpu.SMEM((bk,), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((stages, 2, bqb, d), dtype, transforms=qk_tf),
        plgpu.SMEM((stages, 2, bqb, dvh), dtype, transforms=vh_tf),
        plgpu.SMEM((stages, 2, bqb), jnp.float32),
        plgpu.SMEM((stages, 2, bqb), jnp.float32),
        plgpu.SMEM((stages, bqb), jnp.float32),
        plgpu.SMEM((stages, bqb), jnp.int32) if st.has_seg else None,
        plgpu.SMEM((bk, bqb), jnp.float32, transforms=x_tf),
        plgpu.SMEM((bk, bqb), dtype, transforms=_tiled(bqb, dtype)),  # P shares: rounded for the dV wgmma anyway
    )
    barriers = (
        plgpu.Barrier(num_arrivals=G + 2 + st.has_seg),
        plgpu.Barrier(num_arrivals=9 + st.has_seg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    )
    args = [q, k, v, lam] + ([q_seg, kv_seg] if st.has_seg else []) + [do, lse, D]
    out_type = [jax.ShapeDtypeStruct((B, Sp, K, 2, d), dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    return _launch(st, kernel, out_type, (smem, barriers), (K, Sp // bk, B), ("kv_heads", "kv_blocks", "batch"), "diffjax_mgpu_bwd_dkdv")(*args)


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
        interpret=_interpret_params() if st.interpret else None,
        kernel_name=name,
    )


def _interpret_params():
    if hasattr(plgpu, "InterpretGPUParams"):  # jax >= 0.11
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret import params

    return params.InterpretGPUParams()


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
    """Why impl="pallas_gpu" cannot run these shapes (None when it can)."""
    B, T, H, two, d = q.shape
    _, S, K, G, dk = k.shape
    dv = v.shape[-1]
    if two != 2 or G not in (1, 2):
        return f"needs q [B, T, H, 2, d] and k [B, S, Hkv, 1 or 2, d], got {q.shape} and {k.shape}"
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs q, k, v in one of bfloat16 / float16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if d != dk or d not in (64, 128):
        return f"needs the q and k head dim d in (64, 128), got {d} and {dk}"
    if dv not in (d, 2 * d):
        return f"needs dv = d or 2d, got dv = {dv} with d = {d}"
    if H % K:
        return f"needs query heads ({H}) to be a multiple of kv heads ({K})"
    bs = default_tuning(d, dv, G, q.dtype) if tuning is None else Tuning(*tuning)
    if bs.block_q != 64 or any(b not in (64, 128) for b in bs[1:4]) or bs.stages < 2:
        # 64: a wgmma row tile per consumer; the others are contraction sizes of 16-bit wgmmas with a
        # 128-byte swizzle, which must be multiples of 64
        return f"needs block_q = 64, block_k / block_k_dq / block_q_bwd in (64, 128) and stages >= 2, got {bs}"
    need = _smem_bytes(d, dv, G, bs, q.dtype)
    over = {kernel: n for kernel, n in need.items() if n + SMEM_MARGIN > SMEM_BYTES}
    if over:
        return f"needs {over} bytes of shared memory with {bs}, more than the {SMEM_BYTES - SMEM_MARGIN} a Hopper CTA has for tiles; use smaller blocks or fewer stages"
    return None


def default_tuning(d, dv, G, dtype) -> Tuning:
    """The largest block of each kernel (128 or 64) whose shared memory fits, with 2 stages."""
    chosen = {}
    for field, kernel in (("block_k", "forward"), ("block_k_dq", "dq"), ("block_q_bwd", "dkdv")):
        for size in (128, 64):
            bs = Tuning(**{**chosen, field: size})
            if _smem_bytes(d, dv, G, bs, dtype)[kernel] + SMEM_MARGIN <= SMEM_BYTES:
                break
        chosen[field] = size
    return Tuning(**chosen)


def _smem_bytes(d, dv, G, bs: Tuning, dtype):
    """Shared memory each kernel allocates (tiles and exchange buffers; barriers are negligible)."""
    e = jnp.dtype(dtype).itemsize
    bq, bk, bkq, bqb, n = bs.block_q, bs.block_k, bs.block_k_dq, bs.block_q_bwd, bs.stages
    return {
        "forward": 2 * bq * d * e + n * bk * (G * d + dv) * e + bq * d * 4 + n * bk * 4 + 3 * bq * 4,
        "dq": (2 * d + dv) * bq * e + n * bkq * (G * d + dv) * e + bq * bkq * 4 + n * bkq * 4 + 6 * bq * 4,
        "dkdv": (2 * d + dv) * 64 * e + n * bqb * (2 * d + dv) * e + 64 * bqb * (4 + e) + n * bqb * 24 + 64 * 4,
    }


def diff_attention_pallas_gpu(q_BTH2d, k_BSKGd, v_BSKv, lam, *, causal=True, segment_ids=None, scale=None, tuning=None, interpret=None):
    """Fused differential attention on Hopper; same contract as diffjax.ops.diff_attention.
    tuning: a Tuning (or a tuple of its fields); default `default_tuning` for the shape."""
    B, T, H, _, d = q_BTH2d.shape
    _, S, K, G, _ = k_BSKGd.shape
    why_not = unsupported(q_BTH2d, k_BSKGd, v_BSKv, tuning)
    if why_not:
        raise ValueError(f"diff_attention: impl='pallas_gpu' {why_not}")
    bs = default_tuning(d, v_BSKv.shape[-1], G, q_BTH2d.dtype) if tuning is None else Tuning(*tuning)
    Tp, Sp = _round_up(T, math.lcm(bs.block_q, bs.block_q_bwd)), _round_up(S, math.lcm(bs.block_k, bs.block_k_dq, 64))
    # lam rounded to the value dtype like the reference, then fp32; broadcasting to [B, T, H] makes
    # autodiff sum dlam for a scalar lambda.
    lam_BTH = jnp.broadcast_to(jnp.asarray(lam).astype(v_BSKv.dtype).astype(jnp.float32), (B, T, H))
    lam_BHT = _pad_axis(lam_BTH.transpose(0, 2, 1), 2, Tp)
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_ids, kv_ids = split_segment_ids(segment_ids, B, T, S)
        q_seg, kv_seg = _pad_axis(q_ids.astype(jnp.int32), 1, Tp), _pad_axis(kv_ids.astype(jnp.int32), 1, Sp)
    st = _Static(
        G=G, R=H // K, T=T, S=S, Sp=Sp, bq=bs.block_q, bk=bs.block_k, bk_dq=bs.block_k_dq, bq_bwd=bs.block_q_bwd, stages=bs.stages, pingpong=bool(bs.pingpong),
        causal=bool(causal), scale=float(d**-0.5 if scale is None else scale), has_seg=q_seg is not None,
        interpret=(jax.default_backend() != "gpu") if interpret is None else bool(interpret),
    )
    q = _pad_axis(q_BTH2d, 1, Tp)
    k = _pad_axis(k_BSKGd, 1, Sp)
    v = _pad_axis(v_BSKv, 1, Sp)
    o_BTHv = _flash(st, q, k, v, lam_BHT, q_seg, kv_seg)
    return o_BTHv[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, lam, q_seg, kv_seg):
    return _forward(st, q, k, v, lam, q_seg, kv_seg, save_residuals=False)[0]


def _flash_fwd(st, q, k, v, lam, q_seg, kv_seg):
    o, o2, lse = _forward(st, q, k, v, lam, q_seg, kv_seg, save_residuals=True)
    return o, (q, k, v, lam, q_seg, kv_seg, o, o2, lse)


def _flash_bwd(st, res, do):
    q, k, v, lam, q_seg, kv_seg, o, o2, lse = res
    do = do.astype(q.dtype)
    do32 = do.astype(jnp.float32)
    lam_BTH1 = lam.transpose(0, 2, 1)[..., None]
    o1 = o.astype(jnp.float32) + lam_BTH1 * o2  # the un-mixed first map, from the rounded output
    D_BHMT = jnp.stack([jnp.einsum("bthv,bthv->bht", do32, o1), jnp.einsum("bthv,bthv->bht", do32, o2)], axis=2)
    dq = _dq(st, q, k, v, lam, q_seg, kv_seg, do, lse, D_BHMT)
    dk_BSK2d, dv = _dkdv(st, q, k, v, lam, q_seg, kv_seg, do, lse, D_BHMT)
    dk = dk_BSK2d if st.G == 2 else dk_BSK2d.astype(jnp.float32).sum(axis=3, keepdims=True).astype(k.dtype)
    dlam = -D_BHMT[:, :, 1]
    return dq, dk, dv, dlam, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
