"""impl="pallas_gpu", the Mosaic GPU kernels (diffjax.ops.pallas_gpu), against the XLA reference.

CI has no GPU, so three layers:
- `gpu`-marked: compiled on a Hopper GPU, the forward output and all four gradients over the TPU
  kernel's grid (the same structural cases, with the head dims this kernel takes: d in 64 / 128,
  dv = d or 2d) plus long sequences; the single-map mode's, and Motif 3's GDLA call (d 192, dv 128,
  windowed and global). Run there:
      JAX_PLATFORMS=cuda python -m pytest -m gpu tests/test_ops_pallas_gpu.py
- CPU, Mosaic GPU interpret mode: the same kernel code (TMA copies, barriers and their phases, the
  warpgroup schedule, masks, online softmax, the SMEM exchanges between consumers) on small shapes;
  only wgmma, layout casts and layout-aware loads go through jnp equivalents (pallas_gpu._Ops).
- CPU, lowering for CUDA: Mosaic GPU's compiler front end (wgmma shapes, register layouts, the
  shared-memory budget) accepts forward + backward for every supported head shape at the default
  blocks. PTX generation and the run itself need the GPU.
- CPU, the step ranges: which kv (query) blocks each consumer streams, masked or not, against the mask,
  with and without a sliding window.

Tolerances as in test_ops_pallas_tpu: against the float32 reference on the same 16-bit inputs, within
2x the error the 16-bit reference itself makes there plus 4 bf16 ulps.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops
from diffjax.jax_compat import H100, lowering_target
from diffjax.ops.pallas_gpu import Tuning, default_tuning, diff_attention_pallas_gpu, dot_product_attention_pallas_gpu, unsupported
from diffjax.ops.pallas_gpu.common import DKDV_VARIANTS, _kv_steps, _q_steps, _run_steps, _Static
from diffjax.ops.reference import diff_attention_xla, dot_product_attention_xla
from test_ops_pallas_tpu import BF16_SLACK, _fully_masked_rows, _rel, _segments

LABELS = ("o", "dq", "dk", "dv", "dlambda")

# name: (B, T, S, H, K, G, d, dv, causal, per_token_lambda, segments, dtype)
GPU_CASES = {
    "causal-T>S-rep1-G2-scalar": (1, 200, 136, 2, 2, 2, 64, 128, True, False, None, "bfloat16"),
    "full-rep2-G2-token-d128": (2, 256, 256, 4, 2, 2, 128, 256, False, True, None, "bfloat16"),
    "causal-rep4-G1-token-seg-f16": (1, 300, 300, 4, 1, 1, 128, 128, True, True, "same", "float16"),
    "causal-T<S-rep2-pairseg": (1, 136, 264, 4, 2, 2, 64, 128, True, True, "pair", "bfloat16"),
    "causal-rep2-G2-token-seg-d128": (1, 512, 512, 4, 2, 2, 128, 256, True, True, "same", "bfloat16"),
    "full-rep4-G1-scalar-f16": (1, 136, 136, 4, 1, 1, 64, 64, False, False, None, "float16"),
    "causal-long-d128": (1, 4096, 4096, 2, 2, 2, 128, 256, True, True, None, "bfloat16"),
}
# Interpret mode runs every warpgroup as a Python thread: seconds per kv step, so tiny shapes only.
INTERPRET_CASES = {  # causal with T < S, q / kv segment ids and lambda per token: OFFSET_CASES' diff case
    "full-rep1-G2-bf16": (1, 64, 64, 1, 1, 2, 64, 128, False, False, None, "bfloat16"),
    "causal-T>S-rep2-G1-f16": (1, 96, 64, 2, 1, 1, 64, 64, True, False, None, "float16"),
}
# Single-map (standard attention) mode. name: (B, T, S, N, K, d, causal, segments, dtype)
SINGLE_GPU_CASES = {
    "causal-gqa2-seg-d128": (2, 1024, 1024, 4, 2, 128, True, "same", "bfloat16"),
    "causal-T<S-pairseg-d64-f16": (1, 300, 520, 4, 1, 64, True, "pair", "float16"),
    "full-T>S-d128": (1, 520, 264, 2, 2, 128, False, None, "bfloat16"),
    "causal-long-d128": (1, 4096, 4096, 2, 1, 128, True, None, "bfloat16"),
}
# 64-row steps, so that each kernel streams several tiles through its 2-slot ring on tiny shapes.
SMALL_STEPS = Tuning(block_k=64, block_k_dq=64, block_q_bwd=64)
SINGLE_INTERPRET_CASES = {
    "causal-gqa2-seg-bf16": (1, 128, 128, 2, 1, 64, True, "same", "bfloat16"),
    "full-T<S-f16": (1, 64, 192, 1, 1, 64, False, None, "float16"),
}


def _inputs(case, seed=0):
    B, T, S, H, K, G, d, dv, causal, per_token, seg, dtype = case
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    q, k, v, ct = (jnp.asarray(rng.normal(size=s), dt) for s in ((B, T, H, 2, d), (B, S, K, G, d), (B, S, K, dv), (B, T, H, dv)))
    lam = jnp.asarray(rng.uniform(0.2, 0.9, size=(B, T, H)) if per_token else 0.6, jnp.float32)
    return q, k, v, lam, ct, _segments(rng, B, T, S, seg)


def _value_and_grads(fn, ct, *args):
    o, vjp = jax.vjp(fn, *args)
    return (o, *vjp(ct.astype(o.dtype)))


def _compare(measured, fused, xla, ct, args, dead_BT):
    """Output and every gradient of `fused` (16-bit q, k, v) against `xla` on the same inputs in
    float32; fully masked query rows (dead_BT) must give exactly zero output and dq."""
    got = _value_and_grads(fused, ct, *args)
    exact = _value_and_grads(xla, ct, *(a.astype(jnp.float32) for a in args))
    ref16 = _value_and_grads(xla, ct, *args)
    for label, g, r, e, x in zip(LABELS, got, ref16, exact, (ct, *args)):
        assert g.shape == x.shape and np.all(np.isfinite(np.asarray(g, np.float32))), label
        tol = 2 * _rel(r, e) + BF16_SLACK
        assert measured(f"{label} rel err vs f32 ref", _rel(g, e), tol) <= tol, label
    assert got[0].dtype == args[0].dtype
    if dead_BT.any():
        worst = max(float(jnp.abs(got[0][dead_BT]).max()), float(jnp.abs(got[1][dead_BT]).max()))
        assert measured("max |o|, |dq| on fully masked rows", worst, 0.0) == 0.0


def _check_against_reference(case, measured, *, interpret, tuning=None):
    causal = case[8]
    q, k, v, lam, ct, seg = _inputs(case)
    fused = jax.jit(lambda q, k, v, lam: diff_attention_pallas_gpu(q, k, v, lam, causal=causal, segment_ids=seg, tuning=tuning, interpret=interpret))
    xla = jax.jit(lambda q, k, v, lam: diff_attention_xla(q, k, v, lam, causal=causal, segment_ids=seg))
    _compare(measured, fused, xla, ct, (q, k, v, lam), _fully_masked_rows(*case[:3], causal, seg))


def _check_single_against_reference(case, measured, *, interpret, tuning=None, dv=None, window=None):
    """The single-map (standard attention) mode against dot_product_attention_xla (dv default d)."""
    B, T, S, N, K, d, causal, seg_kind, dtype = case
    dv = d if dv is None else dv
    rng = np.random.default_rng(1)
    q, k, v, ct = (jnp.asarray(rng.normal(size=s), jnp.dtype(dtype)) for s in ((B, T, N, d), (B, S, K, d), (B, S, K, dv), (B, T, N, dv)))
    seg = _segments(rng, B, T, S, seg_kind)
    kwargs = dict(causal=causal, segment_ids=seg, window=window)
    fused = jax.jit(lambda q, k, v: dot_product_attention_pallas_gpu(q, k, v, **kwargs, tuning=tuning, interpret=interpret))
    xla = jax.jit(lambda q, k, v: dot_product_attention_xla(q, k, v, **kwargs))
    _compare(measured, fused, xla, ct, (q, k, v), _fully_masked_rows(B, T, S, causal, seg))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_pallas_gpu_compiled_forward_and_grads(name, measured):
    _check_against_reference(GPU_CASES[name], measured, interpret=False)


# the differential dk/dv kernel's schedules other than the default (Tuning.dkdv)
OTHER_DKDV = [name for name in DKDV_VARIANTS if name != Tuning().dkdv]
OTHER_TUNINGS = [dict(pingpong=False), dict(stages=3, block_k=64, block_k_dq=64, block_q_bwd=64), dict(block_k=64, block_k_dq=64, block_q_bwd=64),
                 *(dict(dkdv=name) for name in OTHER_DKDV)]


@pytest.mark.gpu
@pytest.mark.parametrize("change", OTHER_TUNINGS)
def test_pallas_gpu_compiled_other_tunings(change, measured):
    """The settings benchmarks/pallas_gpu_sweep.py tries compute the same function (d = 64, where all fit)."""
    case = GPU_CASES["causal-T<S-rep2-pairseg"]
    _check_against_reference(case, measured, interpret=False, tuning=default_tuning(64, 128, 2, jnp.bfloat16)._replace(**change))


@pytest.mark.gpu
def test_pallas_gpu_through_ops_dispatch_and_shard_map(measured):
    """impl="pallas_gpu" through diffjax.ops, also under a one-device mesh (the per-device shard_map path)."""
    from diffjax import parallel
    from diffjax.train.mesh import ParallelConfig

    q, k, v, lam, ct, seg = _inputs(GPU_CASES["causal-rep2-G2-token-seg-d128"])
    want = ops.diff_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lam, segment_ids=seg, impl="xla")
    mesh = parallel.make_mesh(ParallelConfig(data=1))
    with parallel.activation_sharding(mesh):
        got = jax.jit(lambda q, k, v, lam: ops.diff_attention(q, k, v, lam, segment_ids=seg, impl="pallas_gpu"))(q, k, v, lam)
    assert measured("o rel err vs f32 ref", _rel(got, want), 2e-2) <= 2e-2


# The newest-jax CI leg and the fast lane run the cheapest case of each mode (the interpreter is what differs between
# versions).
def _cheapest_on_every_leg(cases, cheapest):
    slow_on_one_leg = [pytest.mark.single_leg, pytest.mark.slow]
    return [name if name == cheapest else pytest.param(name, marks=slow_on_one_leg) for name in cases]


@pytest.mark.parametrize("name", _cheapest_on_every_leg(INTERPRET_CASES, "full-rep1-G2-bf16"))
@pytest.mark.slow
def test_pallas_gpu_interpret_forward_and_grads(name, measured):
    _check_against_reference(INTERPRET_CASES[name], measured, interpret=True)


# Three q steps of the dk/dv kernel through its 2-slot ring (the consumers' SMEM meetings across steps), each
# masked (q / kv segment ids), lambda per token; the default schedule runs in every interpret test above.
DKDV_CASE = (1, 192, 64, 1, 1, 2, 64, 128, False, True, "pair", "bfloat16")


# (the old "exchange" kernel, the sweep's baseline, runs interpreted in the GPU session's dry run: test_capture)
@pytest.mark.parametrize("dkdv", [name for name in OTHER_DKDV if name != "exchange"])
@pytest.mark.slow
@pytest.mark.single_leg
def test_pallas_gpu_interpret_dkdv_variants(dkdv, measured):
    _check_against_reference(DKDV_CASE, measured, interpret=True, tuning=SMALL_STEPS._replace(dkdv=dkdv))


@pytest.mark.parametrize("name", _cheapest_on_every_leg(SINGLE_INTERPRET_CASES, "full-T<S-f16"))
def test_pallas_gpu_single_interpret_forward_and_grads(name, measured):
    _check_single_against_reference(SINGLE_INTERPRET_CASES[name], measured, interpret=True, tuning=SMALL_STEPS)


@pytest.mark.slow
@pytest.mark.single_leg
def test_pallas_gpu_single_interpret_128_row_steps(measured):
    """128-row steps, which the single-map dq and dk/dv consumers take as two 64-row sub-tiles in a loop: the second
    dq CTA's first kv step sees its keys whole (segment ids only), the diagonal steps mask both sub-tiles."""
    case = (1, 256, 256, 1, 1, 64, True, "same", "bfloat16")
    tuning = Tuning(block_k=128, block_k_dq=128, block_q_bwd=128)
    _check_single_against_reference(case, measured, interpret=True, tuning=tuning)


