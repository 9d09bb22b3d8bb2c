"""The GPU paths that need no GPU to check: the Pallas Triton composition (interpret mode against the
XLA reference, and lowered for CUDA on this CPU), and what impl="auto" picks on each kind of GPU.

Errors are relative to the reference's largest magnitude; both sides are float32, so only summation
order differs (tolerance 1e-5, measured ~1e-7).
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops
from diffjax.jax_compat import H100, lowering_target
from diffjax.ops import compositions
from diffjax.ops.reference import diff_attention_xla, dot_product_attention_xla

F32_TOL = 1e-5


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _packed_ids(B, T, cuts):
    return jnp.asarray(np.broadcast_to(sum((np.arange(T) >= c).astype(np.int32) for c in cuts), (B, T)))


@pytest.mark.parametrize(
    "causal, packed, per_token_lambda, G",
    [(True, True, True, 2), (False, False, False, 1)],
    ids=["causal-packed-token-lambda-G2", "full-scalar-lambda-G1"],
)
def test_triton_diff_composition_matches_reference(causal, packed, per_token_lambda, G, measured):
    """T = 100 is padded to a power of two inside; GQA with 2 query heads per kv head; V twice as wide as q."""
    rng = np.random.default_rng(0)
    B, T, H, K, d = 1, 100, 4, 2, 16
    q, k, v, ct = (jnp.asarray(rng.normal(size=s), jnp.float32)
                   for s in ((B, T, H, 2, d), (B, T, K, G, d), (B, T, K, 2 * d), (B, T, H, 2 * d)))
    lam = jnp.asarray(rng.uniform(0.2, 0.9, size=(B, T, H)) if per_token_lambda else 0.6, jnp.float32)
    seg = _packed_ids(B, T, (37, 70)) if packed else None
    triton = lambda q, k, v, lam: ops.diff_attention(q, k, v, lam, causal=causal, segment_ids=seg, impl="triton")  # noqa: E731
    xla = lambda q, k, v, lam: diff_attention_xla(q, k, v, lam, causal=causal, segment_ids=seg)  # noqa: E731
    o, vjp = jax.vjp(triton, q, k, v, lam)
    o_ref, vjp_ref = jax.vjp(xla, q, k, v, lam)
    for label, a, b in zip(("o", "dq", "dk", "dv", "dlambda"), (o, *vjp(ct)), (o_ref, *vjp_ref(ct))):
        assert measured(f"triton {label} rel err f32", _rel(a, b), F32_TOL) <= F32_TOL, label


def test_triton_single_map_composition_matches_reference(measured):
    """The baseline twin's path on GPUs without the fused kernel: GQA, packed documents, causal."""
    rng = np.random.default_rng(1)
    B, T, N, K, d = 2, 64, 4, 1, 32
    q, k, v, ct = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, N, d), (B, T, K, d), (B, T, K, d), (B, T, N, d)))
    seg = _packed_ids(B, T, (20,))
    triton = lambda q, k, v: ops.dot_product_attention(q, k, v, segment_ids=seg, impl="triton")  # noqa: E731
    xla = lambda q, k, v: dot_product_attention_xla(q, k, v, causal=True, segment_ids=seg)  # noqa: E731
    o, vjp = jax.vjp(triton, q, k, v)
    o_ref, vjp_ref = jax.vjp(xla, q, k, v)
    for label, a, b in zip(("o", "dq", "dk", "dv"), (o, *vjp(ct)), (o_ref, *vjp_ref(ct))):
        assert measured(f"triton single-map {label} rel err f32", _rel(a, b), F32_TOL) <= F32_TOL, label


@pytest.mark.parametrize("d", [96, 128])
def test_triton_composition_lowers_for_cuda(d):
    """Lowered for CUDA on this CPU (Pallas' Triton lowering runs; ptxas and speed need a GPU) at the paper
    configs' head dims, dv = 2d, bf16, packed, forward and backward: 2 forward calls (one per V half) and a
    preprocess + backward call per half."""
    B, T, H, K = 1, 1000, 4, 2
    sp = jax.ShapeDtypeStruct
    args = (sp((B, T, H, 2, d), jnp.bfloat16), sp((B, T, K, 2, d), jnp.bfloat16), sp((B, T, K, 2 * d), jnp.bfloat16),
            sp((), jnp.bfloat16), sp((B, T), jnp.int32))

    def loss(q, k, v, lam, seg):
        return compositions.diff_attention_triton(q, k, v, lam, causal=True, segment_ids=seg).astype(jnp.float32).sum()

    with lowering_target(H100) as cuda:  # jax 0.12's Triton lowering reads the compute capability from the device
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=(cuda,)).as_text()
    kernels = re.findall(r'name = "(mha_\w+)"', hlo)
    assert hlo.count("xla.gpu.triton") >= 5 and {"mha_forward", "mha_backward"} <= set(kernels), kernels


def test_triton_refuses_what_it_cannot_run():
    q, k, v = jnp.zeros((1, 8, 2, 2, 16)), jnp.zeros((1, 12, 2, 2, 16)), jnp.zeros((1, 12, 2, 32))
    with pytest.raises(ValueError, match=r"impl='triton' needs T == S \(self-attention; got T=8, S=12\)"):
        ops.diff_attention(q, k, v, 0.5, impl="triton")
    with pytest.raises(ValueError, match="impl='triton' needs a head dim that is a multiple of 16 and at most 128 \\(got 160\\)"):
        ops.dot_product_attention(jnp.zeros((1, 8, 2, 160)), jnp.zeros((1, 8, 2, 160)), jnp.zeros((1, 8, 2, 160)), impl="triton")
    ids = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="impl='triton' takes one segment-id array"):
        ops.dot_product_attention(q[:, :, :, 0], q[:, :, :, 0], q[:, :, :, 0], segment_ids=(ids, ids), impl="triton")


