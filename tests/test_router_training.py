"""Router training of the mixture of experts: the auxiliary-loss-free selection-bias update (torchtitan's rule,
restated here in NumPy), the per-layer load and entropy metrics, exact resume with the update, and the guards that
name the layer whose router collapsed or went non-finite."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diffjax.config import ModelConfig
from diffjax.model.facets import model_facets
from diffjax.model.mlp.moe import route
from diffjax.model.mlp.router import balanced_expert_bias, router_metrics, routing_stats
from diffjax.train import Hook, train
from diffjax.train.guard import DivergedError
from diffjax.train.mesh import ParallelConfig, make_mesh
from diffjax.train.state_checkpoints import Checkpointer
from diffjax.train.config import CheckpointConfig
from diffjax.model.layer_outputs import Emitted
from diffjax.train.step import setup_sharded_state

E, K = 4, 2
MOE_OPTIONS = dict(num_experts=E, top_k=K, expert_inner=16, expert_bias=True, load_balance_coeff=0.01,
                   dense_first_layers=1)  # layer 0 dense, layers 1 and 2 MoE (one stack: "blocks_from_1")
MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=2, mlp_dim=48, max_seq_len=32, mlp="moe",
                    mlp_options=MOE_OPTIONS)


def numpy_bias_update(bias, tokens, coeff):
    """torchtitan's _update_expert_bias restated expert by expert: +coeff below the mean load, -coeff above, 0 at
    it; then the step's mean is taken off every expert."""
    bias, tokens = np.asarray(bias, np.float64), np.asarray(tokens, np.float64)
    out = bias.copy()
    for layer in range(bias.shape[0]):
        mean = tokens[layer].sum() / tokens.shape[1]
        step = [coeff if t < mean else -coeff if t > mean else 0.0 for t in tokens[layer]]
        out[layer] += np.array(step) - sum(step) / len(step)
    return out


def _after_update(model, params, tokens):
    """The MoE kind's update after the optimizer's (its facet's), given the step's router token counts."""
    [facet] = [facet for facet in model_facets(model) if "router" in facet.outputs]
    return facet.after_update(params, {"router": Emitted({"tokens": tokens}, "sum", facet.layers)})


def test_bias_update_is_torchtitans_rule_layer_by_layer():
    """Known counts (three experts over the mean, one under: the step's mean is not 0, so the centring shows; one
    layer exactly balanced) through the MoE's update after each step, which must also match each stack row to its
    layer."""
    tokens = np.array([[40, 35, 30, 5], [20, 20, 20, 20]], np.int32)  # MoE layers 1 and 2
    bias = np.array([[0.1, -0.2, 0.0, 0.05], [0.3, 0.0, -0.1, 0.0]], np.float32)
    params = {"blocks": {"mlp": {"kernel": np.zeros(3)}}, "blocks_from_1": {"mlp": {"expert_bias": jnp.asarray(bias)}}}
    updated = _after_update(MODEL, params, jnp.asarray(tokens))
    expected = numpy_bias_update(bias, tokens, 0.01)
    np.testing.assert_allclose(np.asarray(updated["blocks_from_1"]["mlp"]["expert_bias"]), expected, rtol=0, atol=1e-7)
    assert updated["blocks"] is params["blocks"]
    np.testing.assert_allclose(np.asarray(balanced_expert_bias(jnp.asarray(bias), jnp.asarray(tokens), 0.5)),
                               numpy_bias_update(bias, tokens, 0.5), atol=1e-6)
    no_coeff = dataclasses.replace(MODEL, mlp_options=dataclasses.replace(MODEL.mlp_options, load_balance_coeff=None))
    assert _after_update(no_coeff, params, jnp.asarray(tokens)) is params


