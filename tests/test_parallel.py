"""Sharded training on 8 simulated CPU devices (tests/conftest.py): data, FSDP and tensor parallel meshes
give the same step as one device, parameters are sharded as the rules say, remat and scan do not change the numbers, and bad meshes are clear errors. Checkpoints moving between meshes: test_context_parallel.py."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax import parallel
from diffjax.config import ModelConfig
from diffjax.train.mesh import ParallelConfig
from diffjax.model import TransformerLM
from diffjax.train import load_run_config, train
from diffjax.train.optimizer import OptimizerConfig, make_optimizer
from diffjax.train.step import setup_sharded_state

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

REPO_ROOT = Path(__file__).resolve().parents[1]
# GQA (4 query heads over 2 kv heads) so that tensor=2 splits both; every size divides 8.
MODEL = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)

# Which mesh axis each parameter dimension goes to, written out from the rules in sharding.py's docstring
# (embed -> fsdp; vocab, heads, kv heads, mlp -> tensor; the blocks' leading layers axis is never split);
# an axis of size 1 means "not split".
EXPECTED_AXES = {
    "embed.embedding": ("tensor", "fsdp"),
    "lm_head": ("fsdp", "tensor"),
    "final_norm.scale": ("fsdp",),
    "blocks.attn_norm.scale": (None, "fsdp",),
    "blocks.attn.q_kernel": (None, "fsdp", "tensor", None, None),
    "blocks.attn.k_kernel": (None, "fsdp", "tensor", None, None),
    "blocks.attn.v_kernel": (None, "fsdp", "tensor", None),
    "blocks.attn.o_kernel": (None, "tensor", None, "fsdp"),
    "blocks.attn.lambda_q1": (None, None,),
    "blocks.attn.subln_scale": (None, None,),
    "blocks.mlp.gate_kernel": (None, "fsdp", "tensor"),
    "blocks.mlp.up_kernel": (None, "fsdp", "tensor"),
    "blocks.mlp.down_kernel": (None, "tensor", "fsdp"),
}
MESHES = {
    "data=8": ParallelConfig(data=8),
    "fsdp=8": ParallelConfig(data=1, fsdp=8),
    "data=2,fsdp=2,tensor=2": ParallelConfig(data=2, fsdp=2, tensor=2),
}


def _get(tree, dotted: str):
    for key in dotted.split("."):
        tree = tree[int(key) if key.isdigit() else key]
    return tree


def _adam_moments(opt_state):
    (adam,) = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
               if isinstance(x, optax.ScaleByAdamState)]
    return adam.mu, adam.nu


def _batch(rows: int = 8, length: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """[1, rows, length]: two packed documents per row (segment ids 1 and 2, positions restarting)."""
    rng = np.random.default_rng(seed)
    split = length // 2 + 3
    segment_ids = np.where(np.arange(length) < split, 1, 2)[None].repeat(rows, 0)
    positions = np.where(np.arange(length) < split, np.arange(length), np.arange(length) - split)[None].repeat(rows, 0)
    tokens = rng.integers(0, MODEL.vocab_size, (rows, length))
    return {k: v.astype(np.int32)[None] for k, v in {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}.items()}


def _one_step(model_config: ModelConfig, parallel_config: ParallelConfig):
    """One SGD step (the update is the gradient itself, so comparing params compares gradients)."""
    mesh = parallel.make_mesh(parallel_config)
    tx = optax.sgd(0.1)
    training, state = setup_sharded_state(model_config, tx, 0, mesh)
    step = training.jit_train_step(tx, lambda _: 0.1, model_config)
    batch = {k: jax.device_put(v, training.step_batch_sharding) for k, v in _batch().items()}
    new_state, metrics = step(state, batch)
    return mesh, new_state, jax.device_get(metrics)


def _expected_spec(name: str, mesh) -> P:
    return P(*[axis if axis is not None and mesh.shape[axis] > 1 else None for axis in EXPECTED_AXES[name]])


@pytest.fixture(scope="module")
def single_device_step():
    _, state, metrics = _one_step(MODEL, ParallelConfig(data=1))
    return jax.device_get(state), metrics


@pytest.mark.parametrize("mesh_name", [m if m == "data=2,fsdp=2,tensor=2" else pytest.param(m, marks=pytest.mark.slow)
                                       for m in MESHES])
def test_sharded_step_equals_one_device_and_params_follow_the_rules(mesh_name, single_device_step, measured):
    mesh, state, metrics = _one_step(MODEL, MESHES[mesh_name])
    reference_state, reference_metrics = single_device_step
    measured("loss |sharded - one device|", abs(metrics["loss"] - reference_metrics["loss"]), 1e-5)
    np.testing.assert_allclose(metrics["loss"], reference_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], reference_metrics["grad_norm"], rtol=1e-5)
    worst = 0.0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(state["params"]), jax.tree.leaves(reference_state["params"])):
        difference = float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        worst = max(worst, difference)
        assert difference < 1e-6, f"{jax.tree_util.keystr(path)} differs by {difference} after one step on {mesh_name}"
    measured("updated params max |sharded - one device|", worst, 1e-6)

    for name in EXPECTED_AXES:
        array, spec = _get(state["params"], name), _expected_spec(name, mesh)
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (
            f"{name} on {mesh_name}: {array.sharding.spec}, the rules say {spec}")


@pytest.mark.parametrize("mesh_name", [pytest.param("fsdp=8", marks=pytest.mark.slow), "data=2,fsdp=2,tensor=2"])
def test_optimizer_state_is_created_sharded_like_the_params(mesh_name):
    """AdamW moments follow their parameter's sharding, and the state is created under jit straight into
    its shardings: with fsdp=8 each device holds 1/8 of every split tensor."""
    mesh = parallel.make_mesh(MESHES[mesh_name])
    tx, _ = make_optimizer(OptimizerConfig(), 10)
    _, state = setup_sharded_state(MODEL, tx, 0, mesh)
    for tree in _adam_moments(state["opt_state"]):
        for name in EXPECTED_AXES:
            array, spec = _get(tree, name), _expected_spec(name, mesh)
            assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (name, array.sharding.spec)
    if mesh_name == "fsdp=8":
        device = mesh.devices.flat[0]
        on_device = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == device)
        total = sum(x.nbytes for x in jax.tree.leaves(state))
        # lambdas, subln (vectors, [layers, n] when stacked): replicated
        vectors = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim <= 1 or (x.ndim == 2 and x.shape[0] == MODEL.num_layers))
        assert on_device <= total / 8 + vectors, (on_device, total)


@pytest.mark.single_leg  # jax's remat and scan are exercised on the newest leg by the trainer tests
@pytest.mark.slow
def test_remat_and_scan_give_the_same_step():
    """Rematerialization and scanning change memory and compile time, not the numbers (float32)."""
    reference = None
    for remat, scan in (("none", False), ("minimal", False), ("full", True), ("attention", True)):
        _, state, metrics = _one_step(MODEL.replace(remat=remat, scan_layers=scan), ParallelConfig(data=1))
        leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state["params"]))]
        if reference is None:
            reference = (metrics, leaves)
            continue
        np.testing.assert_allclose(metrics["loss"], reference[0]["loss"], rtol=1e-6)
        np.testing.assert_allclose(metrics["grad_norm"], reference[0]["grad_norm"], rtol=1e-5)
        for x, y in zip(leaves, reference[1]):
            np.testing.assert_allclose(x, y, atol=1e-7)


@pytest.mark.slow
def test_scanned_remat_step_on_a_3d_mesh_equals_one_device(single_device_step):
    _, state, metrics = _one_step(MODEL.replace(remat="full", scan_layers=True), MESHES["data=2,fsdp=2,tensor=2"])
    np.testing.assert_allclose(metrics["loss"], single_device_step[1]["loss"], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(single_device_step[0]["params"])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def _run_config(run_dir, *overrides):
    small = [
        "model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.max_seq_len=32", "model.vocab_size=264",
        "data.seq_len=32", "data.builtin_bytes=100000", "data.eval_batches=1", "data.eval_fraction=0.1",
        "data.shuffle_window_tokens=4096",  # the default packs the corpus 10 times over before the first batch
        "train.batch_size=8", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
        "train.progress=lines", "train.tensorboard=false", "optim.warmup_steps=1", "optim.decay_steps=8",
        "checkpoint.async_save=false",
    ]
    return load_run_config(REPO_ROOT / "configs" / "tiny.yaml", small + [f"train.run_dir={run_dir}", *overrides])


def test_bad_meshes_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"needs a multiple of 3 devices, but there are 8"):
        parallel.make_mesh(ParallelConfig(data=3))
    with pytest.raises(ValueError, match=r"needs a multiple of 16 devices, but there are 8"):
        parallel.make_mesh(ParallelConfig(data=2, fsdp=8))
    with pytest.raises(ValueError, match=r"only one mesh axis may be -1.*parallel.data, parallel.fsdp"):
        ParallelConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match=r"parallel.tensor must be a positive integer or -1 \(fill\), got 0"):
        ParallelConfig(tensor=0)
    mesh = parallel.make_mesh(ParallelConfig(data=1, tensor=8))
    with pytest.raises(ValueError, match=r"parallel.tensor \(8\) must divide model.num_heads \(4\).*\[1, 2, 4\]"):
        parallel.check_model_fits_mesh(MODEL, mesh)
    mesh = parallel.make_mesh(ParallelConfig(data=2, tensor=4))
    with pytest.raises(ValueError, match=r"parallel.tensor \(4\) must divide model.num_kv_heads \(2\)"):
        parallel.check_model_fits_mesh(MODEL, mesh)
    with pytest.raises(ValueError, match=r"does not split evenly over 8 batch shards"):
        train(_run_config(tmp_path, "train.batch_size=4", "parallel.data=8"), log=lambda _: None)
    with pytest.raises(ValueError, match=r"length 20 cannot be split over context=8 .* multiple of 2 x context = 16"):
        train(_run_config(tmp_path, "data.seq_len=20", "parallel.data=1", "parallel.context=8"), log=lambda _: None)


def test_a_vocabulary_the_tensor_axis_does_not_divide_stays_whole():
    """A byte vocabulary of 257 over tensor=2 is replicated along the vocab axis (and said so), not an error."""
    config = MODEL.replace(vocab_size=257)
    mesh = parallel.make_mesh(ParallelConfig(data=4, tensor=2))
    abstract = nnx.state(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
    shardings = parallel.param_shardings(abstract, mesh)
    assert shardings["embed"]["embedding"].spec == P(None, None)
    assert shardings["blocks"]["mlp"]["gate_kernel"].spec == P(None, None, "tensor")  # layers never split
    assert any(note.startswith("embed.embedding (vocab = 257") for note in parallel.unsharded_dims(abstract, mesh))


@pytest.mark.parametrize("op", ["diff", pytest.param("diff_v2", marks=pytest.mark.slow), "standard"])
def test_pallas_kernels_run_per_device_under_a_mesh(op, measured):
    """Pallas calls cannot be partitioned by XLA: on a mesh they run inside shard_map over batch and heads
    (interpret mode here) and give the unsharded XLA reference's values and gradients. diff_v2: V2's call,
    shared keys (G = 1), dv = d and a per-token lambda [B, T, H] split like the heads."""
    from diffjax import ops

    rng = np.random.default_rng(0)
    B, T, H, K, d = 4, 64, 4, 2, 16
    G, dv = {"diff": (2, 2 * d), "diff_v2": (1, d), "standard": (None, d)}[op]
    q = rng.normal(size=(B, T, H, d) if G is None else (B, T, H, 2, d)).astype(np.float32)
    k = rng.normal(size=(B, T, K, d) if G is None else (B, T, K, G, d)).astype(np.float32)
    v = rng.normal(size=(B, T, K, dv)).astype(np.float32)
    segment_ids = np.where(np.arange(T) < 40, 1, 2)[None].repeat(B, 0).astype(np.int32)
    lam = rng.uniform(size=(B, T, H)).astype(np.float32) if op == "diff_v2" else np.float32(0.3)

    def loss(impl, q, k, v, lam):
        if G is not None:
            o = ops.diff_attention(q, k, v, lam, segment_ids=segment_ids, impl=impl, block_sizes=(32, 32))
        else:
            o = ops.dot_product_attention(q, k, v, segment_ids=segment_ids, impl=impl, block_sizes=(32, 32)) * lam
        return jnp.sum(o * np.cos(np.arange(o.size).reshape(o.shape)))

    mesh = parallel.make_mesh(MESHES["data=2,fsdp=2,tensor=2"])

    def sharded(q, k, v, lam):
        with parallel.activation_sharding(mesh):
            return jax.value_and_grad(lambda *a: loss("pallas_tpu", *a), argnums=(0, 1, 2, 3))(q, k, v, lam)

    lowered = jax.jit(sharded).lower(q, k, v, lam)
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    value, grads = lowered.compile()(q, k, v, lam)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3)))(q, k, v, lam)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-4)
    worst = max(float(np.max(np.abs(np.asarray(g) - np.asarray(r)))) for g, r in zip(grads, ref_grads))
    measured(f"{op} pallas under mesh: max |grad - xla|", worst, 1e-4)
    assert worst < 1e-4