# Motif 3's GDLA call (scores d 192, values dv 128, GQA, causal, packed): windowed and global. name: (single-map case,
# dv, window)
GDLA_GPU_CASES = {
    "window129": ((1, 4096, 4096, 10, 2, 192, True, "same", "bfloat16"), 128, 129),
    "global": ((1, 4096, 4096, 10, 2, 192, True, "same", "bfloat16"), 128, None),
}
# A window of 40 over 64-row blocks at T = 256: the forward / dq skip the kv blocks behind the last CTA's rows, dk/dv
# the q blocks past the first kv CTA's windows (so the rings start past block 0), and masks cross both edges. One
# query head (interpret mode pays per head; GQA's head mapping is SINGLE_INTERPRET_CASES' causal-gqa2 case's).
GDLA_INTERPRET_CASE = ((1, 256, 256, 1, 1, 192, True, "same", "bfloat16"), 128, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GDLA_GPU_CASES))
def test_pallas_gpu_gdla_compiled_forward_and_grads(name, measured):
    case, dv, window = GDLA_GPU_CASES[name]
    _check_single_against_reference(case, measured, interpret=False, dv=dv, window=window)


@pytest.mark.slow
def test_pallas_gpu_interpret_gdla_window(measured):
    """d 192 / dv 128 with a sliding window, causal, packed segment ids: output and every gradient."""
    case, dv, window = GDLA_INTERPRET_CASE
    _check_single_against_reference(case, measured, interpret=True, tuning=SMALL_STEPS, dv=dv, window=window)