@pytest.mark.parametrize("options, message", [
    (dict(load_balance_coeff=-0.1), "mlp_options.load_balance_coeff must be None (off) or > 0, got -0.1"),
    (dict(load_balance_coeff=0.01, expert_bias=False),
     "mlp_options.load_balance_coeff (0.01) needs expert_bias: true (the selection bias it moves)"),
    (dict(collapse_steps=0), "mlp_options.collapse_steps must be a positive integer, got 0"),
])
def test_router_training_options_are_checked(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(MODEL, mlp_options={**MOE_OPTIONS, **options})


def _router_step(logits_NE):
    """metrics["router"] of a step in which both MoE layers of MODEL routed these logits (no bias), as the step
    builds it from the summed routing_stats."""
    return jax.device_get(_jit_router_step(jnp.asarray(logits_NE, jnp.float32)))


@jax.jit
def _jit_router_step(logits_NE):
    o = MODEL.mlp_options
    experts_NK, _ = route(logits_NE, None, K, o.score_func, o.route_norm, o.route_scale)
    stats = routing_stats(logits_NE, None, experts_NK, E, o.score_func)
    return router_metrics(jax.tree.map(lambda a: jnp.stack([a, a]), stats), K)


def test_collapse_guard_stops_a_decided_collapse_not_a_tie_break():
    """Every token to experts 0 and 1 in both MoE layers, three ways: equal scores (zero logits: an untrained router;
    top_k's tie-break picks the lowest indices) never stop the run; a router preferring experts 0 and 1 by a margin
    stops it after collapse_steps (10) steps, naming the first layer and the margin (the softmax scores' 2nd minus
    3rd largest, restated in NumPy); the same preference alternating with one for experts 2 and 3 does not (other
    experts each step: no stretch)."""
    rng = np.random.default_rng(0)
    tied = _router_step(np.zeros((64, E)))
    logits = np.array([2.0, 1.5, 0.0, 0.0]) + rng.normal(0, 0.1, (64, E))
    decided, other = _router_step(logits), _router_step(logits[:, ::-1])
    for router in (tied, decided):
        np.testing.assert_array_equal(router["load"], [[2, 2, 0, 0]] * 2)
    np.testing.assert_array_equal(other["load"], [[0, 0, 2, 2]] * 2)
    np.testing.assert_array_equal(tied["ties"], [1, 1])
    np.testing.assert_array_equal(decided["ties"], [0, 0])
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    margin = np.mean(np.sort(probs, -1)[:, -2] - np.sort(probs, -1)[:, -3])
    np.testing.assert_allclose(decided["margin"], [margin] * 2, rtol=1e-5)

    def stops(routers):
        [facet] = [facet for facet in model_facets(MODEL) if "router" in facet.outputs]
        return [facet.stop(step, {"router": router}) for step, router in enumerate(routers, 1)]

    assert stops([tied] * 30) == [None] * 30
    assert stops([decided, other] * 15) == [None] * 30
    *before, message = stops([decided] * 10)
    assert before == [None] * 9
    assert message.startswith("the router of layer 1 collapsed: in steps 1-10 every token went to experts [0, 1] (the "
                              f"other 2 got none), chosen by a mean score margin of {margin:.3g} over the best idle "
                              "expert (a decided choice, not a tie)."), message


def _batch(rows: int = 8, length: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, MODEL.vocab_size, (1, rows, length)).astype(np.int32),
            "segment_ids": np.ones((1, rows, length), np.int32),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (1, rows, length)).copy()}


def _skewed_steps(parallel: ParallelConfig, steps: int):
    """`steps` train steps with a zero learning rate (only the bias moves) from a bias that sends every token to
    experts 0 and 1 in both MoE layers; (bias before each step [steps + 1, L, E], router metrics per step)."""
    mesh = make_mesh(parallel)
    tx = optax.sgd(0.0)
    training, state = setup_sharded_state(MODEL, tx, 0, mesh)
    mlp = state["params"]["blocks_from_1"]["mlp"]
    mlp["expert_bias"] = jax.device_put(jnp.asarray([[0.2, 0.2, 0, 0]] * 2, jnp.float32), mlp["expert_bias"].sharding)
    step = training.jit_train_step(tx, lambda _: 0.0, MODEL)
    batch = {k: jax.device_put(v, training.step_batch_sharding) for k, v in _batch().items()}
    biases, routers = [np.asarray(mlp["expert_bias"])], []
    for _ in range(steps):
        state, metrics = step(state, batch)
        biases.append(np.asarray(state["params"]["blocks_from_1"]["mlp"]["expert_bias"]))
        routers.append(jax.device_get(metrics["router"]))
    return np.stack(biases), routers


@pytest.mark.slow
def test_bias_moves_toward_balance_and_counts_cover_the_global_batch():
    """Each step's bias change is the NumPy rule applied to that step's loads (the metrics' load is each expert's
    tokens over the mean, so it stands for the counts); a collapsed start (loads 2, 2, 0, 0) is balanced out within
    a few steps while the bias's mean stays put; on 8 devices (one batch row each) the counts are the global
    batch's, so the bias moves exactly as on one device."""
    biases, routers = _skewed_steps(ParallelConfig(data=1), 16)
    np.testing.assert_array_equal(routers[0]["load"], [[2, 2, 0, 0]] * 2)
    for before, after, router in zip(biases, biases[1:], routers):
        np.testing.assert_allclose(after, numpy_bias_update(before, router["load"], 0.01), atol=1e-6)
    np.testing.assert_allclose(biases.mean(-1), biases[0].mean(-1)[None].repeat(len(biases), 0), atol=1e-6)
    cv = [float(np.max(np.std(r["load"], -1) / np.mean(r["load"], -1))) for r in routers]
    assert cv[0] == 1.0 and cv[-1] < 0.5, cv
    assert all(0 < e <= np.log(E) + 1e-6 for r in routers for e in r["entropy"]), routers[-1]

    sharded_biases, sharded_routers = _skewed_steps(ParallelConfig(data=8), 3)
    np.testing.assert_array_equal(sharded_biases, biases[:4])
    for ours, theirs in zip(sharded_routers, routers):
        np.testing.assert_array_equal(ours["load"], theirs["load"])


