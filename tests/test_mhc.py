"""The mHC residual form (residual="mhc", diffjax.model.residual.mhc) against tests/motif3_reference.py's MotifMHC
with its weights copied in: one sublayer's read / write, then a whole model (Llama's attention and MLP from
transformers, joined to the streams as the reference's MotifDecoderLayer joins them) in logits, every layer's hidden
state and every gradient; mutations of the stated choices that these comparisons must catch; train.py trains,
resumes bit for bit and generates with it; the HF export refuses it."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import make_hf_model, max_relative_error, random_tokens
from motif3_reference import MotifMHC, _draw

import diffjax
from diffjax.analysis.probe import make_probe
from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError, build_module
from diffjax.convert.hf import config_from_hf, params_from_hf
from diffjax.model import TransformerLM
from diffjax.model.residual import mhc
from diffjax.residual_kinds import MHCOptions
from diffjax.train.metrics import matmul_params

E, SINKHORN_ITERS = 4, 20


def reference_mhc(d_model: int, seed: int, h_post_alpha: float = 0.0) -> MotifMHC:
    """A MotifMHC with the reference's random draw, h_res's logits spread so that 20 Sinkhorn rounds leave its rows
    short of 1 (the order of rows and columns shows)."""
    config = types.SimpleNamespace(mhc_expansion_rate=E, hidden_size=d_model, mhc_h_post_alpha_end=h_post_alpha,
                                   mhc_sinkhorn_iters=SINKHORN_ITERS)
    torch.manual_seed(seed)
    module = MotifMHC(config)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(_draw(name, param) * (3 if name == "bias_res" else 1))
    return module


def diffjax_layout(tensors) -> dict[tuple, np.ndarray]:
    """A MotifMHC's state_dict (or its gradients) by name -> diffjax's parameter paths within the form: the
    one-to-one map diffjax.model.residual.mhc's docstring states (transposes and reshapes only)."""
    t = {name: np.asarray(value.detach(), np.float32) for name, value in tensors.items()}
    return {("pre_kernel",): t["proj_pre.weight"].T, ("post_kernel",): t["proj_post.weight"].T,
            ("res_kernel",): t["proj_res.weight"].T, ("norm", "scale"): t["rms_norm.weight"],
            ("pre_bias",): t["bias_pre"], ("post_bias",): t["bias_post"], ("res_bias",): t["bias_res"],
            ("pre_alpha",): t["alpha_pre"].reshape(()), ("post_alpha",): t["alpha_post"].reshape(()),
            ("res_alpha",): t["alpha_res"].reshape(())}


def _options(**fields) -> dict:
    return {"streams": E, "sinkhorn_iters": SINKHORN_ITERS, **fields}


def _tiny_config(d_model=32, **options) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=d_model, num_layers=2, num_heads=2, max_seq_len=64, attention_impl="xla",
                       residual="mhc", residual_options=_options(**options))


def sinkhorn_columns_first(logits, iterations, clamp, eps, sinkhorn=mhc.sinkhorn):
    """The mutation: the two normalizations of each round in the other order."""
    return jnp.swapaxes(sinkhorn(jnp.swapaxes(logits, -1, -2), iterations, clamp, eps), -1, -2)


# ------------------------------------------------------------------------------ one sublayer


def _sublayer_case(d_model=24, seed=0, h_post_alpha=0.0):
    """(the reference module, the diffjax form with its weights, a stream [B, T, E, D], a sublayer weight [D, D])."""
    reference = reference_mhc(d_model, seed)
    form = _form_with(diffjax_layout(dict(reference.named_parameters())), d_model, h_post_alpha)
    rng = np.random.RandomState(seed)
    return reference, form, rng.randn(2, 5, E, d_model).astype(np.float32), \
        (rng.randn(d_model, d_model) / d_model**0.5).astype(np.float32)


def _form_with(params: dict, d_model: int, h_post_alpha: float = 0.0) -> mhc.MHCResidual:
    config = _tiny_config(d_model, h_post_alpha=h_post_alpha)
    return build_module(lambda: mhc.MHCResidual(config, rngs=nnx.Rngs(0)), params, jnp.float32)


def _torch_step(reference, stream, weight):
    """The reference's sublayer step with tanh(x W) as the sublayer: (output stream, h_pre, h_post, h_res, x)."""
    h_pre, h_post, h_res = reference(stream)
    x = MotifMHC.collapse(stream, h_pre)
    return MotifMHC.combine(stream, h_res, h_post, torch.tanh(x @ weight)), h_pre, h_post, h_res, x