def _run_steps_taken(ring, own):
    """[blocks]: 0 = never loaded, 1 = run masked, 2 = run unmasked, as `_run_steps` runs a consumer's steps."""
    def body(step, taken, *, masked):
        return taken.at[step].set(1 if masked else 2)

    with jax.disable_jit():  # python loops: the bounds are concrete
        return np.asarray(_run_steps(body, ring, own, jnp.zeros(64, jnp.int32)))


def _expected_steps(visible, rows_ring, rows_own, block, transposed=False):
    """What `_run_steps_taken` must give: a block is loaded iff some pair of the ring's rows sees it, unmasked iff
    every pair of this consumer's rows does. visible: [queries, keys] (transposed: the rows are keys)."""
    visible = visible.T if transposed else visible
    n = visible.shape[1] // block
    blocks = lambda rows: visible[rows].reshape(len(range(*rows.indices(visible.shape[0]))), n, block)  # noqa: E731
    expected = np.where(blocks(rows_ring).any(axis=(0, 2)), 1, 0)
    expected[blocks(rows_own).all(axis=(0, 2))] = 2
    return np.pad(expected, (0, 64 - n))


# (T, S, window, q_offset): Motif 3's window, a window of one key, one block wide, T < S and T > S bottom-right, a
# query chunk placed mid-sequence (context parallelism's q_offset), and no window (causal only).
STEP_CASES = [(512, 512, 129, 0), (256, 256, 1, 0), (256, 256, 64, 0), (256, 640, 100, 384), (512, 256, 100, -256),
              (256, 1024, 200, 512), (512, 512, None, 0)]