def _shapes(d, dv, G=2, T=128):
    bf16 = jnp.bfloat16
    return jnp.zeros((1, T, 2, 2, d), bf16), jnp.zeros((1, T, 2, G, d), bf16), jnp.zeros((1, T, 2, dv), bf16)


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend the default backend is a GPU; the returned function sets whether it is a Hopper."""
    monkeypatch.setattr(ops, "_platform", lambda: "gpu")
    return lambda hopper: monkeypatch.setattr(ops, "_is_hopper", lambda: hopper)


def test_auto_on_hopper_picks_the_fused_kernel_for_packed_batches(on_gpu):
    on_gpu(True)
    packed = jnp.zeros((1, 128), jnp.int32)
    q, k, v = _shapes(128, 256)
    # Packed rows: cuDNN takes no segment ids, so the fused kernel, whatever the table says.
    assert ops._resolve("diff_attention", "auto", q, k, v, True, packed) == "pallas_gpu"
    # Unpacked, where cuDNN was measured faster (CUDNN_FASTER_ON_HOPPER): cuDNN.
    assert ("diff_attention", 128, 256, True) in ops.CUDNN_FASTER_ON_HOPPER
    assert ops._resolve("diff_attention", "auto", q, k, v, True, None) == "cudnn"
    # Unpacked and not measured slower (non-causal): the fused kernel.
    assert ops._resolve("diff_attention", "auto", q, k, v, False, None) == "pallas_gpu"
    # The baseline twin (2H heads of d, dv = d): the kernel's single-map mode, packed or not.
    qs, ks, vs = q[:, :, :, 0], k[:, :, :, 0], v[..., :128]
    assert ops._resolve("dot_product_attention", "auto", qs, ks, vs, True, packed) == "pallas_gpu"
    assert ops._resolve("dot_product_attention", "auto", qs, ks, vs, True, None) == "pallas_gpu"
    # A head dim the fused kernel does not take (96, the 830M config's): cuDNN without segment ids, triton with.
    q96, k96, v96 = _shapes(96, 192)
    assert ops._resolve("diff_attention", "auto", q96, k96, v96, True, None) == "cudnn"
    assert ops._resolve("diff_attention", "auto", q96, k96, v96, True, packed) == "triton"


def test_auto_on_other_gpus_picks_triton_for_packed_batches(on_gpu, caplog):
    on_gpu(False)
    packed = jnp.zeros((1, 128), jnp.int32)
    q, k, v = _shapes(64, 128)
    assert ops._resolve("diff_attention", "auto", q, k, v, True, None) == "cudnn"
    ops._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="diffjax.ops"):
        assert ops._resolve("diff_attention", "auto", q, k, v, True, packed) == "triton"
        assert ops._resolve("dot_product_attention", "auto", q[:, :, :, 0], k[:, :, :, 0], v[..., :64], True, packed) == "triton"
    assert any("chose 'triton' (Pallas Triton flash composition; cudnn does not take segment_ids" in r.getMessage() for r in caplog.records)
    # q/kv segment pairs (T != S decoding, say) run nowhere but xla: a warning that names every reason.
    caplog.clear()
    q_short = q[:, :64]
    with caplog.at_level(logging.INFO, logger="diffjax.ops"):
        assert ops._resolve("diff_attention", "auto", q_short, k, v, True, (packed[:, :64], packed)) == "xla"
    (record,) = [r for r in caplog.records if "chose 'xla'" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "pallas_gpu needs a Hopper GPU" in record.getMessage() and "triton needs T == S" in record.getMessage()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [96, 128])
def test_triton_compiled_on_gpu_matches_reference(d, measured):
    """Compiled (not interpreted) on a CUDA GPU, bf16, packed: within 2x the bf16 reference's own error
    against float32 plus 4 bf16 ulps, forward and every gradient."""
    rng = np.random.default_rng(3)
    B, T, H, K = 2, 1024, 4, 2
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    q, k, v, ct = (bf16(rng.normal(size=s)) for s in ((B, T, H, 2, d), (B, T, K, 2, d), (B, T, K, 2 * d), (B, T, H, 2 * d)))
    lam = jnp.asarray(rng.uniform(0.2, 0.9, size=(B, T, H)), jnp.float32)
    seg = _packed_ids(B, T, (300, 700))

    def grads(impl, *args):
        fn = jax.jit(lambda q, k, v, lam: ops.diff_attention(q, k, v, lam, segment_ids=seg, impl=impl))
        o, vjp = jax.vjp(fn, *args)
        return (o, *vjp(ct.astype(o.dtype)))

    got = grads("triton", q, k, v, lam)
    exact = grads("xla", *(a.astype(jnp.float32) for a in (q, k, v)), lam)
    ref_bf16 = grads("xla", q, k, v, lam)
    for label, g, r, e in zip(("o", "dq", "dk", "dv", "dlambda"), got, ref_bf16, exact):
        tol = 2 * _rel(r, e) + 4 * 2.0**-8
        assert measured(f"triton d{d} {label} rel err bf16 vs f32 ref", _rel(g, e), tol) <= tol, label
