"""What the train step around the fused GPU kernels runs, lowered for an H100 on this CPU, and the route of each pass.

- remat="attention" (ops.names): the forward kernel launches once per layer for the twin (its log-sum-exp kept by
  name) and twice for DIFF (its fp32 second map is not kept: the forward runs again in the backward); its output
  reaches the scan's stack of saved values only behind an optimization barrier, so that XLA's dynamic-slice fusion
  does not clone the kernel to write that stack in place (the third launch per layer of the 2026-11-27 capture).
- the backward's D_m = rowsum(dO * O_m) is one reduction of dO with the pair (o, O_2), equal to the sums it replaces.
- auto per pass: HOPPER_MS is the committed measurements; a call whose passes take different impls runs one
  undifferentiated and trains through the other (a custom VJP), and the model tells auto what its remat saves.
"""

from __future__ import annotations

import collections
import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import ops
from diffjax.config import ModelConfig
from diffjax.jax_compat import H100, lowering_target
from diffjax.model import TransformerLM
from diffjax.ops import compositions, pallas_gpu
from diffjax.ops.reference import diff_attention_xla
from diffjax.train.optimizer import OptimizerConfig, make_optimizer
from diffjax.train.step import init_state, make_eval_step, make_train_step

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNEL = re.compile(r"diffjax_mgpu(?:_single)?_(fwd|bwd_dq|bwd_dkdv)")


def _lowered_train_step(attention: str) -> str:
    """StableHLO of a 2-layer scanned bf16 train step (d = 64) with impl pallas_gpu and remat attention, for an H100."""
    config = ModelConfig(d_model=256, num_layers=2, num_heads=2 if attention == "diff" else 4, attention=attention,
                         dtype="bfloat16", attention_impl="pallas_gpu", remat="attention", scan_layers=True,
                         max_seq_len=128)
    tx, schedule = make_optimizer(OptimizerConfig(), 10)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    state = jax.eval_shape(lambda key: init_state(TransformerLM(config, rngs=nnx.Rngs(key)), tx, key), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, 1, 128), jnp.int32)
    step = make_train_step(graphdef, tx, schedule, config)
    with lowering_target(H100) as cuda:  # compiled for an H100: the kernels compile, not their interpreter
        lowered = jax.jit(step).trace(state, {"tokens": tokens, "segment_ids": tokens, "positions": tokens})
        return lowered.lower(lowering_platforms=(cuda,)).as_text()


@pytest.mark.parametrize("attention, forward_launches", [("standard", 1), ("diff", 2)])
def test_the_train_step_launches_the_forward_kernel_once_per_layer_for_the_twin_and_twice_for_diff(
        attention, forward_launches):
    text = _lowered_train_step(attention)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    # The layers are one scan: its body is lowered once, so these are per layer.
    launches = collections.Counter(KERNEL.search(line).group(1) for line in calls)
    assert launches == {"fwd": forward_launches, "bwd_dq": 1, "bwd_dkdv": 1}, launches
    # Whatever reads a forward launch's output o reads it through an optimization barrier (in the backward's
    # rerun nothing reads it: the saved o serves).
    for function in text.split("\n  func.func ")[1:]:
        for line in function.splitlines():
            if "stablehlo.custom_call @mosaic_gpu" in line and KERNEL.search(line).group(1) == "fwd":
                o = re.escape(re.match(r"\s*(%[\w.]+):\d+ = ", line).group(1)) + r"#0\b"
                readers = [other for other in function.splitlines() if re.search(o, other) and other != line]
                assert all("stablehlo.optimization_barrier" in reader for reader in readers), readers


@pytest.mark.gpu
@pytest.mark.parametrize("attention, forward_launches", [("standard", 1), ("diff", 2)])
def test_the_compiled_train_step_launches_each_kernel_as_lowered(attention, forward_launches):
    """On the GPU, after XLA's passes (a dynamic-slice fusion cloned the forward kernel before the barrier): the
    compiled step holds as many Mosaic GPU calls as the lowered one, one scan body each way."""
    config = ModelConfig(d_model=256, num_layers=2, num_heads=2 if attention == "diff" else 4, attention=attention,
                         dtype="bfloat16", attention_impl="pallas_gpu", remat="attention", scan_layers=True,
                         max_seq_len=512)
    tx, schedule = make_optimizer(OptimizerConfig(), 10)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    state = jax.eval_shape(lambda key: init_state(TransformerLM(config, rngs=nnx.Rngs(key)), tx, key), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, 4, 512), jnp.int32)
    step = make_train_step(graphdef, tx, schedule, config)
    hlo = jax.jit(step).lower(state, {"tokens": tokens, "segment_ids": tokens, "positions": tokens}).compile().as_text()
    assert hlo.count('custom_call_target="mosaic_gpu') == forward_launches + 2, hlo.count("mosaic_gpu")