@pytest.mark.parametrize("T, S, window, offset", STEP_CASES)
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("single", [True, False], ids=["single", "diff"])
def test_pallas_gpu_steps_load_only_blocks_a_row_sees_and_mask_only_where_needed(T, S, window, offset, block, single):
    """Every consumer's steps in the forward / dq (kv blocks) and dk/dv (query blocks) against the mask: a block is
    streamed iff a row of the CTA sees a key of it (so a windowed call costs T x W), and runs without a mask iff
    every pair of the consumer's rows sees it."""
    st = _Static(G=1, R=1, T=T, S=S, Sp=S, bq=64, bk=block, bk_dq=block, bq_bwd=block, stages=2, pingpong=True,
                 causal=True, scale=1.0, has_seg=False, interpret=True, single=single, window=window)
    pos = np.arange(T)[:, None] + offset - np.arange(S)[None, :]  # query position - key position
    visible = (pos >= 0) & (pos < (window or S + 1))
    consumers = (0, 1) if single else (0,)
    for t0 in range(0, T, st.cta_q):  # forward and dq: kv blocks of `block` keys per CTA of query rows
        ring = _kv_steps(st, offset, t0, st.cta_q, S // block)
        for g in consumers:
            r0 = t0 + 64 * g
            expected = _expected_steps(visible, slice(t0, t0 + st.cta_q), slice(r0, r0 + 64), block)
            got = _run_steps_taken(ring, _kv_steps(st, offset, r0, 64, S // block))
            np.testing.assert_array_equal(got, expected, err_msg=f"kv steps of query rows {r0}..{r0 + 63}")
    for k0 in range(0, S, st.cta_kv):  # dk/dv: query blocks of `block` rows per CTA of kv rows
        ring = _q_steps(st, offset, k0, st.cta_kv, T // block)
        for g in consumers:
            k0_g = k0 + 64 * g
            expected = _expected_steps(visible, slice(k0, k0 + st.cta_kv), slice(k0_g, k0_g + 64), block, True)
            got = _run_steps_taken(ring, _q_steps(st, offset, k0_g, 64, T // block))
            np.testing.assert_array_equal(got, expected, err_msg=f"q steps of kv rows {k0_g}..{k0_g + 63}")


# A query chunk placed in a longer sequence, as context parallelism calls the kernels: q_offset is the key
# position of the chunk's first query (traced: a jit argument). name: (mode, B, Tc, S, H, K, d, offset, dtype, window)
OFFSET_CASES = {
    # mid-sequence, not a block multiple: the diagonal crosses two kv blocks; packed documents, lambda per token
    "diff-G2-offset40-seg-bf16": ("diff", 1, 64, 128, 2, 1, 64, 40, "bfloat16", None),
    # the first chunk: every later kv block is skipped (the step count follows the offset, not S - T)
    "single-gqa2-offset0-seg-f16": ("single", 1, 64, 192, 2, 1, 64, 0, "float16", None),
    # a window of 40 keys behind a chunk at 128: kv blocks 0 and 3 are skipped, the differential mode's masks
    "diff-G2-offset128-window40-seg-bf16": ("diff", 1, 64, 256, 2, 1, 64, 128, "bfloat16", 40),
}
# Interpret mode pays per query head and per case (~10 CPU-s each): one head (GQA's head mapping is the offset-free
# interpret cases'), and one differential case for the two above, its offset not a block multiple (the diagonal
# crosses kv blocks 1 and 2) with a window of 40 behind it (blocks 0 and 3 skipped).
INTERPRET_OFFSET_CASES = {
    "single-offset0-seg-f16": ("single", 1, 64, 192, 1, 1, 64, 0, "float16", None),
    "diff-G2-offset104-window40-seg-bf16": ("diff", 1, 64, 256, 1, 1, 64, 104, "bfloat16", 40),
}


def _check_chunk_against_reference(case, measured, *, interpret):
    """The chunk's output and gradients against the XLA reference over the whole sequence (the chunk's queries in
    rows [offset, offset + Tc), the other rows zero), restricted to the chunk's rows."""
    mode, B, Tc, S, H, K, d, offset, dtype, window = case
    rng = np.random.default_rng(2)
    dt = jnp.dtype(dtype)
    kv_ids = jnp.asarray(np.sort(rng.integers(1, 4, size=(B, S))), jnp.int32)  # three packed documents
    ids = (kv_ids[:, offset:offset + Tc], kv_ids)
    if mode == "diff":
        q_shape, k_shape, dv = (B, Tc, H, 2, d), (B, S, K, 2, d), 2 * d
    else:
        q_shape, k_shape, dv = (B, Tc, H, d), (B, S, K, d), d
    q, k, v, ct = (jnp.asarray(rng.normal(size=s), dt) for s in (q_shape, k_shape, (B, S, K, dv), (B, Tc, H, dv)))
    lam = jnp.asarray(rng.uniform(0.2, 0.9, size=(B, Tc, H)), jnp.float32)

    def in_sequence(x):  # the chunk's rows placed in a whole sequence of S
        return jnp.zeros((B, S) + x.shape[2:], x.dtype).at[:, offset:offset + Tc].set(x)

    if mode == "diff":
        kernel = jax.jit(lambda q, k, v, lam, at: diff_attention_pallas_gpu(
            q, k, v, lam, causal=True, segment_ids=ids, q_offset=at, interpret=interpret, window=window))
        fused = lambda q, k, v, lam: kernel(q, k, v, lam, jnp.int32(offset))  # noqa: E731
        xla = jax.jit(lambda q, k, v, lam: diff_attention_xla(
            in_sequence(q), k, v, in_sequence(lam), causal=True, segment_ids=kv_ids, window=window)[:, offset:offset + Tc])
        args = (q, k, v, lam)
    else:
        kernel = jax.jit(lambda q, k, v, at: dot_product_attention_pallas_gpu(
            q, k, v, causal=True, segment_ids=ids, q_offset=at, interpret=interpret, window=window,
            tuning=SMALL_STEPS if interpret else None))
        fused = lambda q, k, v: kernel(q, k, v, jnp.int32(offset))  # noqa: E731
        xla = jax.jit(lambda q, k, v: dot_product_attention_xla(
            in_sequence(q), k, v, causal=True, segment_ids=kv_ids, window=window)[:, offset:offset + Tc])
        args = (q, k, v)
    _compare(measured, fused, xla, ct, args, np.zeros((B, Tc), bool))


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.single_leg) for name in INTERPRET_OFFSET_CASES])
@pytest.mark.slow
def test_pallas_gpu_interpret_query_offset(name, measured):
    _check_chunk_against_reference(INTERPRET_OFFSET_CASES[name], measured, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OFFSET_CASES))
def test_pallas_gpu_compiled_query_offset(name, measured):
    _check_chunk_against_reference(OFFSET_CASES[name], measured, interpret=False)


@pytest.mark.parametrize("single", [False, True], ids=["diff", "single"])
def test_pallas_gpu_traced_query_offset_lowers_for_cuda(single):
    """The offset as a traced jit argument (what each device of a context axis passes): forward and backward lower."""
    B, Tc, S, H, K, d = 1, 128, 512, 4, 2, 128
    q_shape, k_shape, dv = ((B, Tc, H, d), (B, S, K, d), d) if single else ((B, Tc, H, 2, d), (B, S, K, 2, d), 2 * d)
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (q_shape, k_shape, (B, S, K, dv)))
    lam = jax.ShapeDtypeStruct((B, Tc, H), jnp.float32)
    ids = (jnp.zeros((B, Tc), jnp.int32), jnp.zeros((B, S), jnp.int32))

    def loss(q, k, v, lam, offset):
        if single:
            o = dot_product_attention_pallas_gpu(q, k, v, causal=True, segment_ids=ids, q_offset=offset, interpret=False)
        else:
            o = diff_attention_pallas_gpu(q, k, v, lam, causal=True, segment_ids=ids, q_offset=offset, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    with lowering_target(H100) as cuda:
        text = (jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v, lam, jax.ShapeDtypeStruct((), jnp.int32))
                .lower(lowering_platforms=(cuda,)).as_text())
    prefix = "diffjax_mgpu_single" if single else "diffjax_mgpu"
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        assert f"{prefix}_{kernel}" in text


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SINGLE_GPU_CASES))
def test_pallas_gpu_single_compiled_forward_and_grads(name, measured):
    _check_single_against_reference(SINGLE_GPU_CASES[name], measured, interpret=False)


