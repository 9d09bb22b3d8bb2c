"""Motif 3's MLPs and layer stack in diffjax (mlp_kinds rows "polynorm" and "moe", model segments): the PyTorch
re-statement's modules (tests/motif3_reference.py) with their weights copied in give the same outputs and gradients;
a model of dense-first then MoE layers trains, resumes bitwise and generates through the real CLIs."""

from __future__ import annotations

import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx
from motif3_published import small_config

from diffjax.config import ModelConfig
from diffjax.model.mlp import moe as moe_module
from diffjax.model.mlp.moe import MoEMLP
from diffjax.model.mlp.polynorm import PolyNormMLP
from diffjax.model.transformer import TransformerLM

try:  # the PyTorch re-statement (the leg without torch runs the rest)
    import torch
    from motif3_reference import Motif3Config, MotifMLP, MotifMoE, _draw
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="the PyTorch reference needs torch")

B, T = 2, 5


def moe_options(c: dict) -> dict:
    """A Motif 3 config.json's MoE fields as the "moe" kind's options."""
    return dict(num_experts=c["num_experts"], top_k=c["experts_top_k"], expert_inner=c["moe_intermediate_size"],
                num_shared_experts=c["num_shared_experts"], score_func=c["score_func"], route_norm=c["route_norm"],
                route_scale=c["route_scale"], expert_bias=c.get("load_balance_coeff") is not None,
                output_scale=c["polynorm_output_scale"], sigmoid_weight=c["polynorm_sigmoid_weight"],
                bias_clamp=c["polynorm_bias_clamp"], hidden_clamp=c["hidden_clamp"],
                dense_first_layers=c["n_dense_first_layers"], moe_layer_step=c["interleave_moe_layer_step"])


def diffjax_config(c: dict, **changes) -> ModelConfig:
    """The diffjax config of a Motif 3 config.json's sizes and MLPs (attention: a stand-in)."""
    fields = dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"], num_layers=c["num_hidden_layers"],
                  num_heads=4, mlp_dim=c["intermediate_size"], mlp="moe", mlp_options=moe_options(c),
                  attention="standard")
    return ModelConfig(**{**fields, **changes})


