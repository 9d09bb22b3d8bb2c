"""Blocks built from kinds (diffjax.kinds): an MLP kind and a residual form defined in this file, with options of
their own, work through everything diffjax does with a model (train, resume, its own checkpoint format, generate,
the analyses' probe, FLOPs) with no other file knowing them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import kinds, mlp_kinds, residual_kinds
from diffjax.analysis.probe import make_probe
from diffjax.config import ModelConfig
from diffjax.losses import next_token_loss
from diffjax.model import MLPModule, ResidualForm, TransformerLM
from diffjax.model.layers import normal_param, ones_param
from diffjax.train.metrics import matmul_params, training_flops_per_token

# ------------------------------------------------------------------------------ a toy MLP kind


@dataclasses.dataclass(frozen=True)
class SquaredReluOptions(kinds.Options):
    width: int | None = None  # hidden width; None: 2 d_model

    def defaults(self, config) -> dict:
        return {"width": 2 * config.d_model}

    def problems(self, config) -> list[str]:
        return kinds.positive_int_problems(self, "width")


class SquaredReluMLP(MLPModule):
    """out(relu(x in)^2 * scale): one hidden layer (Primer's squared ReLU) with a learned scale per hidden unit."""

    def __init__(self, config, depth=None, *, rngs):
        D, F, std, pdt = config.d_model, config.mlp_options.width, config.init_std, config.param_dtype
        self.in_kernel = normal_param(rngs, (D, F), std, pdt, ("embed", "mlp"))
        self.out_kernel = normal_param(rngs, (F, D), std, pdt, ("mlp", "embed"))
        self.scale = ones_param((F,), pdt, ("mlp",))

    def __call__(self, x_BTD):
        hidden_BTF = jnp.square(jax.nn.relu(x_BTD @ self.in_kernel[...].astype(x_BTD.dtype)))
        return (hidden_BTF * self.scale[...].astype(x_BTD.dtype)) @ self.out_kernel[...].astype(x_BTD.dtype)


SQUARED_RELU = mlp_kinds.MLPKind(
    name="toy_squared_relu", label="squared ReLU toy", module=SquaredReluMLP, options=SquaredReluOptions,
    params=lambda c: 2 * c.d_model * c.mlp_options.width + c.mlp_options.width,
    matmul_params=lambda c: 2 * c.d_model * c.mlp_options.width,
)

# ------------------------------------------------------------------------------ a toy residual form with two streams


class TwoStreams(ResidualForm):
    """Two residual streams [B, T, 2, D] (the shape hyper-connections give the stream): a sublayer reads their mean
    and adds its output to each with a learned weight per stream; the model's hidden state is their mean."""

    stream_axes = ("batch", "length", None, "act_embed")

    def __init__(self, config, *, rngs):
        self.weight = nnx.Param(jnp.asarray([1.0, 0.5], config.param_dtype), logical_axes=(None,))

    @classmethod
    def expand(cls, config, x_BTD):
        return jnp.stack([x_BTD, x_BTD], axis=2)

    @classmethod
    def collapse(cls, config, stream_BT2D):
        return jnp.mean(stream_BT2D, axis=2)

    def read(self, stream_BT2D):
        return jnp.mean(stream_BT2D, axis=2), None

    def write(self, stream_BT2D, y_BTD, carry):
        return stream_BT2D + y_BTD[:, :, None] * self.weight[...].astype(y_BTD.dtype)[:, None]


TWO_STREAMS = residual_kinds.ResidualKind(name="toy_two_streams", label="two streams", module=TwoStreams,
                                          params=lambda c: 2 * 2)  # two sublayers, a weight per stream each


@pytest.fixture
def toy_kinds():
    mlp_kinds.register(SQUARED_RELU)
    residual_kinds.register(TWO_STREAMS)
    yield
    mlp_kinds.unregister(SQUARED_RELU.name)
    residual_kinds.unregister(TWO_STREAMS.name)


def _tiny(**fields) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, num_layers=2, num_heads=2, max_seq_len=64, attention_impl="xla",
                       init_std=0.2, **fields)


def test_the_tables_name_the_built_in_parts():
    assert "gated" in mlp_kinds.names() and "plain" in residual_kinds.names()
    config = ModelConfig()
    assert (config.mlp, config.residual, config.mlp_options, config.residual_options) == ("gated", "plain", None, None)
    with pytest.raises(ValueError, match="already registered"):
        mlp_kinds.register(mlp_kinds.get("gated"))


def test_options_are_built_from_mappings_and_command_line_strings(toy_kinds):
    config = _tiny(mlp="toy_squared_relu", mlp_options={"width": "48"})  # (a dotted override's string)
    assert config.mlp_options == SquaredReluOptions(width=48)
    assert _tiny(mlp="toy_squared_relu").mlp_options.width == 64  # derived: 2 d_model
    assert _tiny(mlp="toy_squared_relu").replace(d_model=64).mlp_options.width == 128  # and derived again
    assert config.replace(mlp="gated").mlp_options is None  # the options go with the kind
    assert config.to_dict()["mlp_options"] == {"width": 48} and ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"mlp_options.width must be an integer, got 'wide'"):
        _tiny(mlp="toy_squared_relu", mlp_options={"width": "wide"})
    with pytest.raises(ValueError, match=r"mlp_options.width must be a positive integer, got -1"):
        _tiny(mlp="toy_squared_relu", mlp_options={"width": -1})
    with pytest.raises(ValueError, match=r"residual_options: 'plain' has no options, got \{'streams': 4\}"):
        _tiny(residual_options={"streams": 4})


