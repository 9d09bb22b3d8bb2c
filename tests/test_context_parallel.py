"""Context parallelism (issue 24) on 8 simulated CPU devices: the sequence split over the mesh's `context` axis
gives the single-device attention, loss and gradients for every attention kind, packed and unpacked, alone and
with data / fsdp / tensor axes; checkpoints move between context sizes."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from diffjax import attention_kinds, ops, parallel, sharding
from diffjax.config import ModelConfig
from diffjax.ops import context_parallel
from diffjax.ops.context_parallel import context_order, to_context_order
from diffjax.train import load_run_config, train
from diffjax.train.mesh import MESH_AXES, ParallelConfig
from diffjax.train.config import CheckpointConfig
from diffjax.train.optimizer import make_optimizer
from diffjax.train.state_checkpoints import Checkpointer
from diffjax.train.step import make_eval_step, setup_sharded_state, sharded_init

REPO_ROOT = Path(__file__).resolve().parents[1]
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


# op, mesh, packed, causal (, sliding window): every combination appears somewhere, and every mesh axis beside context.
OP_CASES = {
    "diff,G=2,context=4,data=2,packed": ("diff", dict(context=4, data=2), True, True),
    "diff_v2(G=1,lam per token),context=8": ("diff_v2", dict(context=8), False, True),
    "standard(GQA),context=2,tensor=2,fsdp=2,packed": ("standard", dict(context=2, tensor=2, fsdp=2), True, True),
    "diff,not causal,context=4,tensor=2,packed": ("diff", dict(context=4, tensor=2), True, False),
    "diff,window 11,context=4,data=2,packed": ("diff", dict(context=4, data=2), True, True, 11),
    "standard(GQA),window 6,context=8": ("standard", dict(context=8), False, True, 6),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_attention_over_the_context_axis_equals_the_xla_reference(case, measured):
    """Inputs put in the context layout, attention under the mesh, output put back: the XLA reference's output
    and gradients (q, k, v, lambda) within float32 rounding."""
    _check_attention_over_the_context_axis(case, "auto", "all_gather", measured)


# The fused Pallas TPU kernels per query chunk (interpret mode here; "auto" takes them on a TPU).
FUSED_CASES = ["diff,G=2,context=4,data=2,packed", "diff_v2(G=1,lam per token),context=8",
               "standard(GQA),context=2,tensor=2,fsdp=2,packed", "diff,window 11,context=4,data=2,packed",
               "diff,not causal,context=4,tensor=2,packed"]


# Two cases on CI's newest-jax leg, all on the oldest.
@pytest.mark.parametrize("case", [c if "window" in c or c.startswith("diff,G=2") else pytest.param(c, marks=pytest.mark.single_leg)
                                  for c in FUSED_CASES])
def test_the_fused_tpu_kernels_over_the_context_axis_equal_the_xla_reference(case, measured):
    """impl="pallas_tpu" under a context axis: each device's two query chunks run the fused kernels against the
    gathered K/V with their place in the sequence as the kernels' offset; output and gradients as the reference."""
    _check_attention_over_the_context_axis(case, "pallas_tpu", "pallas_call", measured)


def _spy_on_the_mosaic_gpu_kernels(monkeypatch) -> list:
    """The static settings of every traced call of the Mosaic GPU kernels (their jaxpr in interpret mode holds no
    pallas_call to look for)."""
    from diffjax.ops import pallas_gpu

    calls, flash = [], pallas_gpu._flash
    monkeypatch.setattr(pallas_gpu, "_flash", lambda st, *args: (calls.append(st), flash(st, *args))[1])
    return calls