def test_diff_row_dots_are_one_reduction_of_dO_with_o_and_O2():
    """D_1 = rowsum(dO (o + lam O_2)), D_2 = rowsum(dO O_2) (the kernels' D, [B, H, 2, T]), against float64; computed as
    one reduce_sum over dv and no dot_general (which XLA ran as separate passes with a stack of the two)."""
    rng = np.random.default_rng(0)
    B, T, H, dv = 2, 16, 3, 32
    do, o = (jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.bfloat16) for _ in range(2))
    o2 = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    lam = jnp.asarray(rng.uniform(0.2, 0.9, size=(B, H, T)), jnp.float32)
    D = np.asarray(pallas_gpu._row_dots(do, o, o2, lam))
    do64, o64, o2_64 = (np.asarray(x, np.float64) for x in (do, o, o2))
    o1 = o64 + np.asarray(lam, np.float64).transpose(0, 2, 1)[..., None] * o2_64
    want = np.stack([np.einsum("bthv,bthv->bht", do64, o1), np.einsum("bthv,bthv->bht", do64, o2_64)], axis=2)
    np.testing.assert_allclose(D, want, rtol=1e-5, atol=1e-4)
    single = np.asarray(pallas_gpu._row_dots(do, o, None, None))
    np.testing.assert_allclose(single[:, :, 0], np.einsum("bthv,bthv->bht", do64, o64), rtol=1e-5, atol=1e-4)
    eqns = jax.make_jaxpr(pallas_gpu._row_dots)(do, o, o2, lam).eqns
    reductions = [e for e in eqns if e.primitive.name in ("reduce_sum", "dot_general")]
    assert [(e.primitive.name, e.invars[0].aval.shape) for e in reductions] == [("reduce_sum", (B, T, H, 2, dv))]


