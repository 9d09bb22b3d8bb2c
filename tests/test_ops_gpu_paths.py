"""The GPU paths that need no GPU to check: the Pallas Triton composition (interpret mode against the
XLA reference, and lowered for CUDA on this CPU), and what impl="auto" picks on each device (the public
chooser, diffjax.ops.choose: CPU, H100, A100, TPU v5e; packed or not; head dims 64 / 96 / 128; decode).

Errors are relative to the reference's largest magnitude; both sides are float32, so only summation
order differs (tolerance 1e-5, measured ~1e-7).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

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


# --- what impl="auto" picks: diffjax.ops.choose, a pure function of the call's shapes and the device ----------


def _call(d, dv, *, op="diff_attention", G=2, T=128, S=None, segments=None, causal=True, dtype="bfloat16",
          window=None, context=1):
    S = S or T
    if op == "diff_attention":
        return ops.AttentionCall(op, (1, T, 4, 2, d), (1, S, 2, G, d), (1, S, 2, dv), dtype, causal, segments, window,
                                 context)
    return ops.AttentionCall(op, (1, T, 4, d), (1, S, 2, d), (1, S, 2, dv), dtype, causal, segments, window, context)


def _auto(call, device):
    """The impl auto picks, or (undifferentiated, differentiated) where the two passes take different impls."""
    route = ops.choose(call, "auto", ops.DEVICES[device])
    return route.impl if route.grad_impl == route.impl else (route.impl, route.grad_impl)


# (device, op, d, packed) -> the impl auto picks (bf16, T = 128, causal, no remat); the table of docs/kernels.md.
AUTO_TABLE = {
    # Hopper: the fused kernel wherever it runs (d 64 / 128), packed or not, except where cuDNN takes the call (no
    # segment ids) and was measured faster in a pass (HOPPER_MS: d 128, both ops): the forward stays on the fused
    # kernel, training (fwd+bwd) takes cuDNN.
    ("h100", "diff_attention", 64, True): "pallas_gpu", ("h100", "diff_attention", 64, False): "pallas_gpu",
    ("h100", "diff_attention", 128, True): "pallas_gpu", ("h100", "diff_attention", 128, False): ("pallas_gpu", "cudnn"),
    ("h100", "diff_attention", 96, True): "triton", ("h100", "diff_attention", 96, False): "cudnn",
    ("h100", "dot_product_attention", 128, True): "pallas_gpu",
    ("h100", "dot_product_attention", 128, False): ("pallas_gpu", "cudnn"),
    ("h100", "dot_product_attention", 96, True): "triton", ("h100", "dot_product_attention", 64, False): "pallas_gpu",
    # Other CUDA GPUs: cuDNN without segment ids, Pallas Triton with them.
    ("a100", "diff_attention", 64, True): "triton", ("a100", "diff_attention", 64, False): "cudnn",
    ("a100", "diff_attention", 96, True): "triton", ("a100", "diff_attention", 128, False): "cudnn",
    ("a100", "dot_product_attention", 128, True): "triton", ("a100", "dot_product_attention", 96, False): "cudnn",
    # TPU: the fused Pallas TPU kernel; CPU: xla (the Pallas impls would run interpreted).
    ("v5e", "diff_attention", 64, True): "pallas_tpu", ("v5e", "diff_attention", 96, False): "pallas_tpu",
    ("v5e", "dot_product_attention", 128, True): "pallas_tpu",
    ("cpu", "diff_attention", 128, True): "xla", ("cpu", "dot_product_attention", 64, False): "xla",
}


@pytest.mark.parametrize("device, op, d, packed", list(AUTO_TABLE), ids=[f"{dev}-{op[:4]}-d{d}-{'packed' if p else 'unpacked'}"
                                                                          for dev, op, d, p in AUTO_TABLE])
def test_auto_picks_by_device_head_dim_and_packing(device, op, d, packed):
    dv = 2 * d if op == "diff_attention" else d
    assert _auto(_call(d, dv, op=op, segments="one" if packed else None), device) == AUTO_TABLE[device, op, d, packed]


def test_auto_edges_decode_and_reasons():
    # Decode (one query against a cache's slots, q / kv segment ids): xla everywhere, no warning case.
    decode = _call(128, 256, T=1, S=4096, segments="pair", causal=False)
    assert decode.is_decode
    # Speculative decoding's verify step (1 + K queries, kv ids per query [B, T, S]): the same route, chosen here
    # (the KV cache asks for "auto", never pins an impl), and an explicit impl other than xla refused in one line.
    speculative = ops.AttentionCall.of("diff_attention", *(jnp.zeros(s) for s in ((1, 3, 2, 2, 128), (1, 64, 2, 2, 128),
                                       (1, 64, 2, 256))), False, (jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3, 64), jnp.int32)))
    assert speculative.segments == "per_query" and speculative.is_decode
    for device in ("h100", "a100", "v5e", "cpu"):
        for call in (decode, speculative):
            route = ops.choose(call, "auto", ops.DEVICES[device])
            assert route == ops.Route("xla", False, False, route.reason) and route.reason.startswith("decode"), (device, route)
    with pytest.raises(ValueError, match=r"^diff_attention: impl='pallas_tpu' takes no per-query kv segment ids .*"
                                         r"Use impl='xla' or 'auto'.$"):
        ops.choose(speculative, "pallas_tpu", ops.DEVICES["v5e"])
    # A TPU call shorter than one kernel block; a non-causal diff call on Hopper at d 64 (not measured) and at d 128
    # (measured: the fused kernel's forward is faster, cuDNN's forward and backward); standard attention at d 128
    # non-causal, where cuDNN was measured faster in both passes.
    assert ops.choose(_call(64, 128, T=64), "auto", ops.DEVICES["v5e"]) == ops.Route(
        "xla", context=False, blockwise=False, reason="T=64 < 128 is below one kernel block")
    assert _auto(_call(64, 128, causal=False), "h100") == "pallas_gpu"
    route = ops.choose(_call(128, 256, causal=False), "auto", ops.DEVICES["h100"])
    assert (route.impl, route.grad_impl) == ("pallas_gpu", "cudnn"), route
    assert route.reason == "fused Mosaic GPU kernel, measured faster fwd on Hopper (3.25 vs 4.17 ms at T 8192)"
    assert route.grad_reason == "cuDNN flash composition, measured faster fwd+bwd on Hopper (13.39 vs 15.76 ms at T 8192)"
    assert _auto(_call(128, 128, op="dot_product_attention", causal=False), "h100") == "cudnn"
    # A q / kv segment pair that is not a decode (T != S, T > 1) runs nowhere but xla: every reason named.
    route = ops.choose(_call(64, 128, T=64, S=128, segments="pair"), "auto", ops.DEVICES["a100"])
    assert route.impl == "xla" and "pallas_gpu needs a Hopper GPU" in route.reason and "triton needs T == S" in route.reason
    # float32 on a GPU: neither cuDNN nor the fused kernel; the Triton composition.
    assert _auto(_call(64, 128, dtype="float32", segments="one"), "h100") == "triton"


def test_explicit_impls_are_checked_by_the_chooser():
    with pytest.raises(ValueError, match=r"impl='cudnn' needs a CUDA GPU \(platform is 'cpu'\)"):
        ops.choose(_call(64, 128), "cudnn", ops.DEVICES["cpu"])
    with pytest.raises(ValueError, match=r"impl='pallas_gpu' needs the q and k head dim d in \(64, 128\), got 96"):
        ops.choose(_call(96, 192), "pallas_gpu", ops.DEVICES["h100"])
    with pytest.raises(ValueError, match="attention impl must be one of"):
        ops.choose(_call(64, 128), "flash", ops.DEVICES["h100"])
    assert ops.choose(_call(64, 128), "pallas_tpu", ops.DEVICES["cpu"]) == ops.Route(
        "pallas_tpu", context=False, blockwise=False, reason="asked for; runs in Pallas interpret mode (slow)")


# (device, impl, call) -> (impl, context, blockwise): the route over a context axis of 2 (bf16, causal, d 128 / dv
# 256 unless named). Only the fused kernels take a query offset; every other impl attends blockwise in XLA, and
# "auto" takes the fused kernels wherever they run the call: neither TPU_MIN_T nor HOPPER_MS applies.
CONTEXT_ROUTES = {
    ("v5p", "auto", "T=64"): ("pallas_tpu", True, False),  # below TPU_MIN_T: xla without the context axis
    ("h100", "auto", "unpacked"): ("pallas_gpu", True, False),  # in HOPPER_MS: cudnn trains it without a context axis
    ("h100", "auto", "packed"): ("pallas_gpu", True, False),
    ("h100", "auto", "window"): ("pallas_gpu", True, False),
    ("h100", "auto", "float32"): ("xla", True, True),  # nor float32
    ("a100", "auto", "unpacked"): ("xla", True, True),
    ("cpu", "auto", "unpacked"): ("xla", True, True),
    ("cpu", "pallas_tpu", "T=64"): ("pallas_tpu", True, False),  # explicit: interpreted off a TPU
    ("cpu", "pallas_gpu", "unpacked"): ("pallas_gpu", True, False),
    ("cpu", "cudnn", "unpacked"): ("xla", True, True),  # cudnn has no context route (and is not checked for one)
    ("h100", "triton", "window"): ("xla", True, True),
    ("v5p", "xla", "unpacked"): ("xla", True, True),
}
CONTEXT_CALLS = {"T=64": dict(T=64), "unpacked": {}, "packed": dict(segments="one"), "window": dict(window=32),
                 "float32": dict(dtype="float32")}


@pytest.mark.parametrize("device, impl, case", list(CONTEXT_ROUTES), ids=["-".join(key) for key in CONTEXT_ROUTES])
def test_the_route_over_a_context_axis(device, impl, case):
    route = ops.choose(_call(128, 256, context=2, **CONTEXT_CALLS[case]), impl, ops.DEVICES[device])
    assert (route.impl, route.context, route.blockwise) == CONTEXT_ROUTES[device, impl, case], route


def test_the_context_route_refuses_a_fused_kernel_that_cannot_take_the_call():
    with pytest.raises(ValueError, match=r"impl='pallas_gpu' needs the q and k head dim d in \(64, 128\), got 96"):
        ops.choose(_call(96, 192, context=2), "pallas_gpu", ops.DEVICES["h100"])
    with pytest.raises(ValueError, match="attention impl must be one of"):
        ops.choose(_call(64, 128, context=2), "flash", ops.DEVICES["h100"])


# (device, impl, T, S, window) -> whether the XLA path runs blockwise (one device): self-attention from
# BLOCKWISE_FROM (8192) tokens on, or under a window beyond 4 key blocks of DEFAULT_BLOCK (512).
BLOCKWISE_ROUTES = {
    ("cpu", "xla", 8192, 8192, None): True, ("cpu", "auto", 8192, 8192, None): True,
    ("cpu", "xla", 4096, 4096, None): False, ("cpu", "xla", 8192, 16384, None): False,  # not self-attention
    ("cpu", "xla", 2560, 2560, 512): True, ("cpu", "xla", 2048, 2048, 512): False,  # 4 blocks: one T x T pass
    ("h100", "auto", 8192, 8192, None): False,  # cudnn: no blockwise route
    ("v5e", "auto", 8192, 8192, None): False,  # pallas_tpu
}


@pytest.mark.parametrize("device, impl, T, S, window", list(BLOCKWISE_ROUTES),
                         ids=["-".join(map(str, key)) for key in BLOCKWISE_ROUTES])
def test_the_xla_path_runs_blockwise_for_long_or_windowed_self_attention(device, impl, T, S, window):
    route = ops.choose(_call(64, 128, T=T, S=S, window=window), impl, ops.DEVICES[device])
    assert route.blockwise == BLOCKWISE_ROUTES[device, impl, T, S, window] and not route.context, route
    assert not route.blockwise or (route.impl == "xla" and "blockwise: " in route.reason)


def test_auto_logs_its_choice_once_and_warns_for_xla_on_an_accelerator(caplog):
    """Through ops.dot_product_attention / diff_attention routed as on an A100 (ops.simulated_device): the choice
    and its reason are logged once; xla on an accelerator is a warning."""
    q, k, v = jnp.zeros((1, 64, 4, 2, 64)), jnp.zeros((1, 128, 2, 2, 64)), jnp.zeros((1, 128, 2, 128))
    ids = (jnp.ones((1, 64), jnp.int32), jnp.ones((1, 128), jnp.int32))
    with caplog.at_level(logging.INFO, logger="diffjax.ops"), ops.simulated_device(ops.DEVICES["a100"]):
        for _ in range(2):
            ops.diff_attention(q, k, v, 0.5, segment_ids=ids)
    (record,) = [r for r in caplog.records if "chose 'xla'" in r.getMessage()]
    assert record.levelno == logging.WARNING and "triton needs T == S" in record.getMessage()


def test_the_command_prints_each_calls_choice(capsys):
    from diffjax.train.cli import main

    configs = Path(__file__).resolve().parents[1] / "configs"
    assert main(["--routes", "--config", str(configs / "paper" / "diff-1.4b.yaml"), "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "train step (packed rows): diff_attention q [1, 2048, 8, 2, 128]" in out
    assert "-> pallas_gpu: fused Mosaic GPU kernel" in out and "-> xla: decode" in out
    # The prefill (no segment ids: cuDNN takes it) shows both passes: the fused kernel's forward, cuDNN's training.
    prefill = out[out.index("generation prefill"):]
    assert "\n    -> fwd: pallas_gpu: fused Mosaic GPU kernel, measured faster fwd" in prefill
    assert "\n    -> fwd+bwd: cudnn: cuDNN flash composition, measured faster fwd+bwd" in prefill
    assert main(["--routes", "--config", str(configs / "tiny.yaml"), "--device", "a100", "model.attention=standard",
                 "model.dtype=bfloat16"]) == 0
    assert "dot_product_attention q [1, 128, 4, 32]" in capsys.readouterr().out


def test_the_command_previews_the_context_and_blockwise_routes(capsys):
    """parallel.context=2 model.attention_window=256 (layer 0 global), 4096 tokens, on an H100, a TPU v5p and a CPU: the train step's
    route over the context axis (fused kernels with a query offset, or blockwise XLA), the prefill's without one."""
    config = str(Path(__file__).resolve().parents[1] / "configs" / "paper" / "diff-1.4b.yaml")

    def routes(device):
        assert main(["--routes", "--config", config, "--device", device, "parallel.context=2", "model.attention_window=256",
                     "model.global_layers=[0]", "data.seq_len=4096", "model.max_seq_len=4096"]) == 0
        out = capsys.readouterr().out
        assert "window 256, context axis of 2" in out
        return dict(re.findall(r"^  (\S[^:]*): .*\n    -> (?:fwd: )?([^:]*):", out, re.MULTILINE))  # (the forward's)

    from diffjax.train.cli import main

    chunked, blockwise = "per query chunk over the context axis", "xla blockwise per query chunk over the context axis"
    assert routes("h100") == {
        "train step (packed rows) (global layers)": f"pallas_gpu {chunked}",
        "train step (packed rows) (windowed layers)": f"pallas_gpu {chunked}",
        # the forward alone: pallas_gpu measured faster (HOPPER_MS), windowed or not
        "generation prefill (global layers)": "pallas_gpu", "generation prefill (windowed layers)": "pallas_gpu",
        "generation decode step": "xla"}
    assert routes("v5p") == {
        "train step (packed rows) (global layers)": f"pallas_tpu {chunked}",
        "train step (packed rows) (windowed layers)": f"pallas_tpu {chunked}",
        "generation prefill (global layers)": "pallas_tpu", "generation prefill (windowed layers)": "pallas_tpu",
        "generation decode step": "xla"}
    assert routes("cpu") == {
        "train step (packed rows) (global layers)": blockwise, "train step (packed rows) (windowed layers)": blockwise,
        "generation prefill (global layers)": "xla",
        "generation prefill (windowed layers)": "xla blockwise",  # a window over more than 4 key blocks
        "generation decode step": "xla"}


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