@pytest.mark.parametrize("op", ["diff", "standard"])
def test_the_fused_gpu_kernels_run_per_query_chunk_over_the_context_axis(op, monkeypatch):
    """Under a context axis, impl="pallas_gpu" (and "auto" on a Hopper GPU, bf16) calls the Mosaic GPU kernels once
    per query chunk, each against every key with a traced query offset; "auto" falls back to the blockwise XLA path
    where they cannot run (float32; a GPU that is not Hopper). Traced only, routed as on an H100 / A100
    (ops.simulated_device): interpreted kernels under shard_map would run concurrently on the host devices, which
    deadlocks Mosaic GPU's interpreter. Their numbers with an offset are tests/test_ops_pallas_gpu.py's
    (test_pallas_gpu_interpret_query_offset), and the offsets each device passes are the ones the TPU kernels are
    tested with end to end above."""
    B, T, H, K, d, C = 1, 128, 2, 1, 64, 2
    mesh = _mesh(context=C)
    kernel_calls = _spy_on_the_mosaic_gpu_kernels(monkeypatch)

    def fused_calls(dtype, impl):
        shapes = [(B, T, H, 2, d), (B, T, K, 2, d), (B, T, K, 2 * d)] if op == "diff" else [(B, T, H, d), (B, T, K, d), (B, T, K, d)]
        q, k, v = (jnp.zeros(s, dtype) for s in shapes)
        ids = to_context_order(_packed_ids(B, T), C)
        attention = ((lambda q, k, v: ops.diff_attention(q, k, v, 0.35, segment_ids=ids, impl=impl)) if op == "diff" else
                     (lambda q, k, v: ops.dot_product_attention(q, k, v, segment_ids=ids, impl=impl)))
        kernel_calls.clear()
        with sharding.activation_sharding(mesh):
            assert "all_gather" in str(jax.make_jaxpr(attention)(q, k, v))
        return [(st.T, st.S, st.traced_offset, st.has_seg) for st in kernel_calls]

    each_chunk = [(T // (2 * C), T, True, True)] * 2  # a device's two chunks of 32 queries, all 128 keys
    assert fused_calls(jnp.bfloat16, "pallas_gpu") == each_chunk
    with ops.simulated_device(ops.DEVICES["h100"]):
        assert fused_calls(jnp.bfloat16, "auto") == each_chunk
        assert fused_calls(jnp.float32, "auto") == []
    with ops.simulated_device(ops.DEVICES["a100"]):
        assert fused_calls(jnp.bfloat16, "auto") == []
    with pytest.raises(ValueError, match="impl='pallas_gpu' needs .*bfloat16 / float16, got float32"):
        fused_calls(jnp.float32, "pallas_gpu")


def _check_attention_over_the_context_axis(case, impl, marker, measured):
    """marker: a primitive the context path's program must hold (so that equality is not the reference's own)."""
    op, mesh_sizes, packed, causal, *window = OP_CASES[case]
    window = window[0] if window else None
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
            return ops.dot_product_attention(q, k, v, causal=causal, segment_ids=ids, impl=impl, window=window)
        return ops.diff_attention(q, k, v, lam, causal=causal, segment_ids=ids, impl=impl, window=window)

    def over_context(q, k, v, lam):
        laid_out = [to_context_order(x, C) if jnp.ndim(x) else x for x in (q, k, v, lam)]
        ids = None if segment_ids is None else to_context_order(segment_ids, C)
        with sharding.activation_sharding(mesh):
            o = attention(*laid_out, ids, impl)
        return o[:, np.argsort(context_order(T, C))]

    weights = jax.random.normal(keys[4], jax.eval_shape(lambda: attention(q, k, v, lam, segment_ids, "xla")).shape)
    # The context path ran (XLA would partition the reference correctly too, so equality alone proves nothing).
    program = str(jax.make_jaxpr(over_context)(q, k, v, lam))
    assert "all_gather" in program and marker in program
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


@pytest.mark.parametrize("op", [pytest.param("diff", marks=pytest.mark.slow), "standard"])
def test_the_xla_path_attends_long_sequences_blockwise(op, monkeypatch, measured):
    """From BLOCKWISE_FROM tokens the XLA path runs blockwise (query pieces x key blocks, blocks in a piece's
    future skipped, flash-style backward): the reference's output and gradients. Lowered here to 48 tokens in
    pieces of 8 queries and blocks of 16 keys; packed, GQA."""
    monkeypatch.setattr(context_parallel, "BLOCKWISE_FROM", 48)
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", 8)
    monkeypatch.setattr(context_parallel, "DEFAULT_BLOCK", 16)
    B, T, H, K, d = 3, 48, 4, 2, 8
    keys = jax.random.split(jax.random.key(2), 4)
    if op == "standard":
        q, k, v = (jax.random.normal(key, (B, T, n, d)) for key, n in zip(keys, (H, K, K)))
        attention = lambda q, k, v, impl: ops.dot_product_attention(q, k, v, segment_ids=ids, impl=impl)  # noqa: E731
    else:
        q, k, v = (jax.random.normal(key, shape) for key, shape in
                   zip(keys, ((B, T, H, 2, d), (B, T, K, 2, d), (B, T, K, 2 * d))))
        attention = lambda q, k, v, impl: ops.diff_attention(q, k, v, 0.4, segment_ids=ids, impl=impl)  # noqa: E731
    ids = _packed_ids(B, T)
    weights = jax.random.normal(keys[3], jax.eval_shape(lambda: attention(q, k, v, "xla")).shape)
    assert "custom_vjp_call" in str(jax.make_jaxpr(lambda: attention(q, k, v, "xla"))())  # the blockwise path ran
    reference = lambda q, k, v: ops.diff_attention_xla(q, k, v, 0.4, segment_ids=ids) if op == "diff" else \
        ops.dot_product_attention_xla(q, k, v, segment_ids=ids)  # noqa: E731

    def output_and_grads(f):
        return jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * weights), (0, 1, 2))(*a)))(q, k, v)

    (o_blockwise, g_blockwise), (o_reference, g_reference) = (
        output_and_grads(lambda *a: attention(*a, "xla")), output_and_grads(reference))
    measured(f"{op} blockwise output max |blockwise - reference|", float(jnp.max(jnp.abs(o_blockwise - o_reference))), 2e-6)
    np.testing.assert_allclose(o_blockwise, o_reference, atol=2e-6)
    for name, a, b in zip("qkv", g_blockwise, g_reference):
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"gradient of {name}")
    # Query and key ids that differ (a pair of [B, T] arrays) mask by both, as in the reference.
    ids = (_packed_ids(B, T), jnp.where(jnp.arange(T) % 3 == 0, 5, _packed_ids(B, T)))
    np.testing.assert_allclose(attention(q, k, v, "xla"), reference(q, k, v), atol=2e-6)


MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
                    attention_impl="xla")
KINDS = attention_kinds.names()
CONTEXT_MESHES = {
    "context=2,data=2,tensor=2": ParallelConfig(data=2, context=2, tensor=2),
    "context=4,fsdp=2": ParallelConfig(data=1, fsdp=2, context=4),
    "context=8": ParallelConfig(data=1, context=8),
}


def _batch(rows: int = 4, length: int = 32):
    """[rows, length]: row 0 packs three documents, rows 1-2 hold one (unpacked), row 3 ends in padding;
    positions restart at each document."""
    ids = np.asarray(_packed_ids(rows, length))
    starts = np.concatenate([np.ones((rows, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    positions = np.arange(length)[None] - np.maximum.accumulate(np.where(starts, np.arange(length), 0), axis=1)
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, (rows, length))
    return {"tokens": tokens.astype(np.int32), "segment_ids": ids, "positions": positions.astype(np.int32)}


def _loss_and_grads(config: ModelConfig, parallel_config: ParallelConfig, params, batch):
    """(loss sum, gradients) of the trainer's loss (its eval step's, which the train step shares) on a mesh."""
    training, _ = sharded_init(config, optax.sgd(1.0), parallel.make_mesh(parallel_config))
    eval_step = make_eval_step(training.graphdef, training.mesh)
    params = jax.device_put(params, training.state_shardings["params"])
    batch = jax.device_put(batch, training.eval_batch_sharding)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, b: eval_step(p, b)[0]))(params, batch)
    return float(loss), jax.device_get(grads)


# Every kind on CI's oldest-jax leg; DIFF V1 alone on the newest and in the fast lane (the op tests above cover the
# other op forms there).
@pytest.mark.parametrize("kind", [n if n == "diff" else
                                  pytest.param(n, marks=[pytest.mark.single_leg, pytest.mark.slow]) for n in KINDS])
def test_loss_and_every_gradient_with_a_context_axis_equal_one_device(kind, measured):
    """Packed, unpacked and padded rows in one batch. DIFF V1 on context 2 (with data and tensor), 4 (with fsdp)
    and 8; the other kinds, whose op forms the tests above run on every mesh, on context 2 x data 2 x tensor 2."""
    meshes = CONTEXT_MESHES if kind == "diff" else {name: CONTEXT_MESHES[name] for name in ["context=2,data=2,tensor=2"]}
    _check_context_meshes_equal_one_device(MODEL.replace(attention=kind), meshes, kind, measured)


@pytest.mark.slow
@pytest.mark.both_legs
def test_windowed_and_global_layers_with_a_context_axis_equal_one_device(measured):
    """A sliding window (5 keys) on layers 0 and 2 around a global layer 1, scanned (lax.cond picks per layer)."""
    config = MODEL.replace(attention="diff_v2", num_layers=3, attention_window=5, global_layers=(1,), scan_layers=True)
    meshes = {name: CONTEXT_MESHES[name] for name in ["context=4,fsdp=2"]}
    _check_context_meshes_equal_one_device(config, meshes, "diff_v2 windowed", measured)


@pytest.mark.single_leg
@pytest.mark.slow
def test_the_trainer_with_fused_tpu_kernels_on_a_context_axis_equals_one_device(measured):
    """The train step's loss and gradients with attention_impl="pallas_tpu" (interpret mode here; what "auto" runs
    on a TPU) on context 4 x fsdp 2, scanned layers with remat, against one device running the same kernels."""
    config = MODEL.replace(attention_impl="pallas_tpu", scan_layers=True, remat="full")
    meshes = {name: CONTEXT_MESHES[name] for name in ["context=4,fsdp=2"]}
    _check_context_meshes_equal_one_device(config, meshes, "diff pallas_tpu", measured)


def _check_context_meshes_equal_one_device(config, meshes, kind, measured):
    batch = _batch()
    _, state = setup_sharded_state(config, optax.sgd(1.0), 0, parallel.make_mesh(ParallelConfig(data=1)))
    params = jax.device_get(state["params"])
    reference_loss, reference_grads = _loss_and_grads(config, ParallelConfig(data=1), params, batch)
    for mesh_name, parallel_config in meshes.items():
        where = f"{kind}, {mesh_name}"
        loss, grads = _loss_and_grads(config, parallel_config, params, batch)
        np.testing.assert_allclose(loss, reference_loss, rtol=1e-6, err_msg=where)
        worst = 0.0
        for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference_grads)):
            # lambda's gradient is a sum of cancelling terms over every token (as in test_model's chunked loss)
            tolerance = 1e-4 if "lambda" in jax.tree_util.keystr(path) else 1e-5
            difference = float(np.max(np.abs(g - g_ref))) / float(np.max(np.abs(g_ref))) / tolerance
            worst = max(worst, difference)
            assert difference < 1, f"{where}: gradient of {jax.tree_util.keystr(path)} differs by {difference} x the tolerance"
        measured(f"{where}: gradients max |context - one device| / (max |g| x 1e-5, 1e-4 for lambda)", worst, 1)