def _jax_step(form, stream, weight):
    x, carry = form.read(stream)
    return form.write(stream, jnp.tanh(x @ weight), carry), x


def test_one_sublayer_step_matches_the_reference(measured):
    reference, form, stream, weight = _sublayer_case()
    stream_t = torch.tensor(stream, requires_grad=True)
    out_t, h_pre_t, h_post_t, h_res_t, x_t = _torch_step(reference, stream_t, torch.tensor(weight))
    # gradients of a weighted sum of the output stream: every parameter of the form and the stream itself
    probe = np.random.RandomState(1).randn(*out_t.shape).astype(np.float32)
    (out_t * torch.tensor(probe)).sum().backward()
    expected = {**diffjax_layout({n: p.grad for n, p in reference.named_parameters()}), ("stream",): stream_t.grad}

    @nnx.jit  # (one program: compiled at once, where running the ops one by one compiles each)
    def step_and_grads(form, stream):
        def loss(form, stream):
            out, x = _jax_step(form, stream, weight)
            return jnp.sum(out * probe), (out, x)

        (_, (out, x)), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(form, stream)
        return form.gates(stream), out, x, grads

    gates, out, x, (grads, stream_grad) = step_and_grads(form, jnp.asarray(stream))
    for ours, theirs, what in zip(gates, (h_pre_t, h_post_t, h_res_t), ("h_pre", "h_post", "h_res")):
        assert max_relative_error(ours, theirs.detach()) <= 1e-5, what
    assert float(jnp.abs(gates[2].sum(-1) - 1).max()) > 1e-3  # rows-then-columns differs from columns-then-rows here
    assert max_relative_error(x, x_t.detach()) <= 1e-5
    assert measured("sublayer step vs reference (max rel err)", max_relative_error(out, out_t.detach()), 1e-5) <= 1e-5
    ours = {**{path: g[...] for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param))}, ("stream",): stream_grad}
    assert set(ours) == set(expected)
    worst = max(max_relative_error(ours[path], expected[path]) for path in expected)
    assert measured("sublayer gradients vs reference (max rel err)", worst, 1e-4) <= 1e-4


@pytest.mark.parametrize("mutation", ["sinkhorn columns first", "h_post coefficient 2"])
def test_the_sublayer_comparison_catches(mutation, monkeypatch):
    reference, form, stream, weight = _sublayer_case(h_post_alpha=1.0 if mutation == "h_post coefficient 2" else 0.0)
    if mutation == "sinkhorn columns first":
        monkeypatch.setattr(mhc, "sinkhorn", sinkhorn_columns_first)
    out_t = _torch_step(reference, torch.tensor(stream), torch.tensor(weight))[0].detach()
    assert max_relative_error(_jax_step(form, jnp.asarray(stream), weight)[0], out_t) > 1e-3


# ------------------------------------------------------------------------------ a whole model


def torch_mhc_llama(hf, mhcs, tokens):
    """Logits and each layer's collapsed stream of `hf` (a LlamaForCausalLM) with every sublayer joined by a
    MotifMHC pair as the reference's MotifDecoderLayer.forward and MotifModel.forward do."""
    model, T = hf.model, tokens.shape[1]
    x = model.embed_tokens(torch.as_tensor(tokens, dtype=torch.long))
    cos_sin = model.rotary_emb(x, torch.arange(T)[None])
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    x = x.unsqueeze(2).expand(-1, -1, E, -1).contiguous()
    hidden = []
    for layer, (mhc_attn, mhc_ffn) in zip(model.layers, mhcs):
        h_pre, h_post, h_res = mhc_attn(x)
        out = layer.self_attn(layer.input_layernorm(MotifMHC.collapse(x, h_pre)), cos_sin, causal)[0]
        x = MotifMHC.combine(x, h_res, h_post, out)
        h_pre, h_post, h_res = mhc_ffn(x)
        x = MotifMHC.combine(x, h_res, h_post, layer.mlp(layer.post_attention_layernorm(MotifMHC.collapse(x, h_pre))))
        hidden.append(x.mean(dim=2))
    return hf.lm_head(model.norm(x.mean(dim=2))), hidden


def _stacked_mhc_params(mhcs, grads: bool = False) -> dict:
    """The layers' MotifMHC pairs (their weights or gradients) as the diffjax model's stacked [L, ...] params."""
    params = {}
    for form, index in (("attn_residual", 0), ("mlp_residual", 1)):
        layers = [diffjax_layout({n: (p.grad if grads else p) for n, p in pair[index].named_parameters()})
                  for pair in mhcs]
        params.update({("blocks", form, *path): np.stack([layer[path] for layer in layers]) for path in layers[0]})
    return params


