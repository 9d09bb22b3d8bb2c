"""The mHC residual form (residual="mhc", diffjax.model.residual.mhc) as diffjax uses it: its options, identity
init, parameter and FLOP counts, KV-cache decoding, a sharded step, weight decay, train.py (trains, resumes bit for bit,
generates) and the HF export's refusal. Against the PyTorch reference: tests/test_mhc_reference.py."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError
from diffjax.model import TransformerLM
from diffjax.model.residual import mhc
from diffjax.residual_kinds import MHCOptions
from diffjax.train.metrics import matmul_params

E, SINKHORN_ITERS = 4, 20


def _options(**fields) -> dict:
    return {"streams": E, "sinkhorn_iters": SINKHORN_ITERS, **fields}


def _tiny_config(d_model=32, **options) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=d_model, num_layers=2, num_heads=2, max_seq_len=64, attention_impl="xla",
                       residual="mhc", residual_options=_options(**options))


# ------------------------------------------------------------------------------ options, counts, init, decode


def test_options_are_motif3s_by_default_and_bad_ones_are_named():
    config = ModelConfig(residual="mhc")
    assert config.residual_options == MHCOptions(streams=4, sinkhorn_iters=20, h_post_alpha=0.0)
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"residual_options.streams must be a positive integer, got 0$"):
        ModelConfig(residual="mhc", residual_options={"streams": 0})
    with pytest.raises(ValueError, match=r"residual_options.sinkhorn_iters must be a positive integer, got -2$"):
        ModelConfig(residual="mhc", residual_options={"sinkhorn_iters": -2})
    with pytest.raises(ValueError, match=r"residual_options.norm_eps must be positive, got 0.0$"):
        ModelConfig(residual="mhc", residual_options={"norm_eps": 0})


def test_identity_init_starts_from_the_identity_mix():
    form = mhc.MHCResidual(_tiny_config(identity_init=True), rngs=nnx.Rngs(0))
    stream = jax.random.normal(jax.random.key(0), (2, 3, E, 32))
    h_pre, h_post, h_res = nnx.jit(mhc.MHCResidual.gates)(form, stream)
    np.testing.assert_allclose(np.asarray(h_pre), 1 / E, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(h_post), 0.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(h_res), np.broadcast_to(np.eye(E), h_res.shape), atol=1e-3)
    _, _, h_res = nnx.jit(mhc.MHCResidual.gates)(mhc.MHCResidual(_tiny_config(), rngs=nnx.Rngs(0)), stream)
    assert float(jnp.abs(h_res - jnp.eye(E)).max()) > 0.5  # the default init mixes


@pytest.mark.slow
def test_counts_step_and_kv_cache_decode():
    config = _tiny_config()
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    assert model.num_params() == config.param_count()
    kernels = sum(g[...].size for path, g in nnx.to_flat_state(nnx.state(model.blocks, nnx.Param))
                  if path[0].endswith("_residual") and path[-1].endswith("kernel"))
    assert matmul_params(config) - matmul_params(config.replace(residual="plain")) == kernels
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 1, 97)
    grads = nnx.grad(lambda m: diffjax.next_token_loss(m(tokens), tokens))(model)
    for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param)):  # every parameter takes part
        assert np.abs(np.asarray(g[...])).max() > 0, path
    generated = np.asarray(diffjax.generate(model, np.asarray(tokens[:1, :6]), 4))[0]
    full = np.asarray(jnp.argmax(model(jnp.asarray(np.concatenate([tokens[0, :6], generated])[None]))[0], axis=-1))
    assert generated.tolist() == full[5:9].tolist()


def test_the_hf_export_refuses_it(tmp_path):
    model = TransformerLM(_tiny_config(), rngs=nnx.Rngs(0))
    refusal = r"^cannot export to Hugging Face \(DiffLlama\): residual='mhc': DiffLlama holds residual 'plain' only$"
    with pytest.raises(ConversionError, match=refusal):
        diffjax.save_hf(model, tmp_path / "hf")


# ------------------------------------------------------------------------------ train.py


def _train(run_dir, steps: int) -> str:
    from test_trainer import REPO_ROOT, SMALL

    command = [sys.executable, "train.py", *SMALL, "model.residual=mhc", "model.residual_options.streams=3",
               "model.num_layers=1", f"train.steps={steps}", f"train.run_dir={run_dir}", "checkpoint.every=100"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_train_py_trains_resumes_bitwise_and_generates(tmp_path):
    from diffjax.checkpoint import load_model
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer

    def losses(out):
        return dict(re.findall(r"^step\s+(\d+)/\d+ \| loss ([\d.]+) \|", out, flags=re.M))

    straight = losses(_train(tmp_path / "straight", 4))
    first = losses(_train(tmp_path / "resumed", 2))
    second = _train(tmp_path / "resumed", 4)
    assert "resumed from" in second and {**first, **losses(second)} == straight and len(straight) == 4
    states = [Checkpointer(tmp_path / run, CheckpointConfig()).read(4)["state"] for run in ("straight", "resumed")]
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    model = load_model(tmp_path / "resumed")
    assert model.config.residual_options.streams == 3 and model.blocks.attn_residual.pre_kernel.shape == (1, 96, 3)
    prompt = np.asarray([[104, 101, 108, 108, 111]])
    generated = np.asarray(diffjax.generate(model, prompt, 5))[0]
    full = np.asarray(jnp.argmax(model(jnp.asarray(np.concatenate([prompt[0], generated])[None]))[0], axis=-1))
    assert generated.tolist() == full[4:9].tolist()


@pytest.mark.slow
def test_a_sharded_step_equals_one_device_and_the_streams_params_follow_the_rules():
    """data=2, fsdp=2, tensor=2 (test_parallel's step): the same update as one device; the flattened streams' axis
    of the projections and the norm goes to fsdp like every "embed" axis, the rest is replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from test_parallel import MESHES, MODEL, _one_step

    from diffjax.train.mesh import ParallelConfig

    config = MODEL.replace(residual="mhc", residual_options={"streams": 2})
    mesh, sharded, metrics = _one_step(config, MESHES["data=2,fsdp=2,tensor=2"])
    _, single, single_metrics = _one_step(config, ParallelConfig(data=1))
    np.testing.assert_allclose(metrics["loss"], single_metrics["loss"], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(sharded["params"]), jax.tree.leaves(single["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    form = sharded["params"]["blocks"]["attn_residual"]
    for array, spec in ((form["res_kernel"], P(None, "fsdp", None)), (form["norm"]["scale"], P(None, "fsdp")),
                        (form["res_bias"], P()), (form["pre_alpha"], P())):
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), array.sharding.spec


def test_weight_decay_spares_its_gates_biases_scales_and_norm():
    from diffjax.train.optimizer import weight_decay_mask

    params = nnx.to_pure_dict(nnx.state(TransformerLM(_tiny_config(), rngs=nnx.Rngs(0)), nnx.Param))
    mask = {".".join(str(key.key) for key in path): decayed
            for path, decayed in jax.tree_util.tree_flatten_with_path(weight_decay_mask(params))[0]}
    spared = {name for name, decayed in mask.items() if not decayed and "_residual" in name}
    assert spared == {f"blocks.{form}_residual.{name}" for form in ("attn", "mlp") for name in (
        "norm.scale", "pre_bias", "post_bias", "res_bias", "pre_alpha", "post_alpha", "res_alpha")}
