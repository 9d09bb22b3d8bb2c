"""The fused Pallas TPU kernels (interpret mode on CPU) and the compositions against the XLA reference.

Every case checks the forward output and all four gradients (dq, dk, dv, dlambda) through one random
cotangent. Errors are relative to the reference's largest magnitude (max |a - b| / max |b|).
float32: tolerance 1e-5 (measured ~1e-7: only summation order differs).
bfloat16: both paths round P to bf16 before P V, but the kernel rounds the unnormalised exp(s - m_running)
and divides at the end, the reference rounds the normalised softmax; gradients add bf16 roundings of dS
and of dO. We check the kernel against the float32 reference on the same bf16 inputs and require it to be
within 2x the error the bf16 reference itself makes there, plus 4 bf16 ulps (4 * 2^-8) of slack.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops
from diffjax.ops.pallas_tpu import diff_attention_pallas, dot_product_attention_pallas
from diffjax.ops.reference import diff_attention_xla, dot_product_attention_xla

F32_TOL = 1e-5
BF16_SLACK = 4 * 2.0**-8


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _segments(rng, B, T, S, kind):
    if kind is None:
        return None
    if kind == "same":  # packed documents, T == S
        cuts = np.sort(rng.choice(np.arange(1, T), size=(B, 2), replace=True), axis=1)
        ids = (np.arange(T)[None] >= cuts[:, :1]).astype(np.int32) + (np.arange(T)[None] >= cuts[:, 1:]).astype(np.int32)
        return jnp.asarray(ids)
    # "pair": q and kv ids differ; q segment 3 has no keys at all -> fully masked rows
    q_ids = rng.integers(0, 2, size=(B, T)).astype(np.int32)
    q_ids[:, : T // 5] = 3
    kv_ids = rng.integers(0, 2, size=(B, S)).astype(np.int32)
    return (jnp.asarray(q_ids), jnp.asarray(kv_ids))


CASES = {
    # name: (B, T, S, H, K, G, d, dv, causal, per_token_lambda, segments, dtype, blocks)
    "causal-T>S-rep1-G2-scalar-f32": (1, 56, 40, 2, 2, 2, 16, 32, True, False, None, "float32", (16, 16)),
    "full-rep2-G2-token-f32": (2, 64, 64, 4, 2, 2, 16, 32, False, True, None, "float32", (32, 16)),
    "causal-rep4-G1-token-seg-f32": (1, 100, 100, 4, 1, 1, 16, 16, True, True, "same", "float32", (32, 32)),
    "causal-T<S-rep2-pairseg-f32": (1, 40, 72, 4, 2, 2, 16, 32, True, True, "pair", "float32", (16, 32)),
    "causal-rep2-G2-token-seg-bf16": (1, 64, 64, 4, 2, 2, 32, 64, True, True, "same", "bfloat16", (32, 32)),
    "full-rep4-G1-scalar-bf16": (1, 40, 40, 4, 1, 1, 16, 32, False, False, None, "bfloat16", (16, 16)),
}
SLOW_CASES = ("causal-T>S-rep1-G2-scalar-f32", "causal-rep2-G2-token-seg-bf16", "full-rep4-G1-scalar-bf16")


def _inputs(case, seed=0):
    B, T, S, H, K, G, d, dv, causal, per_token, seg, dtype, blocks = case
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, 2, d))
    k = rng.normal(size=(B, S, K, G, d))
    v = rng.normal(size=(B, S, K, dv))
    lam = rng.uniform(0.2, 0.9, size=(B, T, H)) if per_token else np.float64(0.6)
    ct = rng.normal(size=(B, T, H, dv))
    dt = jnp.dtype(dtype)
    cast = lambda a: jnp.asarray(a, dt)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(lam, jnp.float32), cast(ct), _segments(rng, B, T, S, seg))


def _fully_masked_rows(B, T, S, causal, seg):
    """[B, T] True where a query may attend no key: a q segment with no keys (id 3 in "pair"
    segments), or, under causal with T > S, the rows before the first key."""
    dead_BT = np.zeros((B, T), bool)
    if isinstance(seg, tuple):
        dead_BT |= np.asarray(seg[0]) == 3
    if causal and T > S:
        dead_BT[:, : T - S] = True
    return dead_BT


def _value_and_grads(fn, q, k, v, lam, ct):
    o, vjp = jax.vjp(fn, q, k, v, lam)
    return (o, *vjp(ct))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_diff_attention_pallas_forward_and_grads(name, measured):
    case = CASES[name]
    causal, dtype, blocks = case[8], case[11], case[12]
    q, k, v, lam, ct, seg = _inputs(case)
    pallas = jax.jit(lambda q, k, v, lam: diff_attention_pallas(q, k, v, lam, causal=causal, segment_ids=seg, block_sizes=blocks))
    xla = jax.jit(lambda q, k, v, lam: diff_attention_xla(q, k, v, lam, causal=causal, segment_ids=seg))
    got = _value_and_grads(pallas, q, k, v, lam, ct)
    labels = ("o", "dq", "dk", "dv", "dlambda")
    for label, g in zip(labels, got):
        assert g.shape == {"o": ct, "dq": q, "dk": k, "dv": v, "dlambda": lam}[label].shape
        assert np.all(np.isfinite(np.asarray(g, np.float32))), label
    if dtype == "float32":
        want = _value_and_grads(xla, q, k, v, lam, ct)
        for label, g, w in zip(labels, got, want):
            if label == "dlambda" and lam.ndim == 0:
                # A scalar dlambda is a sum of B*T*H terms with cancellation: scale by the sum of |terms|.
                lam_BTH = jnp.broadcast_to(lam, ct.shape[:3])
                terms = _value_and_grads(xla, q, k, v, lam_BTH, ct)[4]
                err = float(jnp.abs(g - w)) / float(jnp.sum(jnp.abs(terms)))
                assert measured("dlambda err / sum|terms| f32", err, F32_TOL) <= F32_TOL
                continue
            assert measured(f"{label} rel err f32", _rel(g, w), F32_TOL) <= F32_TOL, label
    else:
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        exact = _value_and_grads(xla, f32(q), f32(k), f32(v), lam, f32(ct))
        ref_bf16 = _value_and_grads(xla, q, k, v, lam, ct)
        for label, g, r, e in zip(labels, got, ref_bf16, exact):
            tol = 2 * _rel(r, e) + BF16_SLACK
            assert measured(f"{label} rel err bf16 vs f32 ref", _rel(g, e), tol) <= tol, label
            measured(f"{label} rel err bf16 vs bf16 ref", _rel(g, r))
    assert got[0].dtype == q.dtype
    # Fully masked rows: o = 0, dq = 0.
    dead_BT = _fully_masked_rows(*case[:3], causal, seg)
    if dead_BT.any():
        assert measured("max |o|, |dq| on fully masked rows", max(float(jnp.abs(got[0][dead_BT]).max()), float(jnp.abs(got[1][dead_BT]).max())), 0.0) == 0.0


@pytest.mark.parametrize("causal, seg", [pytest.param(True, "same", marks=pytest.mark.slow), (False, None)])
def test_dot_product_attention_pallas_single_map(causal, seg, measured):
    rng = np.random.default_rng(1)
    B, T, N, K, d = 1, 72, 4, 2, 16
    q, k, v, ct = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, N, d), (B, T, K, d), (B, T, K, d), (B, T, N, d)))
    segment_ids = _segments(rng, B, T, T, seg)
    pallas = lambda q, k, v: dot_product_attention_pallas(q, k, v, causal=causal, segment_ids=segment_ids, block_sizes=(16, 32))  # noqa: E731
    xla = lambda q, k, v: dot_product_attention_xla(q, k, v, causal=causal, segment_ids=segment_ids)  # noqa: E731
    o1, vjp1 = jax.vjp(pallas, q, k, v)
    o2, vjp2 = jax.vjp(xla, q, k, v)
    for label, a, b in zip(("o", "dq", "dk", "dv"), (o1, *vjp1(ct)), (o2, *vjp2(ct))):
        assert measured(f"{label} rel err f32", _rel(a, b), F32_TOL) <= F32_TOL, label


@pytest.mark.slow
def test_splash_composition_interpret(measured):
    """splash (TPU kernel, interpret mode here): one MQA call per map and kv head; needs T % 128 == 0."""
    rng = np.random.default_rng(2)
    B, T, H, K, d, dv = 1, 128, 2, 1, 16, 32
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, H, 2, d), (B, T, K, 2, d), (B, T, K, dv)))
    lam = jnp.asarray(rng.uniform(0.2, 0.9, size=(B, T, H)), jnp.float32)
    seg = jnp.asarray((np.arange(T) >= 50).astype(np.int32)[None])
    o = ops.diff_attention(q, k, v, lam, segment_ids=seg, impl="splash")
    o_ref = ops.diff_attention(q, k, v, lam, segment_ids=seg, impl="xla")
    assert measured("o rel err f32", _rel(o, o_ref), F32_TOL) <= F32_TOL
    dv_ = jax.grad(lambda v: jnp.sum(ops.diff_attention(q, k, v, lam, segment_ids=seg, impl="splash") ** 2))(v)
    dv_ref = jax.grad(lambda v: jnp.sum(ops.diff_attention(q, k, v, lam, segment_ids=seg, impl="xla") ** 2))(v)
    assert measured("dv rel err f32", _rel(dv_, dv_ref), F32_TOL) <= F32_TOL


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_fused_path_never_materialises_T_by_S(measured):
    """Compiled temp memory when T = S doubles: xla's grows ~4x (T x S fp32 scores for both maps),
    the fused path's ~2x (only O(T) buffers: padded copies, residuals, accumulators per block)."""
    B, H, d, dv = 1, 1, 16, 32

    def loss(impl):
        return lambda q, k, v, lam: jnp.sum(ops.diff_attention(q, k, v, lam, impl=impl, block_sizes=(128, 128)))

    temps = {}
    for T in (512, 1024):
        args = (
            jax.ShapeDtypeStruct((B, T, H, 2, d), jnp.float32), jax.ShapeDtypeStruct((B, T, H, 2, d), jnp.float32),
            jax.ShapeDtypeStruct((B, T, H, dv), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32),
        )
        for impl in ("xla", "pallas_tpu"):
            temps[impl, T] = _temp_bytes(jax.grad(loss(impl), argnums=(0, 1, 2, 3)), *args)
    assert temps["xla", 1024] >= 2 * B * H * 1024 * 1024 * 4  # the reference holds both maps' T x S scores
    xla_growth = measured("xla fwd+bwd temp growth, T 512 -> 1024", temps["xla", 1024] / temps["xla", 512])
    fused_growth = measured("fused fwd+bwd temp growth, T 512 -> 1024", temps["pallas_tpu", 1024] / temps["pallas_tpu", 512], 2.5)
    assert xla_growth > 3.5
    assert fused_growth < 2.5
    assert temps["pallas_tpu", 1024] < temps["xla", 1024] / 8


def test_unknown_and_unsupported_impls_raise_clear_errors():
    q = jnp.zeros((1, 8, 2, 2, 8))
    k = jnp.zeros((1, 8, 2, 2, 8))
    v = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match=r"must be one of \('auto', 'xla', 'pallas_tpu', 'pallas_gpu', 'splash', 'cudnn', 'triton'\), got 'flash'"):
        ops.diff_attention(q, k, v, 0.5, impl="flash")
    with pytest.raises(ValueError, match="impl='cudnn' needs a CUDA GPU"):
        ops.diff_attention(q, k, v, 0.5, impl="cudnn")
    with pytest.raises(ValueError, match="impl='splash' needs T and S to be multiples"):
        ops.diff_attention(q, k, v, 0.5, impl="splash")
    with pytest.raises(ValueError, match="impl='cudnn'"):
        ops.dot_product_attention(q[:, :, :, 0], k[:, :, :, 0], v, impl="cudnn")