# (d, dv, window): dv = d; Motif 3's GDLA (d 192, dv 128) global and windowed (its 129 keys); the other corners.
SINGLE_LOWERING_CASES = [(64, 64, None), (128, 128, None), (192, 128, None), (192, 128, 129), (64, 192, 100),
                         (192, 192, None)]


@pytest.mark.parametrize("d, dv, window", SINGLE_LOWERING_CASES)
def test_pallas_gpu_single_lowers_for_cuda(d, dv, window):
    """Standard attention, causal with segment ids, GQA 5:1 (as 80 query heads on 16), at the default blocks."""
    B, T, N, K = 1, 320, 5, 1
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, N, d), (B, T, K, d), (B, T, K, dv)))
    seg = jnp.zeros((B, T), jnp.int32)

    def loss(q, k, v):
        o = dot_product_attention_pallas_gpu(q, k, v, causal=True, segment_ids=seg, window=window, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    with lowering_target(H100) as cuda:
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=(cuda,)).as_text()
    for kernel in ("diffjax_mgpu_single_fwd", "diffjax_mgpu_single_bwd_dq", "diffjax_mgpu_single_bwd_dkdv"):
        assert kernel in text, f"{kernel} missing from the lowered module ({default_tuning(d, dv, 1, jnp.bfloat16, single=True)})"