def drawn(module, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(_draw(name, param))
        if getattr(module, "expert_bias", None) is not None:  # not a trained parameter: named_parameters skips none
            module.expert_bias.copy_(0.1 * torch.randn_like(module.expert_bias))
    return module


def t2j(x):
    return jnp.asarray(x.detach().numpy())


def copy_polynorm_mlp(ours, theirs):
    ours.gate_kernel[...] = t2j(theirs.gate_proj.weight.T)
    ours.up_kernel[...] = t2j(theirs.up_proj.weight.T)
    ours.down_kernel[...] = t2j(theirs.down_proj.weight.T)
    ours.polynorm_weight[...] = t2j(theirs.act_fn.weight)
    ours.polynorm_bias[...] = t2j(theirs.act_fn.bias)


def copy_moe(ours, theirs):
    inner = theirs.experts.down_proj.shape[-1]
    ours.router_kernel[...] = t2j(theirs.router.gate.weight.T)
    if theirs.expert_bias is not None:
        ours.expert_bias[...] = t2j(theirs.expert_bias)
    gate_up = theirs.experts.gate_up_proj
    ours.expert_gate_kernel[...] = t2j(gate_up[:, :inner].transpose(1, 2))
    ours.expert_up_kernel[...] = t2j(gate_up[:, inner:].transpose(1, 2))
    ours.expert_down_kernel[...] = t2j(theirs.experts.down_proj.transpose(1, 2))
    ours.expert_polynorm_weight[...] = t2j(theirs.experts.act_fn.weight)
    ours.expert_polynorm_bias[...] = t2j(theirs.experts.act_fn.bias)
    if theirs.shared_experts is not None:
        copy_polynorm_mlp(ours.shared_expert, theirs.shared_experts)


# (ours, theirs) gradient pairs: diffjax path -> (reference parameter name, its layout -> ours)
def _t(x):
    return x.T


MLP_GRADS = {"gate_kernel": ("gate_proj.weight", _t), "up_kernel": ("up_proj.weight", _t),
             "down_kernel": ("down_proj.weight", _t), "polynorm_weight": ("act_fn.weight", None),
             "polynorm_bias": ("act_fn.bias", None)}


def moe_grads(inner):
    return {"router_kernel": ("router.gate.weight", _t),
            "expert_gate_kernel": ("experts.gate_up_proj", lambda g: g[:, :inner].transpose(0, 2, 1)),
            "expert_up_kernel": ("experts.gate_up_proj", lambda g: g[:, inner:].transpose(0, 2, 1)),
            "expert_down_kernel": ("experts.down_proj", lambda g: g.transpose(0, 2, 1)),
            "expert_polynorm_weight": ("experts.act_fn.weight", None),
            "expert_polynorm_bias": ("experts.act_fn.bias", None),
            **{f"shared_expert.{k}": (f"shared_experts.{name}", f) for k, (name, f) in MLP_GRADS.items()}}


def compare(ours, theirs, grad_names, seed=1):
    """(max relative error of the outputs, of the gradients (x's and every parameter's)) for the same x and
    cotangent through both modules, float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, theirs_width(theirs)), dtype=np.float32)
    cot = rng.standard_normal(x.shape, dtype=np.float32)
    theirs.zero_grad(set_to_none=True)
    x_t = torch.tensor(x, requires_grad=True)
    out_t = theirs(x_t)
    out_t.backward(torch.tensor(cot))
    graphdef, params, rest = nnx.split(ours, nnx.Param, ...)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x) * cot), nnx.merge(graphdef, params, rest)(x)

    (_, out), (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, jnp.asarray(x))
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(g_params)}
    theirs_grads = dict(theirs.named_parameters())
    pairs = [(g_x, x_t.grad.numpy())]
    for ours_name, (their_name, layout) in grad_names.items():
        if ours_name in flat:
            their = theirs_grads[their_name].grad.numpy()
            pairs.append((flat[ours_name][...], layout(their) if layout else their))
    return rel_err(out, out_t.detach().numpy()), max(rel_err(a, b) for a, b in pairs)


def theirs_width(module):
    return module.router.gate.weight.shape[1] if isinstance(module, MotifMoE) else module.gate_proj.weight.shape[1]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def dense_pair(variant="all_on", hidden_clamp=None, **overrides):
    c = small_config(variant, **overrides)
    theirs = drawn(MotifMLP(c["hidden_size"], c["intermediate_size"], c["polynorm_output_scale"],
                            c["polynorm_sigmoid_weight"], hidden_clamp))
    config = diffjax_config(c, mlp="polynorm", mlp_options=dict(output_scale=c["polynorm_output_scale"],
                                                                 sigmoid_weight=c["polynorm_sigmoid_weight"],
                                                                 hidden_clamp=hidden_clamp))
    ours = PolyNormMLP(config, rngs=nnx.Rngs(0))
    copy_polynorm_mlp(ours, theirs)
    return ours, theirs


def moe_pair(variant="all_on", **overrides):
    c = small_config(variant, **overrides)
    theirs = drawn(MotifMoE(Motif3Config(**c), c["polynorm_output_scale"]))
    ours = MoEMLP(diffjax_config(c), rngs=nnx.Rngs(0))
    copy_moe(ours, theirs)
    return ours, theirs, moe_grads(c["moe_intermediate_size"])


@needs_torch
@pytest.mark.parametrize("sigmoid_weight", [True, False])
def test_dense_polynorm_mlp_equals_the_reference(sigmoid_weight):
    ours, theirs = dense_pair(polynorm_sigmoid_weight=sigmoid_weight)
    out_err, grad_err = compare(ours, theirs, MLP_GRADS)
    assert out_err < 1e-5 and grad_err < 1e-4, (out_err, grad_err)


@needs_torch
def test_clamped_polynorm_mlp_equals_the_reference_shared_expert():
    ours, theirs = dense_pair(hidden_clamp=0.3)
    out_err, grad_err = compare(ours, theirs, MLP_GRADS)
    assert out_err < 1e-5 and grad_err < 1e-4, (out_err, grad_err)


MOE_CASES = {
    "sigmoid, route_norm, shared, bias": dict(variant="all_on"),
    "softmax, no route_norm": dict(variant="softmax_router"),
    "softmax, route_norm": dict(variant="softmax_router", route_norm=True, route_scale=1.5),
    "sigmoid, no route_norm, no shared, no bias": dict(variant="all_on", route_norm=False, num_shared_experts=0,
                                                       load_balance_coeff=None),
    "tight clamps": dict(variant="tight_clamps"),
    "no clamps, no sigmoid weight": dict(variant="all_on", hidden_clamp=None, polynorm_bias_clamp=None,
                                         polynorm_sigmoid_weight=False),
}


@needs_torch
@pytest.mark.slow  # each over 4 s: the first op-by-op dispatches of ragged_dot's CPU lowering and its gradient
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_layer_equals_the_reference(case):
    out_err, grad_err = compare(*moe_pair(**MOE_CASES[case]))
    assert out_err < 1e-5 and grad_err < 1e-4, (out_err, grad_err)


@needs_torch
@pytest.mark.parametrize("score_func, route_norm", [("sigmoid", True), ("sigmoid", False), ("softmax", True),
                                                    ("softmax", False)])
def test_routing_equals_the_reference(score_func, route_norm):
    """The same experts and weights as the reference's route(), with an expert_bias that changes some choices; the
    weights with the bias in them differ (the mutation the MoE tests catch)."""
    from motif3_reference import route as reference_route

    rng = np.random.default_rng(0)
    logits, bias = rng.standard_normal((64, 6), dtype=np.float32), 0.3 * rng.standard_normal(6, dtype=np.float32)
    experts, weights = moe_module.route(jnp.asarray(logits), jnp.asarray(bias), 2, score_func, route_norm, 2.0)
    their_experts, their_weights = reference_route(torch.tensor(logits), torch.tensor(bias), 2, score_func,
                                                   route_norm, 2.0)
    np.testing.assert_array_equal(np.sort(experts, -1), np.sort(their_experts.numpy(), -1))
    order, their_order = np.argsort(experts, -1), np.argsort(their_experts.numpy(), -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(their_weights.numpy(), their_order, -1), rtol=1e-6)
    unbiased, _ = moe_module.route(jnp.asarray(logits), None, 2, score_func, route_norm, 2.0)
    assert np.any(np.sort(experts, -1) != np.sort(unbiased, -1))  # the bias changes choices
    _, biased_weights = _route_with_the_bias_in_the_weights(jnp.asarray(logits), jnp.asarray(bias), 2, score_func,
                                                            route_norm, 2.0)
    assert not np.allclose(np.asarray(biased_weights), np.asarray(weights), rtol=1e-3)


def _route_with_the_bias_in_the_weights(logits, bias, top_k, score_func, route_norm, route_scale):
    scores = jax.nn.sigmoid(logits) if score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(choice, experts, axis=-1)
    return experts, (weights / weights.sum(-1, keepdims=True) if route_norm else weights) * route_scale


@needs_torch
@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["routing bias in the weights", "routed clamps dropped"])
def test_mutations_of_the_routed_experts_are_caught(mutation, monkeypatch):
    if mutation == "routing bias in the weights":
        monkeypatch.setattr(moe_module, "route", _route_with_the_bias_in_the_weights)
        pair = moe_pair()
    else:  # the routed experts' clamps only (the shared expert's module keeps its own)
        monkeypatch.setattr(moe_module, "clamp", lambda x, bound: x)
        pair = moe_pair("tight_clamps")
    out_err, _ = compare(*pair)
    assert out_err > 1e-3, out_err


# ------------------------------------------------------------------------------ sizes


def test_published_size_counts_314b_total_and_13_2b_active(capsys):
    """Motif 3's published config as diffjax's MLP rows (the attention a stand-in, swapped for GDLA's and mHC's tensors
    as the checkpoint lists them): the MLPs, embeddings and norms count exactly what the checkpoint holds; with the
    multi-token-prediction block the checkpoint also ships (which 13.2B counts, motif3_published's note) that is
    314B total and 13.2B active within 1%. As built (no MTP block): 314.59B and 12.98B."""
    from motif3_published import (PUBLISHED, PUBLISHED_ACTIVE_PARAMS, PUBLISHED_TOTAL_PARAMS, _mtp_shapes,
                                  checkpoint_shapes)
    from motif3_published import parameter_counts as reference_counts

    from diffjax import attention_kinds
    from diffjax.model.sizes import describe_parameter_counts, parameter_counts

    config = diffjax_config(PUBLISHED, num_heads=32)
    total, active = parameter_counts(config)
    assert (total, active) == (config.param_count(), config.param_count(active=True))  # the rows' formulas agree
    stand_in = config.num_layers * attention_kinds.get("standard").attention_params(config)
    gdla_and_mhc = sum(math.prod(shape) for name, shape in checkpoint_shapes(PUBLISHED).items()
                       if ".self_attn." in name or ".mhc_" in name)
    built = (total - stand_in + gdla_and_mhc, active - stand_in + gdla_and_mhc)
    assert built == reference_counts(PUBLISHED)
    mtp = sum(math.prod(shape) for shape in _mtp_shapes(PUBLISHED).values())
    assert abs(built[0] + mtp - PUBLISHED_TOTAL_PARAMS) < 0.01 * PUBLISHED_TOTAL_PARAMS
    assert abs(built[1] + mtp - PUBLISHED_ACTIVE_PARAMS) < 0.01 * PUBLISHED_ACTIVE_PARAMS
    with capsys.disabled():
        print(f"\nMotif 3 published, diffjax MLPs with a stand-in attention: {describe_parameter_counts(config)}; "
              f"with GDLA and mHC as built: {built[0] / 1e9:.2f}B total, {built[1] / 1e9:.2f}B active; "
              f"+ the MTP block: {(built[0] + mtp) / 1e9:.2f}B / {(built[1] + mtp) / 1e9:.2f}B")


# ------------------------------------------------------------------------------ the layer stack

STACK = dict(vocab_size=64, d_model=32, num_layers=4, num_heads=2, mlp_dim=48, mlp="moe", max_seq_len=32,
             attention_window=3, global_layers=(0, 2),  # per-layer windows across both segments
             mlp_options=dict(num_experts=4, top_k=2, expert_inner=16, num_shared_experts=1, score_func="sigmoid",
                              route_norm=True, route_scale=2.0, expert_bias=True, output_scale=0.5, bias_clamp=0.5,
                              dense_first_layers=2))


def stack_model(**changes):
    return TransformerLM(ModelConfig(**{**STACK, **changes}), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_dense_first_layers_are_a_segment_of_their_own():
    from diffjax.model.mlp.polynorm import PolyNormMLP as Dense

    model = stack_model()
    assert [(s.name, s.start, s.stop) for s in model.segments()] == [("blocks", 0, 2), ("blocks_from_2", 2, 4)]
    assert isinstance(model.blocks.mlp, Dense) and isinstance(model.blocks_from_2.mlp, MoEMLP)
    assert model.blocks.mlp.options.hidden_clamp is None and model.blocks.mlp.options.output_scale == 0.5
    assert model.blocks_from_2.mlp.expert_gate_kernel.shape == (2, 4, 32, 16)
    assert model.num_params() == model.config.param_count()
    assert isinstance(model.layer(1).mlp, Dense) and isinstance(model.layer(3).mlp, MoEMLP)
    # one segment: the params tree as before segments existed
    plain = TransformerLM(ModelConfig(**{**STACK, "mlp": "gated", "mlp_options": None}), rngs=nnx.Rngs(0))
    assert [s.name for s in plain.segments()] == ["blocks"] and not hasattr(plain, "blocks_from_2")


def test_the_checkpoint_readers_find_the_segments_from_their_names():
    """The params keys that is_stacked (checkpoints, LoRA merge, adoption) takes for stacks are the segments'."""
    from diffjax.kinds import Segment, layer_segments
    from diffjax.params_checkpoint import is_stacked

    config = ModelConfig(**STACK)
    params = nnx.to_pure_dict(nnx.eval_shape(lambda: nnx.state(TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param)))
    segments = layer_segments(config)
    assert [s.name for s in segments] == ["blocks", "blocks_from_2"]  # (the names on disk)
    assert {name for name in params if is_stacked((name,))} == {s.name for s in segments}
    assert [Segment.start_of(s.name) for s in segments] == [0, 2]
    assert [Segment.start_of(name) for name in ("blocks_from_", "blocks_from_02", "blocksy_from_2")] == [None] * 3


@pytest.mark.parametrize("dense, step", [(0, 1), (2, 1), (1, 2), (0, 3), (7, 1)])
def test_the_moe_layers_are_the_references(dense, step):
    from motif3_published import is_moe_layer

    from diffjax.kinds import layer_segments

    c = small_config(num_hidden_layers=7, n_dense_first_layers=dense, interleave_moe_layer_step=step)
    segments = layer_segments(diffjax_config(c))
    assert [depth for s in segments for depth in range(s.start, s.stop) if s.config.mlp == "moe"] == [
        depth for depth in range(7) if is_moe_layer(c, depth)]
    assert all(a.config != b.config for a, b in zip(segments, segments[1:]))  # runs of like layers, each maximal


@pytest.mark.parametrize("fields, message", [
    (dict(dense_first_layers=5), "mlp_options.dense_first_layers (5) must be at most num_layers (4)"),
    (dict(top_k=5), "mlp_options.top_k (5) must be at most num_experts (4)"),
    (dict(score_func="relu"), "mlp_options.score_func must be one of ('sigmoid', 'softmax'), got 'relu'"),
    (dict(hidden_clamp=0), "mlp_options.hidden_clamp must be None (off) or > 0, got 0"),
    (dict(moe_layer_step=0), "mlp_options.moe_layer_step must be a positive integer, got 0"),
])
def test_bad_moe_options_are_named_in_one_line(fields, message):
    with pytest.raises(ValueError) as error:
        ModelConfig(**{**STACK, "mlp_options": {**STACK["mlp_options"], **fields}})
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_scan_remat_loop_generate_and_probe_agree():
    from diffjax import generate
    from diffjax.analysis.probe import make_probe
    from diffjax.model.kv_cache import KVCache

    model = stack_model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))
    logits = model(tokens)
    state = nnx.state(model)
    for changes in (dict(scan_layers=True), dict(scan_layers=True, remat="full"), dict(remat="minimal")):
        other = nnx.merge(nnx.graphdef(stack_model(**changes)), state)
        np.testing.assert_allclose(other(tokens), logits, rtol=1e-5, atol=1e-5, err_msg=str(changes))
    probed, _ = make_probe(model)(tokens)
    np.testing.assert_allclose(probed, logits, rtol=1e-5, atol=1e-5)
    scanned = nnx.merge(nnx.graphdef(stack_model(scan_layers=True)), state)  # a cache through the scanned stacks
    cached, cache = scanned(tokens, cache=KVCache.empty(2, 16))
    np.testing.assert_allclose(cached, logits, rtol=1e-5, atol=1e-5)
    assert cache.k.shape[0] == 4 and int(cache.lengths_B[0]) == 9
    generated = np.asarray(generate(model, np.asarray(tokens[:1, :5]), 4))[0]
    full = np.asarray(jnp.argmax(model(jnp.asarray(np.concatenate([tokens[0, :5], generated])[None]))[0], axis=-1))
    assert generated.tolist() == full[4:8].tolist()