# ---- through the trainer

MOE_RUN = ["model.mlp=moe", "model.mlp_dim=48", "model.num_layers=3", f"model.mlp_options.num_experts={E}",
           f"model.mlp_options.top_k={K}", "model.mlp_options.expert_inner=16", "model.mlp_options.expert_bias=true",
           "model.mlp_options.dense_first_layers=1", "train.sample_tokens=0"]


def _moe_config(run_dir, *overrides):
    from test_trainer import _config

    return _config(run_dir, *MOE_RUN, *overrides)


@pytest.mark.slow
def test_moe_run_logs_router_metrics_per_layer_and_resumes_bitwise(tmp_path):
    """metrics.jsonl holds each MoE layer's load max / min / CV and router entropy (none for the dense layer 0),
    TensorBoard the load histograms; 2 + 2 resumed steps equal 4 straight ones bit for bit, bias included (which
    the update has moved off zero)."""
    coeff = ["model.mlp_options.load_balance_coeff=0.001"]
    straight = train(_moe_config(tmp_path / "straight", "train.steps=4", *coeff), log=lambda _: None)
    train(_moe_config(tmp_path / "resumed", "train.steps=2", *coeff), log=lambda _: None)
    resumed = train(_moe_config(tmp_path / "resumed", "train.steps=4", *coeff), log=lambda _: None)
    assert resumed.losses == {step: straight.losses[step] for step in (3, 4)}
    a = Checkpointer(tmp_path / "straight", CheckpointConfig()).read(4)["state"]
    b = Checkpointer(tmp_path / "resumed", CheckpointConfig()).read(4)["state"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bias = np.asarray(a["params"]["blocks_from_1"]["mlp"]["expert_bias"])
    assert bias.shape == (2, E) and np.all(np.abs(bias) > 0) and np.all(np.abs(bias) <= 4 * 0.001 * 1.5 + 1e-7), bias

    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4]
    for record in train_records:
        assert not any(key.startswith("router/layer_0/") for key in record)
        for layer in (1, 2):
            load_max, load_min = record[f"router/layer_{layer}/load_max"], record[f"router/layer_{layer}/load_min"]
            assert 1 <= load_max <= E / K and 0 <= load_min <= 1 and record[f"router/layer_{layer}/load_cv"] >= 0
            assert 0 < record[f"router/layer_{layer}/entropy"] <= np.log(E) + 1e-6
    events = list((tmp_path / "straight" / "tensorboard").rglob("events.out.tfevents*"))
    assert events and any(b"train/router/layer_2/load" in path.read_bytes() for path in events)


class _SetParams(Hook):
    """Before the first step: the MoE stack's `name` leaf [layers, ...] set, in row `row`, to `value`."""

    def __init__(self, name: str, row: int, value):
        self.name, self.row, self.value = name, row, value

    def on_start(self, run):
        mlp = run.state["params"]["blocks_from_1"]["mlp"]
        old = mlp[self.name]
        mlp[self.name] = jax.device_put(old.at[self.row].set(self.value), old.sharding)


@pytest.mark.slow
def test_guard_names_the_layer_whose_router_collapsed(tmp_path):
    """Layer 2's bias sends every token to experts 0 and 1 (layer 1 routes normally): with collapse_steps=2 the run
    stops at step 2 on one line naming layer 2, its experts and their margin (the bias's 1, give or take the
    scores')."""
    config = _moe_config(tmp_path / "run", "train.steps=4", "model.mlp_options.collapse_steps=2")
    with pytest.raises(DivergedError) as error:
        train(config, log=lambda _: None, hooks=[_SetParams("expert_bias", 1, jnp.asarray([1.0, 1.0, 0.0, 0.0]))])
    message = str(error.value)
    assert message.startswith("the router of layer 2 collapsed: in steps 1-2 every token went to experts [0, 1] "
                              "(the other 2 got none), chosen by a mean score margin of "), message
    margin = float(re.search(r"margin of ([\d.e-]+) over the best idle expert \(a decided choice", message)[1])
    assert abs(margin - 1) < 0.05 and "\n" not in message and "layer 1" not in message, message


@pytest.mark.slow
def test_nonfinite_stop_names_the_layer_whose_router_logits_were_not_finite(tmp_path):
    """A NaN router kernel in layer 2: the non-finite stop says which layer's router logits were not finite."""
    config = _moe_config(tmp_path / "run", "train.steps=2")
    with pytest.raises(DivergedError) as error:
        train(config, log=lambda _: None, hooks=[_SetParams("router_kernel", 1, jnp.nan)])
    message = str(error.value)
    tokens = config.train.batch_size * config.data.seq_len
    assert f"; the router logits of layer 2 were not finite for {tokens} tokens)" in message, message
    assert "layer 1" not in message and message.startswith("training diverged at step 1"), message