@pytest.mark.parametrize("d, dv, G", [(128, 256, 2), (64, 128, 2), (128, 128, 1), (64, 64, 1)])
@pytest.mark.parametrize("variant", ["causal-seg-bf16", "full-f16"])
def test_pallas_gpu_lowers_for_cuda(d, dv, G, variant):
    _lower_for_cuda(d, dv, G, variant, None)


@pytest.mark.parametrize("change", OTHER_TUNINGS)
def test_pallas_gpu_other_tunings_lower_for_cuda(change):
    _lower_for_cuda(64, 128, 2, "causal-seg-bf16", default_tuning(64, 128, 2, jnp.bfloat16)._replace(**change))


@pytest.mark.parametrize("d, dv, G, dkdv", [*((128, 256, 2, name) for name in OTHER_DKDV), (64, 64, 1, "dv_smem")])
def test_pallas_gpu_dkdv_variants_lower_for_cuda(d, dv, G, dkdv):
    """Each dk/dv schedule at the shape the sweep compares them on (d 128, dv 256: 64-row blocks, SMEM nearly full),
    and dv_smem where dO's half is 32 wide (its P share buffers, the dV wgmmas' lhs, take dO's 64-byte swizzle)."""
    _lower_for_cuda(d, dv, G, "causal-seg-bf16", default_tuning(d, dv, G, jnp.bfloat16)._replace(dkdv=dkdv))