@pytest.mark.slow
def test_expert_bias_gets_no_gradient_and_no_weight_decay():
    import re

    from diffjax.losses import next_token_loss
    from diffjax.train.optimizer import default_no_decay

    model = stack_model()
    model.blocks_from_2.mlp.expert_bias[...] = jnp.full((2, 4), 0.3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))

    def loss(params):
        return next_token_loss(nnx.merge(graphdef, params, rest)(tokens), tokens)

    grads = nnx.to_flat_state(jax.jit(jax.grad(loss))(params))
    by_name = {".".join(map(str, path)): g[...] for path, g in grads}
    assert not np.any(by_name["blocks_from_2.mlp.expert_bias"])
    assert np.any(by_name["blocks_from_2.mlp.router_kernel"])
    assert any(re.search(pattern, "blocks_from_2.mlp.expert_bias") for pattern in default_no_decay(model.config))


def test_hf_export_refuses_the_motif3_mlps(tmp_path):
    import diffjax
    from diffjax.convert.common import ConversionError

    with pytest.raises(ConversionError, match="mlp='moe': DiffLlama holds mlp 'gated' only"):
        diffjax.save_hf(stack_model(attention="diff"), tmp_path / "hf")


MOE_RUN = ["model.mlp=moe", "model.mlp_dim=48", "model.num_layers=3", "model.mlp_options.num_experts=4",
           "model.mlp_options.top_k=2", "model.mlp_options.expert_inner=16", "model.mlp_options.num_shared_experts=1",
           "model.mlp_options.score_func=sigmoid", "model.mlp_options.route_norm=true",
           "model.mlp_options.route_scale=2.0", "model.mlp_options.expert_bias=true",
           "model.mlp_options.output_scale=0.5", "model.mlp_options.bias_clamp=0.5",
           "model.mlp_options.dense_first_layers=1", "train.sample_tokens=4"]


