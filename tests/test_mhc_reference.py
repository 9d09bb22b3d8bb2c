"""The mHC residual form (residual="mhc", diffjax.model.residual.mhc) against tests/motif3_reference.py's MotifMHC
with its weights copied in: one sublayer's read / write, then a whole model (Llama's attention and MLP from
transformers, joined to the streams as the reference's MotifDecoderLayer joins them) in logits, every layer's hidden
state and every gradient; and mutations of the stated choices that these comparisons must catch. (What needs no
torch: tests/test_mhc.py.)"""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from hf_models import make_hf_model, max_relative_error, random_tokens  # noqa: E402
from motif3_reference import MotifMHC, _draw  # noqa: E402
from test_mhc import E, SINKHORN_ITERS, _options, _tiny_config  # noqa: E402

import diffjax  # noqa: E402
from diffjax.analysis.probe import make_probe  # noqa: E402
from diffjax.convert.common import build_module  # noqa: E402
from diffjax.convert.hf import config_from_hf, params_from_hf  # noqa: E402
from diffjax.model import TransformerLM  # noqa: E402
from diffjax.model.residual import mhc  # noqa: E402


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