def test_pallas_gpu_windowed_lowers_for_cuda():
    """The differential mode with a sliding window (the masks and step ranges the single-map mode shares)."""
    _lower_for_cuda(128, 256, 2, "causal-seg-bf16", None, window=100)


def _lower_for_cuda(d, dv, G, variant, tuning, window=None):
    causal = variant.startswith("causal")
    dtype = jnp.bfloat16 if variant.endswith("bf16") else jnp.float16
    B, T, H, K = 1, 320, 4, 2
    q, k, v = (jax.ShapeDtypeStruct(s, dtype) for s in ((B, T, H, 2, d), (B, T, K, G, d), (B, T, K, dv)))
    lam = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    seg = jnp.zeros((B, T), jnp.int32) if causal else None

    def loss(q, k, v, lam):
        o = diff_attention_pallas_gpu(q, k, v, lam, causal=causal, segment_ids=seg, tuning=tuning, interpret=False,
                                      window=window)
        return jnp.sum(o.astype(jnp.float32))

    with lowering_target(H100) as cuda:
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, lam).lower(lowering_platforms=(cuda,))
    text = lowered.as_text()
    for kernel in ("diffjax_mgpu_fwd", "diffjax_mgpu_bwd_dq", "diffjax_mgpu_bwd_dkdv"):
        assert kernel in text, f"{kernel} missing from the lowered module ({tuning or default_tuning(d, dv, G, dtype)})"


def test_pallas_gpu_rejects_what_it_cannot_run():
    def arrays(d=64, dv=128, G=2, dtype=jnp.bfloat16):
        return jnp.zeros((1, 64, 2, 2, d), dtype), jnp.zeros((1, 64, 2, G, d), dtype), jnp.zeros((1, 64, 2, dv), dtype)

    assert unsupported(*arrays()) is None
    assert "d in (64, 128), got 32" in unsupported(*arrays(d=32, dv=64))
    assert "dv = d or 2d, got dv = 192" in unsupported(*arrays(dv=192))
    assert "bfloat16 / float16, got float32" in unsupported(*arrays(dtype=jnp.float32))
    assert "shared memory" in unsupported(*arrays(d=128, dv=256), tuning=(64, 128, 128, 128, 3))
    assert f"needs dkdv in {DKDV_VARIANTS}, got 'fast'" in unsupported(*arrays(), tuning=Tuning(dkdv="fast"))
    with pytest.raises(ValueError, match=r"impl='pallas_gpu' needs the q and k head dim d in \(64, 128\), got 32"):
        ops.diff_attention(*arrays(d=32, dv=64), 0.5, impl="pallas_gpu")
    def single(d, dv):  # standard attention (4-D q, k): d and dv each 64, 128 or 192
        return jnp.zeros((1, 64, 2, d), jnp.bfloat16), jnp.zeros((1, 64, 2, d), jnp.bfloat16), jnp.zeros((1, 64, 2, dv), jnp.bfloat16)

    for d, dv in [(64, 64), (64, 128), (192, 128), (128, 192), (192, 192)]:
        assert unsupported(*single(d, dv)) is None, (d, dv)
    assert "d in (64, 128, 192), got 256" in unsupported(*single(256, 128))
    with pytest.raises(ValueError, match=r"dot_product_attention: impl='pallas_gpu' needs the value head dim dv in \(64, 128, 192\) for standard attention, got dv = 256 with d = 128"):
        ops.dot_product_attention(*single(128, 256), impl="pallas_gpu")