def test_the_hopper_table_is_the_committed_measurements():
    spec = importlib.util.spec_from_file_location("attention_benchmark", REPO_ROOT / "benchmarks" / "attention.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    results = REPO_ROOT / "benchmarks" / "results"
    files = [results / "attention_gpu.json", results / "capture_2026-11-27" / "attention_capture.json"]
    assert benchmark.route_table(files) == ops.HOPPER_MS


def _call(op="diff_attention", saved="all", segments=None):
    if op == "diff_attention":
        shapes = (1, 128, 4, 2, 128), (1, 128, 2, 2, 128), (1, 128, 2, 256)
    else:
        shapes = (1, 128, 4, 128), (1, 128, 2, 128), (1, 128, 2, 128)
    return ops.AttentionCall(op, *shapes, "bfloat16", True, segments, saved=saved)


# (op, what the backward finds saved) -> (undifferentiated, differentiated) on an H100, causal, d 128, no segment ids.
# Differentiated, a forward the backward runs again counts (HOPPER_MS: fwd + fwd+bwd): remat="attention" keeps the
# twin's pallas_gpu residuals by name, not DIFF's, and none of cuDNN's.
PASS_ROUTES = {
    ("diff_attention", "all"): ("pallas_gpu", "cudnn"),  # fwd 1.69 vs 2.4 ms; fwd+bwd 8.16 vs 7.87
    ("diff_attention", "named"): ("pallas_gpu", "pallas_gpu"),  # 8.16 + 1.69 vs 7.87 + 2.4
    ("diff_attention", "none"): ("pallas_gpu", "pallas_gpu"),
    ("dot_product_attention", "all"): ("pallas_gpu", "cudnn"),  # fwd 1.09 vs 1.26; fwd+bwd 5.51 vs 4.21
    ("dot_product_attention", "named"): ("pallas_gpu", "cudnn"),  # 5.51 vs 4.21 + 1.26
    ("dot_product_attention", "none"): ("pallas_gpu", "cudnn"),  # 5.51 + 1.09 vs 5.47
}


@pytest.mark.parametrize("op, saved", list(PASS_ROUTES))
def test_auto_picks_each_pass_by_the_table_and_what_remat_saves(op, saved):
    route = ops.choose(_call(op, saved), "auto", ops.DEVICES["h100"])
    assert (route.impl, route.grad_impl) == PASS_ROUTES[op, saved], route
    assert set(route.by_pass()) == set(ops.PASSES)
    # Packed rows (segment ids): cuDNN cannot take them, the fused kernel runs both passes.
    packed = ops.choose(_call(op, saved, segments="one"), "auto", ops.DEVICES["h100"])
    assert (packed.impl, packed.grad_impl, packed.reason) == ("pallas_gpu", "pallas_gpu", "fused Mosaic GPU kernel")


def _stand_ins(monkeypatch):
    """pallas_gpu's and cuDNN's diff_attention replaced by the XLA reference, each logging its calls (traced once
    per pass): the dispatch runs on a CPU as on an H100 (ops.simulated_device)."""
    called = []

    def stand_in(name):
        def attention(q, k, v, lam, *, causal, segment_ids=None, scale=None, **_):
            called.append(name)
            return diff_attention_xla(q, k, v, lam, causal=causal, segment_ids=segment_ids, scale=scale)
        return attention

    monkeypatch.setattr(pallas_gpu, "diff_attention_pallas_gpu", stand_in("pallas_gpu"))
    monkeypatch.setattr(compositions, "diff_attention_cudnn", stand_in("cudnn"))
    return called


def test_a_split_call_runs_its_forward_impl_undifferentiated_and_trains_through_the_other(monkeypatch):
    called = _stand_ins(monkeypatch)
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 16, 2, 2, 128)), jnp.bfloat16) for _ in range(2))
    v, lam = jnp.asarray(rng.normal(size=(1, 16, 2, 256)), jnp.bfloat16), jnp.asarray(0.6, jnp.float32)

    def loss(attention, q, k, v, lam):
        return jnp.sum(attention(q, k, v, lam).astype(jnp.float32) ** 2)

    with ops.simulated_device(ops.DEVICES["h100"]):
        auto = lambda *a: ops.diff_attention(*a, causal=True)  # noqa: E731
        o = jax.jit(auto)(q, k, v, lam)
        assert called == ["pallas_gpu"]
        grads = jax.jit(jax.grad(lambda *a: loss(auto, *a), argnums=(0, 1, 2, 3)))(q, k, v, lam)
    assert called == ["pallas_gpu", "cudnn"]  # differentiation ran cuDNN's forward and VJP, not the fused kernel's
    reference = lambda *a: diff_attention_xla(*a, causal=True)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(reference(q, k, v, lam), np.float32))
    want = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(q, k, v, lam)
    for got, ref in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


@pytest.mark.parametrize("remat, trains_through", [("none", "cudnn"), ("attention", "pallas_gpu")])
def test_the_model_tells_auto_what_its_remat_saves(monkeypatch, remat, trains_through):
    """A DIFF model at d 128 (one head, dv 256) without segment ids, differentiated on an H100: with everything saved
    cuDNN trains it; under remat="attention", which keeps none of cuDNN's residuals nor DIFF's second map, the fused
    kernel does (its forward is faster, and both run again in the backward)."""
    called = _stand_ins(monkeypatch)
    config = ModelConfig(d_model=256, num_layers=1, num_heads=1, dtype="bfloat16", remat=remat, max_seq_len=16)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    tokens = jnp.zeros((1, 16), jnp.int32)
    with ops.simulated_device(ops.DEVICES["h100"]):  # traced only: which impl the dispatch calls
        jax.eval_shape(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens))), params)
    assert called == [trains_through], called


def test_a_batch_without_segment_ids_trains_as_one_document_per_row():
    """benchmarks/train_step.py --rows unpacked: the step's loss (sum and target count) equals that of all-ones
    segment ids; the attention then gets none, so cuDNN can take it on a GPU."""
    config = ModelConfig(d_model=64, num_layers=1, num_heads=2, max_seq_len=16, attention_impl="xla")
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    step = jax.jit(make_eval_step(nnx.graphdef(model)))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    batch = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens.shape)}
    unpacked, packed = step(params, batch), step(params, {**batch, "segment_ids": jnp.ones_like(tokens)})
    np.testing.assert_allclose(unpacked, packed, rtol=1e-6)
    assert float(unpacked[1]) == 2 * 15  # every next-token target counts
