"""The multi-token-prediction block (ModelConfig.mtp_depths) whatever the model around it: its layer's fields, each
combination of them training or refused in one line."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model import TransformerLM
from diffjax.train.config import load_run_config

TINY = dict(vocab_size=64, d_model=16, num_layers=1, num_heads=1, max_seq_len=16)


def _one_step(config: ModelConfig) -> dict:
    """The metrics of one train step of a fresh model (2 micro-batches of 1 x 12 tokens, 2 documents a row)."""
    from diffjax.train.step import init_state, make_train_step

    model = TransformerLM(config, rngs=nnx.Rngs(0))
    tx = optax.adam(1e-2)
    step = jax.jit(make_train_step(nnx.graphdef(model), tx, optax.constant_schedule(1e-2), config))
    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 1, 12))
    batch = {"tokens": tokens, "positions": np.broadcast_to(np.arange(12), tokens.shape),
             "segment_ids": np.broadcast_to(np.where(np.arange(12) < 7, 1, 2), tokens.shape)}
    return step(init_state(model, tx, jax.random.key(0)), batch)[1]


def test_an_mhc_model_s_mtp_layer_is_plain_unless_told():
    """Issue 62: MTP on an mHC model (the shipped motif3/small with model.mtp_depths=1) gets a plain residual in its
    MTP layer, as Motif 3's and DeepSeek-V3's MTP blocks have; mtp_layer.residual=mhc gives it the model's mHC."""
    shipped = load_run_config("motif3/small", ["model.mtp_depths=1"]).model
    assert (shipped.residual, shipped.mtp_layer_config().residual) == ("mhc", "plain")
    assert shipped.mtp_layer_config().residual_options is None
    asked = shipped.replace(mtp_layer={"residual": "mhc"}).mtp_layer_config()
    assert (asked.residual, asked.residual_options) == ("mhc", shipped.residual_options)


@pytest.mark.slow
def test_an_mtp_layer_plain_or_with_mhc_streams_trains_on_an_mhc_model():
    """Both MTP layers of an mHC model train: the plain one, and one with mHC streams of its own (expanded from the
    depth's input, collapsed before its final norm; on main its first step died in mhc.gates)."""
    config = ModelConfig(**TINY, residual="mhc", residual_options={"streams": 2, "sinkhorn_iters": 1}, mtp_depths=1)
    for model in (config, config.replace(mtp_layer={"residual": "mhc"})):
        metrics = _one_step(model)
        assert bool(metrics["ok"]) and 3.0 < float(metrics["mtp_loss/depth_1"]) < 6.0  # ~ln 64 at init


# ---- DeepSeek-V3's form: an MoE MTP depth, defined here as any user would, trained with no trainer code of its own

DEEPSEEK_V3_LIKE = [
    "model.attention=standard", "model.num_layers=2", "model.mlp=moe", "model.mlp_options.num_experts=4",
    "model.mlp_options.top_k=2", "model.mlp_options.expert_inner=16", "model.mlp_options.score_func=sigmoid",
    "model.mlp_options.expert_bias=true", "model.mlp_options.load_balance_coeff=0.01",
    "model.mlp_options.dense_first_layers=1",  # layer 0 dense, layer 1 an MoE layer
    "model.mtp_depths=1", "model.mtp_layer.mlp=moe",  # its MTP depth's layer: the model's mixture of experts
    "train.sample_tokens=0", "parallel.data=2", "train.micro_batch_per_device=1",
]


def test_an_moe_mtp_layer_is_the_model_s_mixture_of_experts_and_its_facet_sees_it():
    """mtp_layer.mlp=moe takes the model's MoE options (one router facet serves the MoE layers and the MTP depth's
    layer, numbered on from the model's: layer 2); other options for it are refused in one line."""
    from diffjax.model.facets import model_facets

    config = load_run_config("tiny", DEEPSEEK_V3_LIKE).model
    assert config.mtp_layer_config().mlp_options == config.mlp_options
    [router] = [facet for facet in model_facets(config) if "router" in facet.outputs]
    assert router.layers == (1, 2)