@pytest.mark.parametrize("d, dv, blocks", [(128, 128, (128, 128, 128)), (192, 128, (128, 64, 64)),
                                            (64, 192, (64, 128, 128)), (192, 192, (64, 64, 64))])
def test_pallas_gpu_single_default_blocks_fit_smem_and_registers(d, dv, blocks):
    """The single-map default blocks (forward, dq, dk/dv): the largest that fit shared memory, except the forward at dv
    192, whose 128-key step spills (kernel_resources.md) where a 64-key step does not."""
    tuning = default_tuning(d, dv, 1, jnp.bfloat16, single=True, swept=False)
    assert (tuning.block_k, tuning.block_k_dq, tuning.block_q_bwd) == blocks
    q, k, v = (jnp.zeros(s, jnp.bfloat16) for s in ((1, 64, 1, d), (1, 64, 1, d), (1, 64, 1, dv)))
    assert unsupported(q, k, v, tuning) is None


def _run_state_operands(jaxpr):
    """Every operand of every run_state equation in jaxpr and its sub-jaxprs (kernel bodies, loops)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "run_state":
            yield from eqn.invars
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _run_state_operands(sub)


@pytest.mark.parametrize("G, dkdv", [(1, Tuning().dkdv), (2, Tuning().dkdv), *((2, name) for name in OTHER_DKDV)])
def test_pallas_gpu_run_state_takes_no_literal_operands(G, dkdv):
    """jax 0.11's Mosaic GPU lowering rejects a literal run_state operand: a static ref index (the map
    in `k_smem.at[slot, g]`, a consumer's P share buffer) closed over by an accumulating wgmma must be a jaxpr variable."""
    B, T, H, K, d, dv = 1, 128, 2, 1, 64, 128
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, H, 2, d), (B, T, K, G, d), (B, T, K, dv)))
    lam = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    tuning = default_tuning(d, dv, G, jnp.bfloat16)._replace(dkdv=dkdv)

    def loss(q, k, v, lam):
        return jnp.sum(diff_attention_pallas_gpu(q, k, v, lam, causal=True, tuning=tuning, interpret=False).astype(jnp.float32))

    _assert_no_literal_run_state_operands(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, lam).jaxpr)


@pytest.mark.parametrize("d, dv", [(128, 128), (192, 128)])
def test_pallas_gpu_single_run_state_takes_no_literal_operands(d, dv):
    """The single-map dq / dk/dv sub-tiles (at d 128 the 128-row blocks' sub-tile loops; d 192 / dv 128 holds P^T in
    float16) with packed segment ids: their accumulating wgmmas close over no literal ref index either."""
    B, T, N, K = 1, 256, 2, 1
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, N, d), (B, T, K, d), (B, T, K, dv)))
    seg = jnp.zeros((B, T), jnp.int32)

    def loss(q, k, v):
        o = dot_product_attention_pallas_gpu(q, k, v, causal=True, segment_ids=seg, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    _assert_no_literal_run_state_operands(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)


def _assert_no_literal_run_state_operands(jaxpr):
    operands = list(_run_state_operands(jaxpr))
    assert operands, "no run_state found: the test no longer sees the accumulating wgmmas"
    literals = [x for x in operands if isinstance(x, jex_core.Literal)]
    assert not literals, f"literal run_state operands: {literals}"