@pytest.mark.slow
@pytest.mark.both_legs
def test_dense_first_then_moe_trains_through_train_py_and_resumes_bitwise(tmp_path):
    """Two steps by `python train.py` (the real CLI), resumed in train() for two more, equal four straight steps bit
    for bit; the run samples, its set-up line names the active parameters."""
    import subprocess
    import sys

    from diffjax.checkpoint import load_model
    from diffjax.train import train
    from test_trainer import REPO_ROOT, SMALL, _config

    result = subprocess.run([sys.executable, "train.py", *SMALL, *MOE_RUN, "train.steps=2",
                             f"train.run_dir={tmp_path / 'resumed'}"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "active)" in result.stdout and "top 2 of 4 experts + 1 shared, 1 dense first" in result.stdout, result.stdout
    straight = train(_config(tmp_path / "straight", *MOE_RUN, "train.steps=4"), log=lambda _: None)
    resumed = train(_config(tmp_path / "resumed", *MOE_RUN, "train.steps=4"), log=lambda _: None)
    assert resumed.losses == {step: straight.losses[step] for step in (3, 4)}
    assert resumed.sample == straight.sample
    ours, theirs = load_model(tmp_path / "resumed"), load_model(tmp_path / "straight")
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ours, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(theirs, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    assert not np.any(np.asarray(ours.blocks_from_1.mlp.expert_bias[...]))  # never trained
