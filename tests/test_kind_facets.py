"""A kind's training side comes from its row (diffjax.kinds.Training and its facet, diffjax.model.facets): a toy
MLP kind defined here, with a selection-like shift that no gradient reaches, emits its own statistic on the layer
output channel, moves its shift after each step, logs its metric, keeps its shift out of weight decay and names its
LoRA targets, all with no file of the trainer knowing it; and a dense model's train step is the program it was
before facets (no statistic, no update)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from diffjax import kinds, lora, mlp_kinds
from diffjax.config import ModelConfig
from diffjax.model import MLPModule, TransformerLM, layer_outputs
from diffjax.model.facets import Facet
from diffjax.model.layers import normal_param

STATISTIC = "toy_firing"


@dataclasses.dataclass(frozen=True)
class ShiftOptions(kinds.Options):
    width: int = 16  # hidden units
    init_shift: float = 100.0  # so large that every unit fires for every token: the statistic is known exactly
    step: float = 0.25  # the shift of a unit firing for every token drops by this each step (exact in float32)


class ShiftedReluMLP(MLPModule):
    """out(relu(x in + shift)): the shift only selects which units fire (no gradient reaches it, as an MoE's
    expert_bias); each call emits, summed over its tokens, how often each unit fired and how many tokens it saw."""

    def __init__(self, config, depth=None, *, rngs):
        D, F, std, pdt = config.d_model, config.mlp_options.width, config.init_std, config.param_dtype
        self.in_kernel = normal_param(rngs, (D, F), std, pdt, ("embed", "mlp"))
        self.out_kernel = normal_param(rngs, (F, D), std, pdt, ("mlp", "embed"))
        self.shift = nnx.Param(jnp.full((F,), config.mlp_options.init_shift, pdt), logical_axes=("mlp",))

    def __call__(self, x_BTD):
        h_BTF = x_BTD @ self.in_kernel[...].astype(x_BTD.dtype) + jax.lax.stop_gradient(self.shift[...]).astype(x_BTD.dtype)
        layer_outputs.emit(STATISTIC, lambda: {"fired": jnp.sum(h_BTF > 0, axis=(0, 1), dtype=jnp.int32),
                                               "tokens": jnp.int32(h_BTF.shape[0] * h_BTF.shape[1])}, "sum")
        return jax.nn.relu(h_BTF) @ self.out_kernel[...].astype(x_BTD.dtype)


class ShiftTraining(Facet):
    """After each step every unit's shift drops by step x the fraction of the step's tokens it fired for; metrics
    "toy" {"fraction": [L, F], "tokens": [L]}; metrics.jsonl toy/layer_d/{fraction_max, tokens}."""

    outputs = (STATISTIC,)

    def after_update(self, params, outputs):
        counts = outputs[STATISTIC].value
        fraction_LF = counts["fired"] / counts["tokens"][:, None]
        mlp = params["blocks"]["mlp"]
        shift = (mlp["shift"] - self.config.mlp_options.step * fraction_LF).astype(mlp["shift"].dtype)
        return {**params, "blocks": {**params["blocks"], "mlp": {**mlp, "shift": shift}}}

    def metrics(self, outputs, model):
        counts = outputs[STATISTIC].value
        return {"toy": {"fraction": counts["fired"] / counts["tokens"][:, None], "tokens": counts["tokens"]}}

    def values(self, metrics):
        return {key: value for layer in self.layers for key, value in (
            (f"toy/layer_{layer}/fraction_max", float(np.max(metrics["toy"]["fraction"][layer]))),
            (f"toy/layer_{layer}/tokens", float(metrics["toy"]["tokens"][layer])))}


SHIFTED = mlp_kinds.MLPKind(
    name="toy_shifted_relu", label="shifted ReLU toy", module=ShiftedReluMLP, options=ShiftOptions,
    params=lambda c: 2 * c.d_model * c.mlp_options.width + c.mlp_options.width,
    matmul_params=lambda c: 2 * c.d_model * c.mlp_options.width,
    training=kinds.Training(no_decay=(r"mlp\.shift",), facet=ShiftTraining,
                            lora_targets=(kinds.LoraTarget("toy_in", ("in_kernel",)),)),
)


@pytest.fixture
def toy_kind():
    mlp_kinds.register(SHIFTED)
    yield
    mlp_kinds.unregister(SHIFTED.name)


TOY = ["model.mlp=toy_shifted_relu", "model.num_layers=2", "train.sample_tokens=0", "parallel.data=2",
       "train.micro_batch_per_device=1"]  # batch 4 = 2 devices x 2 micro-batches of 1 sequence


@pytest.mark.slow
@pytest.mark.both_legs
def test_a_toy_kind_s_facet_collects_updates_logs_and_resumes_bitwise(toy_kind, tmp_path):
    """The statistic is summed over the step's micro-batches and devices (tokens = the global batch's), the shift
    moves by exactly step each step (every unit fires; no gradient, no weight decay: only the facet moves it), the
    metric is in metrics.jsonl for every layer and step, and 2 + 2 resumed steps equal 4 straight ones bit for bit."""
    from diffjax.train import train
    from diffjax.train.state_checkpoints import Checkpointer
    from diffjax.train.config import CheckpointConfig
    from test_trainer import _config

    straight = train(_config(tmp_path / "straight", *TOY, "train.steps=4"), log=lambda _: None)
    train(_config(tmp_path / "resumed", *TOY, "train.steps=2"), log=lambda _: None)
    resumed = train(_config(tmp_path / "resumed", *TOY, "train.steps=4"), log=lambda _: None)
    assert resumed.losses == {step: straight.losses[step] for step in (3, 4)}
    a = Checkpointer(tmp_path / "straight", CheckpointConfig()).read(4)["state"]
    b = Checkpointer(tmp_path / "resumed", CheckpointConfig()).read(4)["state"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(a["params"]["blocks"]["mlp"]["shift"]), np.full((2, 16), 100 - 4 * 0.25))

    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4]
    for record in train_records:
        for layer in (0, 1):
            assert record[f"toy/layer_{layer}/fraction_max"] == 1.0 and record[f"toy/layer_{layer}/tokens"] == 4 * 32
        assert "toy" not in record


def test_a_toy_kind_s_row_sets_its_weight_decay_and_lora_targets(toy_kind):
    from diffjax.train.optimizer import default_no_decay

    config = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=16, mlp="toy_shifted_relu")
    assert r"mlp\.shift" in default_no_decay(config) and r"mlp\.shift" not in default_no_decay(config.replace(
        mlp="gated", mlp_options=None))
    assert "toy_in" in lora.target_names() and "toy_in" in lora.target_groups()["mlp"]
    specs = lora.kernel_specs(config, lora.LoraConfig(rank=2, targets=("mlp",)))
    assert list(specs) == [("blocks", "mlp", "in_kernel")]


# ---- a dense model's step: no statistic, no update, the same program whatever the facets


def _lowered_step(config: ModelConfig, run=None) -> str:
    from diffjax.train.step import init_state, make_train_step

    model = TransformerLM(config, rngs=nnx.Rngs(0))
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(lambda: init_state(model, tx, jax.random.key(0)))
    batch = {key: jax.ShapeDtypeStruct((2, 2, 8), jnp.int32) for key in ("tokens", "positions", "segment_ids")}
    step = make_train_step(nnx.graphdef(model), tx, lambda s: 1e-3, config, run=run)
    return jax.jit(step).lower(state, batch).as_text()


def test_a_dense_step_is_the_same_program_with_a_facet_that_adds_nothing(toy_kind):
    """The step of a dense model (standard attention, gated MLP, plain residual: no facet) and of the same model
    whose MLP row names a facet that asks for nothing and adds nothing lower to the same text, with no routing op;
    the toy's facet (a statistic and an update) changes the toy's program."""
    dense = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=16, attention="standard")
    text = _lowered_step(dense)
    assert "stablehlo.sort" not in text and "chlo.top_k" not in text  # (an MoE's step has both)
    idle = dataclasses.replace(mlp_kinds.get("gated"), name="toy_gated_idle_facet", training=kinds.Training(facet=Facet))
    without_facet = dataclasses.replace(SHIFTED, name="toy_shifted_relu_no_facet",
                                        training=dataclasses.replace(SHIFTED.training, facet=None))
    for row in (idle, without_facet):
        mlp_kinds.register(row)
    try:
        assert _lowered_step(dense.replace(mlp=idle.name)) == text
        toy = dense.replace(mlp=SHIFTED.name)
        assert _lowered_step(toy.replace(mlp=without_facet.name)) != _lowered_step(toy)
    finally:
        for row in (idle, without_facet):
            mlp_kinds.unregister(row.name)


def test_a_diff_step_is_the_same_program_with_its_facet_s_run_settings_off():
    """DIFF's facet makes the lambda warm-up's input from the run's optim.lambda_warmup_steps: with no run, or a run
    without a warm-up, the step is one program (no scale, no input: the step before the warm-up went through the
    facet lowered to this text too, compared by hand); with a warm-up it multiplies lambda and logs the factor."""
    from diffjax.data.config import DataConfig
    from diffjax.train.config import RunConfig
    from diffjax.train.optimizer_config import OptimizerConfig

    diff = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=16)
    text = _lowered_step(diff)
    assert _lowered_step(diff, RunConfig(model=diff, data=DataConfig(seq_len=8))) == text
    warm = _lowered_step(diff, RunConfig(model=diff, data=DataConfig(seq_len=8),
                                          optim=OptimizerConfig(lambda_warmup_steps=4)))
    assert warm != text and warm.count("stablehlo.minimum") == text.count("stablehlo.minimum") + 1
