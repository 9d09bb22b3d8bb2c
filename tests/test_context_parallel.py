"""Context parallelism (issue 24) on 8 simulated CPU devices: the sequence split over the mesh's `context` axis
gives the single-device attention, loss and gradients for every attention kind, packed and unpacked, alone and
with data / fsdp / tensor axes; checkpoints move between context sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from diffjax import attention_kinds, ops, parallel, sharding
from diffjax.config import ModelConfig
from diffjax.ops.context_parallel import context_order, to_context_order
from diffjax.train.mesh import MESH_AXES, ParallelConfig
from diffjax.train.step import setup_sharded_state

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")


def _mesh(**sizes) -> Mesh:
    shape = [sizes.get(axis, 1) for axis in MESH_AXES]
    return Mesh(np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape), MESH_AXES)


def test_the_context_layout_pairs_an_early_chunk_with_a_late_one():
    np.testing.assert_array_equal(context_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(context_order(6, 1), np.arange(6))
    # Causal work per device (keys at or before each query) is the same on every device.
    order = context_order(64, 4).reshape(4, 16)
    np.testing.assert_array_equal((order + 1).sum(axis=1), np.full(4, (order + 1).sum() // 4))
    with pytest.raises(ValueError, match=r"length 20 .* context=4 .* multiple of 2 x context = 8 \(data.seq_len"):
        context_order(20, 4)


def _packed_ids(B, T):
    """Three documents in row 0, one in the others, and padding (id 0) at the end of the last row."""
    ids = np.ones((B, T), np.int32)
    ids[0, T // 3:] = 2
    ids[0, 3 * T // 4:] = 3
    ids[-1, T - 5:] = 0
    return jnp.asarray(ids)


# op, mesh, packed, causal: every combination appears somewhere, and every mesh axis beside context.
OP_CASES = {
    "diff,G=2,context=4,data=2,packed": ("diff", dict(context=4, data=2), True, True),
    "diff_v2(G=1,lam per token),context=8": ("diff_v2", dict(context=8), False, True),
    "standard(GQA),context=2,tensor=2,fsdp=2,packed": ("standard", dict(context=2, tensor=2, fsdp=2), True, True),
    "diff,not causal,context=4,tensor=2,packed": ("diff", dict(context=4, tensor=2), True, False),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_attention_over_the_context_axis_equals_the_xla_reference(case, measured):
    """Inputs put in the context layout, attention under the mesh, output put back: the XLA reference's output
    and gradients (q, k, v, lambda) within float32 rounding."""
    op, mesh_sizes, packed, causal = OP_CASES[case]
    B, T, H, K, d = 4, 64, 4, 2, 8
    keys = jax.random.split(jax.random.key(1), 5)
    if op == "standard":
        shapes = [(B, T, H, d), (B, T, K, d), (B, T, K, d)]
    else:
        G, dv = (2, 2 * d) if op == "diff" else (1, d)
        shapes = [(B, T, H, 2, d), (B, T, K, G, d), (B, T, K, dv)]
    q, k, v = (jax.random.normal(key, shape) for key, shape in zip(keys, shapes))
    lam = 0.2 + 0.1 * jax.random.normal(keys[3], (B, T, H)) if op == "diff_v2" else 0.35
    segment_ids = _packed_ids(B, T) if packed else None
    mesh, C = _mesh(**mesh_sizes), mesh_sizes["context"]

    def attention(q, k, v, lam, ids, impl):
        if op == "standard":
            return ops.dot_product_attention(q, k, v, causal=causal, segment_ids=ids, impl=impl)
        return ops.diff_attention(q, k, v, lam, causal=causal, segment_ids=ids, impl=impl)

    def over_context(q, k, v, lam):
        laid_out = [to_context_order(x, C) if jnp.ndim(x) else x for x in (q, k, v, lam)]
        ids = None if segment_ids is None else to_context_order(segment_ids, C)
        with sharding.activation_sharding(mesh):
            o = attention(*laid_out, ids, "auto")
        return o[:, np.argsort(context_order(T, C))]

    weights = jax.random.normal(keys[4], jax.eval_shape(lambda: attention(q, k, v, lam, segment_ids, "xla")).shape)
    argnums = (0, 1, 2, 3) if jnp.ndim(lam) else (0, 1, 2)
    results = []
    for f in (lambda *a: attention(*a, segment_ids, "xla"), over_context):
        loss = lambda *a, f=f: jnp.sum(f(*a) * weights)  # noqa: E731
        results.append(jax.jit(lambda *a, f=f, loss=loss: (f(*a), jax.grad(loss, argnums)(*a)))(q, k, v, lam))
    (o_ref, g_ref), (o_cp, g_cp) = results
    measured("output max |context - reference|", float(jnp.max(jnp.abs(o_cp - o_ref))), 2e-6)
    np.testing.assert_allclose(o_cp, o_ref, atol=2e-6)
    for name, a, b in zip("qkvl", g_cp, g_ref):
        worst = float(jnp.max(jnp.abs(a - b)))
        measured(f"d{name} max |context - reference|", worst, 2e-5)
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"gradient of {name}")


MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
                    attention_impl="xla")
KINDS = attention_kinds.names()
CONTEXT_MESHES = {
    "context=2,data=2,tensor=2": ParallelConfig(data=2, context=2, tensor=2),
    "context=4,fsdp=2": ParallelConfig(data=1, fsdp=2, context=4),
    "context=8": ParallelConfig(data=1, context=8),
}


def _batch(packed: bool, rows: int = 4, length: int = 32):
    """[1, rows, length]; packed: documents of several lengths per row (positions restart), padding at the end."""
    rng = np.random.default_rng(0)
    ids = np.asarray(_packed_ids(rows, length)) if packed else np.ones((rows, length), np.int32)
    starts = np.concatenate([np.ones((rows, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    positions = np.arange(length)[None] - np.maximum.accumulate(np.where(starts, np.arange(length), 0), axis=1)
    tokens = rng.integers(0, MODEL.vocab_size, (rows, length))
    return {"tokens": tokens[None].astype(np.int32), "segment_ids": ids[None], "positions": positions[None].astype(np.int32)}


def _one_sgd_step(config: ModelConfig, parallel_config: ParallelConfig, batch):
    """One SGD step (lr 1: the update is the gradient, so comparing params compares gradients)."""
    mesh = parallel.make_mesh(parallel_config)
    tx = optax.sgd(1.0)
    training, state = setup_sharded_state(config, tx, 0, mesh)
    step = training.jit_train_step(tx, lambda _: 1.0, config)
    before = jax.device_get(state["params"])
    new_state, metrics = step(state, {k: jax.device_put(v, training.step_batch_sharding) for k, v in batch.items()})
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), before, jax.device_get(new_state["params"]))
    # The subtraction rounds at the params' float32 spacing: part of the tolerance.
    rounding = jax.tree.map(lambda p: 2 * float(np.spacing(np.max(np.abs(p)).astype(np.float32))), before)
    return jax.device_get(metrics), grads, rounding


@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_every_gradient_with_a_context_axis_equal_one_device(kind, measured):
    config = MODEL.replace(attention=kind)
    for packed in (True, False):
        batch = _batch(packed)
        reference_metrics, reference_grads, rounding = _one_sgd_step(config, ParallelConfig(data=1), batch)
        meshes = CONTEXT_MESHES if packed else {"context=8": CONTEXT_MESHES["context=8"]}
        for mesh_name, parallel_config in meshes.items():
            where = f"{kind}, {'packed' if packed else 'unpacked'}, {mesh_name}"
            metrics, grads, _ = _one_sgd_step(config, parallel_config, batch)
            assert metrics["loss_tokens"] == reference_metrics["loss_tokens"], where
            np.testing.assert_allclose(metrics["loss"], reference_metrics["loss"], rtol=1e-6, err_msg=where)
            worst = 0.0
            for (path, g), g_ref, params_rounding in zip(jax.tree_util.tree_leaves_with_path(grads),
                                                        jax.tree.leaves(reference_grads), jax.tree.leaves(rounding)):
                tolerance = 1e-5 * float(np.max(np.abs(g_ref))) + params_rounding
                difference = float(np.max(np.abs(g - g_ref))) / tolerance
                worst = max(worst, difference)
                assert difference <= 1, f"{where}: gradient of {jax.tree_util.keystr(path)} differs by {difference} x the tolerance"
            measured(f"{where}: gradients max |context - one device| / tolerance", worst, 1)