@pytest.mark.slow
def test_a_deepseek_v3_like_toy_trains_moves_its_mtp_router_bias_logs_it_and_resumes_bitwise(tmp_path):
    """4 steps of the toy: the MTP depth's expert bias moves after each step (only the router facet moves it: no
    gradient reaches it), its router is in metrics.jsonl as layer 2 beside layer 1's, with the depth's loss; and 2 +
    2 resumed steps equal 4 straight ones bit for bit."""
    from diffjax.train import train
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer
    from test_trainer import _config

    straight = train(_config(tmp_path / "straight", *DEEPSEEK_V3_LIKE, "train.steps=4"), log=lambda _: None)
    train(_config(tmp_path / "resumed", *DEEPSEEK_V3_LIKE, "train.steps=2"), log=lambda _: None)
    resumed = train(_config(tmp_path / "resumed", *DEEPSEEK_V3_LIKE, "train.steps=4"), log=lambda _: None)
    assert resumed.losses == {step: straight.losses[step] for step in (3, 4)}
    a, b = (Checkpointer(tmp_path / name, CheckpointConfig()).read(4)["state"] for name in ("straight", "resumed"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bias_E = np.asarray(a["params"]["blocks_mtp"]["mlp"]["expert_bias"][0], np.float64)
    assert np.abs(bias_E).max() > 0 and abs(bias_E.mean()) < 1e-6  # moved from 0, centred (torchtitan's rule)
    assert np.abs(bias_E).max() <= 4 * 2 * 0.01 + 1e-6  # at most 2 coeff a step

    records = [r for r in map(json.loads, (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert all(f"router/layer_{layer}/load_max" in record for layer in (1, 2)), sorted(record)
        assert "router/layer_0/load_max" not in record and np.isfinite(record["mtp_loss/depth_1"])


# ---- every combination of the MTP layer's fields trains or is refused in one line

MOTIF3_LIKE = dict(  # every kind with a training side or a stream of its own, windowed and global layers
    vocab_size=32, d_model=16, num_layers=2, num_heads=2, max_seq_len=16, attention="diff", mlp="moe",
    mlp_options={"num_experts": 4, "top_k": 2, "expert_inner": 8, "dense_first_layers": 1, "expert_bias": True,
                 "load_balance_coeff": 0.01}, residual="mhc", residual_options={"streams": 2, "sinkhorn_iters": 1},
    attention_window=4, global_layers=[0], mtp_depths=2)


def _traced_step_metrics(config: ModelConfig) -> dict:
    """The metrics of a train step of `config` traced with abstract values (shapes and types, nothing computed)."""
    from diffjax.train.step import init_state, make_train_step

    tx = optax.adam(1e-3)
    state = jax.eval_shape(lambda: init_state(TransformerLM(config, rngs=nnx.Rngs(0)), tx, jax.random.key(0)))
    batch = {key: jax.ShapeDtypeStruct((2, 1, 8), np.int32) for key in ("tokens", "positions", "segment_ids")}
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    return jax.eval_shape(make_train_step(graphdef, tx, lambda step: 1e-3, config), state, batch)[1]


@pytest.mark.slow
@pytest.mark.parametrize("mlp, residual, window", [  # every pair of two fields' values once
    (None, None, None), ("gated", "mhc", 2), ("moe", None, 2), ("moe", "mhc", None), (None, "mhc", 2),
    ("gated", None, None)])
def test_every_mtp_layer_of_a_motif3_like_model_traces_a_train_step(mlp, residual, window):
    """The MTP layer's MLP as the model's first layer's (None: the dense one), another kind, or the model's MoE (its
    router then reports the depths' layers 2 and 3 beside layer 1), plain or with mHC, with the model's window or one
    of its own: the train step traces, with every depth's loss and lambda for every layer."""
    fields = {name: value for name, value in dict(mlp=mlp, residual=residual, attention_window=window).items() if value}
    metrics = _traced_step_metrics(ModelConfig(**MOTIF3_LIKE, mtp_layer=fields))
    assert {"mtp_loss/depth_1", "mtp_loss/depth_2"} <= set(metrics) and metrics["lambda"].shape == (2 + 2,)
    assert metrics["router"]["load"].shape == ((3, 4) if mlp == "moe" else (1, 4))


@pytest.mark.parametrize("fields,message", [
    ({"mlp": "moe", "mlp_options": {"num_experts": 2}}, r"mtp_layer: mlp 'moe' with mlp_options other than the "
     r"model's moe layers' \(top 2 of 4 experts, 1 dense first\): one training side serves every layer of a kind; "
     r"leave mtp_layer.mlp_options unset \(the model's\)$"),
    ({"mlp": "polynorm", "mlp_options": {"num_experts": 2}}, r"^invalid ModelConfig: mtp_layer: unknown config key "
     r"mlp_options.num_experts; valid keys under mlp_options: hidden_clamp, output_scale, sigmoid_weight$"),
    ({"residual": "hyper"},
     r"^invalid ModelConfig: mtp_layer: residual must be one of \('plain', 'mhc'\), got 'hyper'$"),
    ({"attention_window": 0}, r"^invalid ModelConfig: mtp_layer: attention_window must be None"),
])
def test_an_mtp_layer_that_cannot_train_is_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ModelConfig(**MOTIF3_LIKE, mtp_layer=fields)
    assert "\n" not in str(error.value)