@pytest.mark.single_leg  # context meshes on the newest jax: the loss-and-gradient equalities above run there
@pytest.mark.slow
def test_the_64k_recipe_trains_with_context_parallelism_and_its_checkpoints_move_between_meshes(tmp_path):
    """configs/paper/diff-3b-64k.yaml at a small width and a 512-token sequence (CPU), the byte tokenizer and the
    built-in corpus: 3 steps on context=8; its step-2 checkpoint restores exactly, with the rules'
    shardings, onto other meshes, and resumed on data=4 x context=2 gives the same step 3."""
    small = [
        "model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.mlp_dim=128", "model.vocab_size=264",
        "data.source=builtin", "data.tokenizer.kind=byte", "data.seq_len=512", "data.builtin_bytes=100000",
        "data.shuffle_window_tokens=8192", "data.eval_fraction=0", "train.batch_tokens=null", "train.batch_size=4",
        "train.micro_batch_per_device=4", "train.init_from=null", "train.log_every=1", "train.eval_every=0",
        "train.sample_tokens=0", "train.progress=lines", "train.tensorboard=false", "checkpoint.every=1",
        "checkpoint.async_save=false",
    ]

    def config(run_dir, *overrides):
        return load_run_config(REPO_ROOT / "configs" / "paper" / "diff-3b-64k.yaml",
                               small + [f"train.run_dir={run_dir}", *overrides])

    lines = []
    straight = train(config(tmp_path / "straight", "train.steps=3", "parallel.data=1", "parallel.context=8"),
                     log=lines.append)
    assert any("mesh: data=1 x fsdp=1 x context=8 x tensor=1" in line for line in lines), lines
    # Its step-2 checkpoint, as if it had stopped there, is moved onto other meshes.
    shutil.copytree(tmp_path / "straight", tmp_path / "moved")
    shutil.rmtree(tmp_path / "moved" / "checkpoints" / "3")
    saved = Checkpointer(tmp_path / "moved", CheckpointConfig()).read(2)["state"]
    moved_config = config(tmp_path / "moved", "train.steps=3", "parallel.data=4", "parallel.context=2")
    for name, mesh_config in (("data=2,context=2,tensor=2", ParallelConfig(data=2, context=2, tensor=2)),
                              ("one device", ParallelConfig(data=1))):
        mesh = parallel.make_mesh(mesh_config)
        tx, _ = make_optimizer(moved_config.optim, moved_config.train.steps)
        training, init = sharded_init(moved_config.model, tx, mesh)
        checkpointer = Checkpointer(tmp_path / "moved", moved_config.checkpoint)
        restored, _ = checkpointer.restore(2, jax.eval_shape(init, jax.random.key(0)))  # the state's shapes and shardings
        checkpointer.close()
        for x, y, target in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(training.state_shardings)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"restored on {name}")
            assert x.sharding.is_equivalent_to(target, x.ndim)

    lines = []
    moved = train(moved_config, log=lines.append)
    assert any(line.startswith("resumed from") and "(step 2)" in line for line in lines), lines
    assert any("mesh: data=4 x fsdp=1 x context=2 x tensor=1" in line for line in lines), lines
    np.testing.assert_allclose(moved.losses[3], straight.losses[3], rtol=1e-5)
