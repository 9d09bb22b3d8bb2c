"""What the three Mosaic GPU kernels share: the Tuning, the interpret shims, the static configuration, the
step ranges and masks, the TMA copies of streamed rows, the consumers' exchange and the launch."""

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

LOG2E = math.log2(math.e)
WGMMA = plgpu.Layout.WGMMA  # the register layout of wgmma accumulators; .reduce(1) rows, .reduce(0) columns
SMEM_BYTES = 227 * 1024  # Hopper: dynamic shared memory a CTA may use
SMEM_MARGIN = 2048  # barriers, alignment padding


class Tuning(NamedTuple):
    """Kernel settings. block_q = 64 (one wgmma row tile per consumer); the block sizes default to
    the larger of 128 / 64 whose tiles fit in shared memory and whose step does not spill (`default_tuning`)."""

    block_q: int = 64
    block_k: int = 64  # forward: keys per streamed step
    block_k_dq: int = 64  # dq kernel: keys per streamed step
    block_q_bwd: int = 64  # dk/dv kernel: query rows per streamed step
    stages: int = 2  # ring slots for streamed tiles
    pingpong: bool = True  # forward: alternate the consumers' softmax and wgmmas (FA3)
    dkdv: str = "lean"  # the differential dk/dv consumers' schedule, one of DKDV_VARIANTS (package docstring)


# Tuning.dkdv's values, the default first (the package docstring says what each does and what ptxas makes of it):
# "exchange" is the first kernel, kept as the sweep's baseline; "lean" its algebra with a small live set; "dp_whole"
# and "dv_smem" compute the whole dP in each consumer, so that only the P shares meet.
DKDV_VARIANTS = ("lean", "exchange", "dp_whole", "dv_smem")


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

    def iota(self, shape, dim, layout=None):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout or WGMMA)

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
        scalar = lambda i: isinstance(i, int) or (hasattr(i, "shape") and i.shape == ())
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


def _set_registers(st: _Static, producer: bool, consumer: int = 232):
    """Hand the producer's registers to the consumers (setmaxnreg): `consumer` registers a consumer thread (232, or
    FA3's 240), the producer the rest of 504 (40, or 24; 2 x consumer + producer <= 512 a thread)."""
    if not st.interpret:
        registers, action = (504 - 2 * consumer, "decrease") if producer else (consumer, "increase")
        plgpu.set_max_registers(registers, action=action)


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
    dkdv: str = "lean"  # Tuning.dkdv
    window: int | None = None  # sliding window: each query sees its `window` latest keys (causal only)

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


class _Steps(NamedTuple):
    """A range of streamed blocks: [first, end) hold a pair some row sees (the rest are never loaded); of those,
    [full_from, full_to) need no mask at all."""

    first: jax.Array
    full_from: jax.Array
    full_to: jax.Array
    end: jax.Array


def _kv_steps(st: _Static, offset, t0, rows, nk) -> _Steps:
    """The kv blocks for the query rows [t0, t0 + rows) (query t sits at key t + offset): blocks past the causal
    diagonal, or behind every row's sliding window, are skipped."""
    if st.causal:
        end = jnp.clip(_cdiv_dyn(t0 + rows + offset, st.bk), 0, nk)  # one past the last row's last key
        full_to = jnp.maximum(t0 + offset + 1, 0) // st.bk  # blocks the first row sees whole
    else:
        end = full_to = jnp.int32(nk)
    if st.window is None:
        first = full_from = jnp.int32(0)
    else:  # query t sees keys t + offset - window + 1 .. t + offset
        first = jnp.clip(jnp.maximum(t0 + offset - st.window + 1, 0) // st.bk, 0, end)
        full_from = _cdiv_dyn(t0 + rows + offset - st.window, st.bk)  # blocks inside the last row's window
    if st.has_seg:
        full_to = full_from
    elif st.Sp != st.S:
        full_to = jnp.minimum(full_to, st.S // st.bk)  # blocks from here on hold padded keys
    return _clipped(first, full_from, full_to, end)


def _clipped(first, full_from, full_to, end) -> _Steps:
    full_from = jnp.clip(full_from, first, end)
    return _Steps(first, full_from, jnp.clip(full_to, full_from, end), end)


def _run_steps(step_body, ring: _Steps, own: _Steps, carry, unmasked=False):
    """step_body(step, carry, masked=...) over the ring's steps [ring.first, ring.end) (a CTA's consumers all run
    every streamed step), with masked=`unmasked` where `own` (this consumer's rows) needs no mask, else True."""
    lo = jnp.clip(own.full_from, ring.first, ring.end)
    hi = jnp.clip(own.full_to, lo, ring.end)
    carry = lax.fori_loop(ring.first, lo, functools.partial(step_body, masked=True), carry)
    carry = lax.fori_loop(lo, hi, functools.partial(step_body, masked=unmasked), carry)
    return lax.fori_loop(hi, ring.end, functools.partial(step_body, masked=True), carry)


def _q_block(st: _Static, nq):
    """This CTA's query block. Causal: the last (longest) blocks are launched first, so the short ones
    fill the tail of the grid."""
    i = lax.axis_index("q_blocks")
    return nq - 1 - i if st.causal else i


def _cdiv_dyn(a, b):
    return lax.div(jnp.maximum(a, 0) + (b - 1), jnp.int32(b))


def _score_mask(ops, st: _Static, offset, shape, q0, k0, q_seg=None, kv_seg=None, *, transposed=False, q_iota=None):
    """Boolean mask (True = allowed) for a tile whose rows are queries q0.. and columns keys k0..
    (or the transpose). Segment ids are row/column vectors already in the matching layouts; so is q_iota, when
    given: 0, 1, .. along the query axis, loaded from SMEM where used rather than made by an iota, whose per-element
    values LLVM hoists out of the step loop as loop invariants (registers held across every step)."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    q_pos = (ops.iota(shape, q_dim) if q_iota is None else lax.broadcast_in_dim(q_iota, shape, [q_dim])) + q0
    k_pos = ops.iota(shape, k_dim) + k0
    mask = None
    if st.causal:
        mask = q_pos + offset >= k_pos
    if st.window is not None:
        mask = mask & (q_pos + offset - k_pos < st.window)
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


def _q_steps(st: _Static, offset, k0, rows: int, nq) -> _Steps:
    """The query blocks of the dk/dv kernel for the kv rows [k0, k0 + rows): blocks before the causal diagonal, or
    whose rows' windows all lie past these keys, are skipped."""
    bqb = st.bq_bwd
    if st.causal:
        first = jnp.clip(jnp.maximum(k0 - offset, 0) // bqb, 0, nq)
        full_from = _cdiv_dyn(k0 + rows - 1 - offset, bqb)  # blocks whose rows all see the last key
    else:
        first = full_from = jnp.int32(0)
    if st.window is None:
        end = full_to = jnp.int32(nq)
    else:  # key k is seen by the queries t with k - offset <= t <= k - offset + window - 1
        end = jnp.clip(_cdiv_dyn(k0 + rows - 1 - offset + st.window, bqb), first, nq)
        full_to = jnp.maximum(k0 - offset + st.window, 0) // bqb  # blocks whose rows all still see the first key
    if st.has_seg:
        full_to = full_from
    elif st.Sp != st.S:
        full_to = jnp.where(k0 + rows > st.S, full_from, full_to)  # these rows hold padded keys
    return _clipped(first, full_from, full_to, end)


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