@pytest.fixture(scope="module")
def model_pair():
    """(the torch model's parts, the diffjax model with their weights, tokens, torch's logits, hidden states and
    gradients by diffjax path)."""
    hf = make_hf_model("llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    mhcs = [(reference_mhc(32, 2 * i + 1), reference_mhc(32, 2 * i + 2)) for i in range(2)]
    tokens = random_tokens(hf.config.vocab_size, (2, 12))
    plain = config_from_hf(hf.config.to_dict()).replace(rope_style="interleaved")
    config = plain.replace(residual="mhc", residual_options=_options())
    params = {**params_from_hf(hf.state_dict(), plain), **_stacked_mhc_params(mhcs)}
    model = build_module(lambda: TransformerLM(config, rngs=nnx.Rngs(0)), params, jnp.float32)
    logits, hidden = torch_mhc_llama(hf, mhcs, tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                      torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1)).backward()
    grads = {**params_from_hf({n: p.grad for n, p in hf.named_parameters()}, plain),
             **_stacked_mhc_params(mhcs, grads=True)}
    return model, tokens, logits.detach(), [h.detach() for h in hidden], grads


def _rebuilt(model, config):
    """`model`'s params in a model of `config` (the same parameters, computed otherwise)."""
    return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))), nnx.state(model))


def _hidden_states_error(model, tokens, expected_logits, expected_hidden) -> float:
    """Max relative error of the probe's logits and every layer's collapsed stream against the torch model's."""
    logits, hidden = make_probe(model, lambda view, aux: view.hidden_BTD)(jnp.asarray(tokens))
    return max([max_relative_error(logits, expected_logits)]
               + [max_relative_error(ours, theirs) for ours, theirs in zip(hidden, expected_hidden)])


@pytest.mark.slow
def test_a_model_matches_the_reference_in_logits_hidden_states_and_gradients(model_pair, measured):
    model, tokens, expected_logits, expected_hidden, expected_grads = model_pair
    assert measured("mHC model logits vs torch (max rel err)",
                    max_relative_error(model(jnp.asarray(tokens)), expected_logits), 1e-5) <= 1e-5
    assert _hidden_states_error(model, tokens, expected_logits, expected_hidden) <= 1e-5
    # gradients through the scanned, rematerialized stack (the configuration large runs use)
    scanned = _rebuilt(model, model.config.replace(scan_layers=True, remat="attention"))
    grads = nnx.grad(lambda m: diffjax.next_token_loss(m(jnp.asarray(tokens)), jnp.asarray(tokens)))(scanned)
    ours = {path: g[...] for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param))}
    assert set(ours) == set(expected_grads)
    errors = {path: max_relative_error(ours[path], expected_grads[path]) for path in expected_grads}
    worst = max(errors, key=errors.get)
    assert measured("mHC model gradients vs torch (max rel err)", errors[worst], 1e-4) <= 1e-4, worst


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["sinkhorn columns first", "h_post coefficient 2", "sum collapse",
                                      "first stream collapse"])
def test_the_model_comparison_catches(mutation, model_pair, monkeypatch):
    """A sum where the mean belongs hardly changes the logits (the final RMSNorm divides the factor E out but for its
    eps): the layers' collapsed streams, compared too, catch it."""
    model, tokens, expected_logits, expected_hidden, _ = model_pair
    if mutation == "sinkhorn columns first":
        monkeypatch.setattr(mhc, "sinkhorn", sinkhorn_columns_first)
    elif mutation == "h_post coefficient 2":
        options = dataclasses.replace(model.config.residual_options, h_post_alpha=1.0)
        model = _rebuilt(model, model.config.replace(residual_options=options))
    else:
        collapse = (lambda s: jnp.sum(s, axis=2)) if mutation == "sum collapse" else (lambda s: s[:, :, 0])
        monkeypatch.setattr(mhc.MHCResidual, "collapse", classmethod(lambda cls, config, s: collapse(s)))
    assert _hidden_states_error(model, tokens, expected_logits, expected_hidden) > 1e-3


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
    with pytest.raises(ConversionError, match=r"^cannot export to Hugging Face: residual='mhc': the Hugging Face formats hold "
                                             r"residual='plain' only$"):
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