def test_old_config_files_with_flat_kind_fields_still_read():
    """config.yaml files written before kinds had options name GDA's and Shared DIFF's settings at the top level,
    and every kind's (null for the others)."""
    old = {"attention": "gda", "num_heads": 4, "num_kv_heads": 1, "num_noise_heads": 2, "shared_diff_rank": None}
    assert ModelConfig.from_dict(old).attention_options.num_noise_heads == 2
    assert ModelConfig.from_dict({"attention": "shared_diff", "shared_diff_rank": 8}).attention_options.rank == 8
    assert ModelConfig.from_dict({"num_noise_heads": None, "shared_diff_rank": None}) == ModelConfig()
    with pytest.raises(ValueError, match=r"shared_diff_rank is only used by attention 'shared_diff' "
                                         r"\(attention_options.rank\), got 4 with attention 'diff'"):
        ModelConfig.from_dict({"shared_diff_rank": 4})


@pytest.mark.parametrize("fields", [
    dict(mlp="toy_squared_relu"), dict(residual="toy_two_streams"),
    dict(mlp="toy_squared_relu", residual="toy_two_streams", scan_layers=True, remat="attention"),
])
def test_toy_parts_count_step_decode_and_probe(toy_kinds, fields, measured):
    config = _tiny(**fields)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    assert model.num_params() == config.param_count()
    # FLOPs count the MLP's matrices (D x 2D twice for the toy: its scale and the streams' weights are in no matmul)
    plain = config.replace(mlp="gated", residual="plain")
    mlp_matmuls = {"toy_squared_relu": 2 * 32 * 64, "gated": 3 * 32 * plain.mlp_dim}[config.mlp]
    assert matmul_params(config) == matmul_params(plain) + config.num_layers * (mlp_matmuls - 3 * 32 * plain.mlp_dim)
    attention_flops = [training_flops_per_token(c, 64) - 6 * matmul_params(c) for c in (config, plain)]
    assert attention_flops[0] == attention_flops[1]
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 1, 257)
    grads = nnx.grad(lambda m: next_token_loss(m(tokens), tokens))(model)
    for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param)):  # every parameter takes part
        assert np.abs(np.asarray(g[...])).max() > 0, path
    logits, hidden = make_probe(model, lambda view, aux: view.hidden_BTD)(tokens)
    assert measured(f"probe vs model logits ({', '.join(map(str, fields.values()))})",
                    float(jnp.abs(logits - model(tokens)).max()), 1e-5) <= 1e-5
    assert hidden[-1].shape == (2, 16, 32)
    generated = np.asarray(diffjax.generate(model, np.asarray(tokens[:1, :6]), 4))[0]
    full = np.asarray(jnp.argmax(model(jnp.asarray(np.concatenate([tokens[0, :6], generated])[None]))[0], axis=-1))
    assert generated.tolist() == full[5:9].tolist()


@pytest.mark.slow
def test_a_toy_mlp_kind_trains_resumes_saves_and_generates(toy_kinds, tmp_path):
    """The toy MLP kind, chosen and sized from the command line, through train.py's train(): a run stopped and
    resumed equals a straight one bit for bit; the model saves to and loads from diffjax's own params-only format
    (the converters'); the HF formats refuse it by name; it generates."""
    from diffjax.checkpoint import load_model, save_params
    from diffjax.convert.common import ConversionError
    from diffjax.train import train
    from test_trainer import _config

    toy = ["model.mlp=toy_squared_relu", "model.mlp_options.width=48", "model.num_layers=1", "train.sample_tokens=4"]
    straight = train(_config(tmp_path / "straight", *toy, "train.steps=4"), log=lambda _: None)
    train(_config(tmp_path / "resumed", *toy, "train.steps=2"), log=lambda _: None)
    resumed = train(_config(tmp_path / "resumed", *toy, "train.steps=4"), log=lambda _: None)
    assert resumed.losses == {step: straight.losses[step] for step in (3, 4)}
    model = load_model(tmp_path / "resumed")
    assert isinstance(model.blocks.mlp, SquaredReluMLP) and model.config.mlp_options.width == 48
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(load_model(tmp_path / "straight"), nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))

    save_params(tmp_path / "params_only", nnx.state(model, nnx.Param).to_pure_dict(), model.config)
    back = load_model(tmp_path / "params_only")
    assert back.config == model.config
    np.testing.assert_array_equal(np.asarray(back.blocks.mlp.scale[...]), np.asarray(model.blocks.mlp.scale[...]))
    with pytest.raises(ConversionError, match="mlp='toy_squared_relu': DiffLlama holds mlp 'gated' only"):
        diffjax.save_hf(model, tmp_path / "hf")
    assert np.asarray(diffjax.generate(back, [[104, 105]], 3)).shape == (1, 3)


def test_a_run_directory_written_before_options_resumes_with_them(tmp_path):
    """A run directory's config.yaml from before kinds had options names GDA's noise heads at the top of the model
    section (and every kind's setting, null for the others): the same model resumes there, another is refused."""
    import yaml

    from diffjax.run_dir import RunDir
    from diffjax.train.config import RunConfig
    from diffjax.train.run import changed_settings

    model = ModelConfig(attention="gda", num_heads=4, num_kv_heads=1, attention_options={"num_noise_heads": 2})
    new_keys = ("attention_options", "mlp", "residual")
    old_model = {key: value for key, value in model.to_dict().items() if key not in new_keys}
    old_model.update(num_noise_heads=2, shared_diff_rank=None)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": old_model}))
    assert changed_settings(RunDir(tmp_path), RunConfig(model=model)) == []
    other = model.replace(attention_options={"num_noise_heads": 4})
    with pytest.raises(ValueError, match=r"different model \(model.attention_options differ"):
        changed_settings(RunDir(tmp_path), RunConfig(model=other))
