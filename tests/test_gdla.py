"""GDLA (Motif 3's Grouped Differential Latent Attention) against the PyTorch re-statement's MotifGDLAttention
(tests/motif3_reference.py), the reference's weights copied in: outputs and gradients on a global (YaRN) and a
windowed layer with the output gate, the window and YaRN each on and off; YaRN's frequencies against transformers';
mutations that must fail (the noise head paired with the wrong group, YaRN's factor on cos / sin instead of the
softmax scale, the window one key off); a KV-cache decode against the full forward; the ops route of the published
shapes on h100 and v5p, and the memory of a published-size layer's gradient on an h100 (linear in T)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import attention_kinds
from diffjax.config import ModelConfig
from diffjax.model import TransformerLM
from diffjax.model.attention.gdla import GroupedDiffLatentAttention
from diffjax.model.kv_cache import KVCache
from diffjax.model.rope import inv_frequencies, layer_rope_tables, rope_tables, window_inv_frequencies
from diffjax.ops import DEVICES, choose, simulated_device
from diffjax.model.sizes import attention_calls

from motif3_published import PUBLISHED, checkpoint_shapes, small_config

try:  # the reference needs torch and transformers (the newest-jax leg has neither): the rest runs without them
    import torch
    import transformers  # noqa: F401

    from motif3_reference import Motif3Config, MotifGDLAttention, _draw
except ImportError:
    torch = None
needs_reference = pytest.mark.skipif(torch is None, reason="the PyTorch reference needs torch and transformers")

T = 20
X = np.random.RandomState(1).randn(2, T, 32).astype(np.float32)


def gdla_config(motif: dict, **overrides) -> ModelConfig:
    """The attention half of a Motif 3 config.json as a ModelConfig (what the converter will read): a windowed
    query sees sliding_window + 1 keys, itself included; YaRN's softmax factor where the reference applies it."""
    rope = motif.get("rope_parameters") or motif.get("rope_scaling") or {}
    yarn = rope if rope.get("rope_type", rope.get("type")) == "yarn" else None
    windowed = [i for i in range(motif["num_hidden_layers"]) if motif.get("use_sliding_window")
                and (motif["sliding_window_pattern"] == "all" or i % motif["sliding_window_period"])]
    stretched = motif["max_position_embeddings"] > motif["original_seq_len"]
    assert not stretched or (yarn and yarn["factor"] == motif["rope_factor"]), "no ModelConfig spelling for this"
    return ModelConfig(**{**dict(
        vocab_size=motif["vocab_size"], d_model=motif["hidden_size"], num_layers=motif["num_hidden_layers"],
        num_heads=motif["num_attention_heads"], num_kv_heads=motif["num_key_value_heads"], head_dim=motif["head_dim"],
        attention="gdla", attention_options=dict(
            q_lora_rank=motif["q_lora_rank"], kv_lora_rank=motif["kv_lora_rank"],
            qk_rope_head_dim=motif["qk_rope_head_dim"], v_head_dim=motif["v_head_dim"],
            num_noise_heads=motif["num_noise_heads"], output_gate=motif["elementwise_attn_output_gate"]),
        norm_eps=motif["rms_norm_eps"], rope_style="rotate_half", rope_theta=motif["rope_theta"],
        **(dict(rope_type="yarn", rope_factor=yarn["factor"],
                rope_original_max_len=yarn["original_max_position_embeddings"], rope_beta_fast=yarn["beta_fast"],
                rope_beta_slow=yarn["beta_slow"],
                rope_mscale=motif["mscale"] if stretched else None) if yarn else {}),
        attention_window=motif["sliding_window"] + 1 if windowed else None,
        global_layers=[i for i in range(motif["num_hidden_layers"]) if i not in windowed] if windowed else [],
        window_rope_theta=motif.get("swa_rope_theta") if windowed else None,
        max_seq_len=motif["max_position_embeddings"], attention_impl="xla"), **overrides})


def reference_layer(motif: dict, layer: int, seed: int = 0) -> MotifGDLAttention:
    torch.manual_seed(seed)
    ref = MotifGDLAttention(Motif3Config(**motif), layer)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(_draw(name, param))
    return ref


def diffjax_layout(state_dict: dict, config: ModelConfig) -> dict:
    """The reference's (checkpoint's) attention tensors as GDLA's kernels: transposes and reshapes only."""
    o, D, H, K, d = config.attention_options, config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    S, dv = H - o.num_noise_heads, o.v_head_dim
    w = {name: np.asarray(value) for name, value in state_dict.items()}
    kernels = {
        "q_down_kernel": w["wq_a.weight"].T, "q_norm_scale": w["q_norm.weight"],
        "q_up_kernel": w["wq_b.weight"].reshape(H, d, -1).transpose(2, 0, 1),
        "kv_down_kernel": w["wkv_a.weight"].T, "kv_norm_scale": w["kv_norm.weight"],
        "kv_up_kernel": w["wkv_b.weight"].reshape(K, o.qk_nope_head_dim + dv, -1).transpose(2, 0, 1),
        "lambda_kernel": w["lambda_proj.weight"].T, "o_kernel": w["wo.weight"].reshape(D, S, dv).transpose(1, 2, 0),
    }
    if "wq_b_gate.weight" in w:
        kernels["gate_kernel"] = w["wq_b_gate.weight"].reshape(S, dv, -1).transpose(2, 0, 1)
    return kernels


def ported(ref: MotifGDLAttention, config: ModelConfig) -> GroupedDiffLatentAttention:
    module = GroupedDiffLatentAttention(config, rngs=nnx.Rngs(0))
    sd = {name: value.detach().numpy() for name, value in ref.state_dict().items()}
    for name, value in diffjax_layout(sd, config).items():
        assert getattr(module, name).shape == value.shape, name
        getattr(module, name)[...] = jnp.asarray(value)
    return module


def run(module, layer: int, x=X, rope=None):
    config = module.config
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    rope = layer_rope_tables(config, positions, jnp.float32) if rope is None else rope
    constants = {"global_attention": layer in config.global_layers} if config.mixes_windows else {}
    return module(jnp.asarray(x), rope, constants=constants)


def reference_out(ref, x=X):
    return ref(torch.tensor(x), torch.arange(x.shape[1])).detach().numpy()


def relative(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


CASES = {  # (variant of tests/motif3_published.py, layer): layer 0 global (YaRN), layer 1 windowed
    "global_yarn": ("all_on", 0), "windowed": ("all_on", 1), "global_gate_off": ("gate_off", 0),
    "windowed_gate_off": ("gate_off", 1), "window_off": ("window_off", 1), "yarn_off": ("yarn_off", 0),
    "windowed_yarn_off": ("yarn_off", 1),
    # windowed layers without their own theta rotate with the global (YaRN) frequencies, still without mscale
    "windowed_global_rope": ("all_on", 3),
}


def case_config(case: str) -> dict:
    variant, _ = CASES[case]
    return small_config(variant, **({"swa_rope_theta": None} if case == "windowed_global_rope" else {}))


@needs_reference
@pytest.mark.parametrize("case", CASES)
def test_output_and_gradients_match_the_reference(case, measured):
    motif, layer = case_config(case), CASES[case][1]
    ref = reference_layer(motif, layer)
    config = gdla_config(motif)
    module = ported(ref, config)
    assert (ref.window is None) == (config.window_at(layer) is None)
    difference = relative(run(module, layer), reference_out(ref))
    assert measured(f"GDLA output vs reference ({case})", difference, 1e-5) <= 1e-5
    # Gradients of <out, cotangent> for every parameter and the input.
    cotangent = np.random.RandomState(2).randn(*X.shape).astype(np.float32)
    x_torch = torch.tensor(X, requires_grad=True)
    (ref(x_torch, torch.arange(T)) * torch.tensor(cotangent)).sum().backward()
    expected = diffjax_layout({name: p.grad.numpy() for name, p in ref.named_parameters()}, config)

    def loss(module, x):
        return jnp.sum(run(module, layer, x) * cotangent)

    grads, grad_x = nnx.grad(loss, argnums=(0, 1))(module, jnp.asarray(X))
    worst = max(relative(getattr(grads, name)[...], value) for name, value in expected.items())
    worst = max(worst, relative(grad_x, x_torch.grad.numpy()))
    assert measured(f"GDLA gradients vs reference ({case})", worst, 1e-4) <= 1e-4


@needs_reference
def test_yarn_frequencies_equal_transformers_and_the_reference():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from motif3_reference import rope_inv_freq

    for motif in (PUBLISHED, small_config()):
        rope = motif["rope_scaling"]
        hf = LlamaConfig(head_dim=motif["qk_rope_head_dim"], hidden_size=64, num_attention_heads=4,
                         max_position_embeddings=motif["max_position_embeddings"],
                         rope_parameters={**rope, "rope_theta": motif["rope_theta"]})
        expected, _ = _compute_yarn_parameters(hf)
        config = gdla_config(motif)
        ours = inv_frequencies(config)
        np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6, atol=0)
        np.testing.assert_allclose(ours, rope_inv_freq(motif["qk_rope_head_dim"], motif["rope_theta"], rope).numpy(),
                                   rtol=1e-6, atol=0)
        # The windowed layers: plain frequencies with their own theta.
        d, theta = motif["qk_rope_head_dim"], motif["swa_rope_theta"]
        np.testing.assert_allclose(window_inv_frequencies(config), theta ** -(np.arange(0, d, 2) / d), rtol=1e-6)
    # The softmax factor of the published config: (0.1 ln 64 + 1)^2 on the global layers, none on windowed ones.
    layer = GroupedDiffLatentAttention
    config = gdla_config(PUBLISHED)
    module = nnx.eval_shape(lambda: layer(config, rngs=nnx.Rngs(0)))
    assert module.global_scale(192) == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2, rel=1e-12)
    assert float(module.softmax_scale(192, {"global_attention": False})) == pytest.approx(192 ** -0.5, rel=1e-7)


def _mutated_output(case: str, mutate) -> tuple[float, float]:
    """(relative difference to the reference, before and after `mutate(module, config) -> output`)."""
    motif, layer = case_config(case), CASES[case][1]
    ref = reference_layer(motif, layer)
    config = gdla_config(motif)
    module = ported(ref, config)
    want = reference_out(ref)
    return relative(run(module, layer), want), relative(mutate(module, config, layer), want)


@needs_reference
def test_mutations_fail():
    # The noise head of the next group (groups rolled by one).
    def wrong_group(module, config, layer):
        split = module.signal_and_noise
        module.signal_and_noise = lambda x, axis=2: (split(x, axis)[0], jnp.roll(split(x, axis)[1], 4, axis=axis))
        return run(module, layer)

    # YaRN's factor on cos / sin (sqrt on each side of q k^T) instead of on the softmax scale.
    def mscale_on_cos_sin(module, config, layer):
        plain = config.replace(rope_mscale=None)
        module.config = plain
        factor = math.sqrt((0.1 * math.log(config.rope_factor) + 1) ** 2)
        cos, sin = rope_tables(jnp.broadcast_to(jnp.arange(T), (2, T)), inv_frequencies(plain), jnp.float32)
        return run(module, layer, rope=(cos * factor, sin * factor))

    # A window of sliding_window keys (the query itself counted among them): one key short.
    def window_one_short(module, config, layer):
        module.config = config.replace(attention_window=config.attention_window - 1)
        return run(module, layer)

    for case, mutate in (("global_yarn", wrong_group), ("global_yarn", mscale_on_cos_sin),
                         ("windowed", window_one_short)):
        exact, mutated = _mutated_output(case, mutate)
        assert exact <= 1e-5 and mutated > 1e-3, (mutate.__name__, exact, mutated)


def small_lm(**overrides) -> TransformerLM:
    config = gdla_config(small_config(), **overrides)
    return nnx.jit(lambda: TransformerLM(config.replace(init_std=0.2), rngs=nnx.Rngs(0)))()


@pytest.mark.slow
def test_kv_cache_decode_equals_the_full_forward(measured):
    """Prefill 7 tokens, then 6 decode steps one token at a time: each step's logits equal the full forward's at
    that position (windowed layers read their 4 latest keys, global layers all; YaRN's factor on global ones)."""
    model = small_lm()
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, 97, (2, 13)))
    full = model(tokens)
    logits, cache = model(tokens[:, :7], cache=KVCache.empty(2, 16), layer_params=model.unstacked_blocks())
    steps = [logits]
    for t in range(7, 13):
        logits, cache = model(tokens[:, t:t + 1], cache=cache, layer_params=model.unstacked_blocks())
        steps.append(logits)
    worst = relative(jnp.concatenate(steps, axis=1), full)
    assert measured("GDLA KV-cache decode vs full forward", worst, 1e-5) <= 1e-5


@pytest.mark.slow
def test_scanned_stack_equals_layer_by_layer(measured):
    """The stack (scanned: each layer's window flag and RoPE table picked at run time) equals the layers run one by
    one as standalone blocks (a Python flag each, the path the reference comparison above checks)."""
    model = small_lm(scan_layers=True)
    tokens = jnp.asarray(np.random.RandomState(4).randint(0, 97, (2, 12)))
    config = model.config
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
    x = model.embed(tokens, jnp.float32)
    for depth in range(config.num_layers):
        x = model.layer(depth)(x, layer_rope_tables(config, positions, jnp.float32))
    expected = model.logits(model.final_norm(x))
    assert measured("GDLA scanned stack vs layer by layer", relative(model(tokens), expected), 1e-5) <= 1e-5


def test_parameter_count_matches_the_checkpoint_and_the_module():
    """The row's count against the published checkpoint's attention tensors (tests/motif3_published.py) and the
    built module, at the small and the published size."""
    for motif in (small_config(), small_config("gate_off"), PUBLISHED):
        config = gdla_config(motif)
        shapes = checkpoint_shapes(motif)
        expected = sum(math.prod(shape) for name, shape in shapes.items()
                       if name.startswith("model.layers.0.self_attn."))
        assert attention_kinds.get("gdla").attention_params(config) == expected
        module = nnx.eval_shape(lambda: GroupedDiffLatentAttention(config, rngs=nnx.Rngs(0)))
        assert sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param))) == expected


def test_bad_options_and_rope_fields_get_one_line_each():
    base = gdla_config(small_config())
    for changes, message in (
        (dict(attention_options={"qk_nope_head_dim": 4, "qk_rope_head_dim": 8}), r"qk_nope_head_dim \(4\) \+ "
         r"qk_rope_head_dim \(8\) must equal head_dim \(16\)"),
        (dict(attention_options={"num_noise_heads": 10}), r"num_noise_heads \(10\) must divide num_heads \(10\) into "
         "groups of at least 2"),
        (dict(attention_options={"num_noise_heads": 3}), r"num_noise_heads \(3\) must divide"),
        (dict(attention_options={"qk_rope_head_dim": 5, "qk_nope_head_dim": 11}), "qk_rope_head_dim must be even"),
        (dict(attention_options={"output_gate": "maybe"}), "output_gate must be true or false"),
        (dict(rope_type="default"), "rope_mscale is YaRN's"),
        (dict(rope_beta_slow=40.0), "yarn RoPE needs 0 < rope_beta_slow < rope_beta_fast"),
        (dict(attention_window=None, global_layers=[]), "window_rope_theta 500.0 needs an attention_window"),
        (dict(window_rope_theta=-1.0), "window_rope_theta must be None"),
    ):
        with pytest.raises(ValueError, match=message) as error:
            base.replace(**changes)
        assert "\n" not in str(error.value)


def test_ops_route_of_the_published_shapes():
    """The published attention (bf16, T = 4096): on a v5p the fused Pallas TPU kernel takes every layer, on an H100
    the fused Mosaic GPU kernels (scores 192 wide, values 128, the window, packed rows: pallas_gpu's single-map mode;
    the cuDNN composition cannot take values narrower than the keys, triton d > 128); a decode step is XLA
    everywhere."""
    config = gdla_config(PUBLISHED, dtype="bfloat16", param_dtype="bfloat16", attention_impl="auto")
    calls = attention_calls(config, 4096)
    assert [what for what, _ in calls] == [
        "train step (packed rows) (global layers)", "generation prefill (global layers)",
        "train step (packed rows) (windowed layers)", "generation prefill (windowed layers)", "generation decode step"]
    for _, call in calls:
        assert call.op == "dot_product_attention" and call.q_shape[-1] == 192 and call.v_shape[-1] == 128
        assert call.q_shape[2] == 80 and call.k_shape[2] == 16
    windows = [call.window for _, call in calls]
    assert windows == [None, None, 129, 129, None]
    v5p = [choose(call, "auto", DEVICES["v5p"]) for _, call in calls]
    assert [r.impl for r in v5p] == ["pallas_tpu"] * 4 + ["xla"]
    h100 = [choose(call, "auto", DEVICES["h100"]) for _, call in calls]
    assert [(r.impl, r.blockwise) for r in h100] == [("pallas_gpu", False)] * 4 + [("xla", False)]
    assert "decode" in h100[4].reason and "decode" in v5p[4].reason
    with pytest.raises(ValueError, match="impl='cudnn' needs the value width \\(128\\) to be a multiple of the q/k head dim"):
        choose(calls[1][1], "cudnn", DEVICES["h100"])


@pytest.mark.parametrize("context", [1, 2])
def test_the_shipped_config_previews_no_xla_call_but_decode_on_an_h100(context):
    """`diffjax-train --routes --config motif3/published --device h100 [parallel.context=2]`'s routes: the train step and
    the prefill, windowed and global layers, run the fused kernels (per query chunk over a context axis)."""
    from diffjax.train.cli import main
    from diffjax.train.config import load_run_config

    run = load_run_config("motif3/published", [])
    calls = attention_calls(run.model, run.data.seq_len, context)
    routes = {what: choose(call, run.model.attention_impl, DEVICES["h100"]) for what, call in calls}
    assert len(routes) == 5
    for what, route in routes.items():
        expected = ("xla", False) if "decode" in what else ("pallas_gpu", context > 1 and "train" in what)
        assert (route.impl, route.context) == expected and not route.blockwise, (what, route)
    assert main(["--routes", "--config", "motif3/published", "--device", "h100", f"parallel.context={context}"]) == 0


def _equations(jaxpr):
    """Every equation of jaxpr and its sub-jaxprs (cond branches, loops, custom VJPs, kernel bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _equations(sub)


@pytest.mark.parametrize("T", [6144, 32768])
def test_a_published_layers_gradient_on_an_h100_holds_nothing_t_by_s(T):
    """Memory linear in T: one published-size GDLA layer's loss gradient on packed rows, its windowed or global call
    picked at run time (a scanned stack's traced flag), traced as routed on an H100 (nothing runs): both calls run the
    fused Mosaic GPU kernels, forward and backward, and no intermediate has two axes as long as the sequence (T above
    d_model, 4096). Before the kernels took d 192 / dv 128 and the window, the global call's XLA path held [.., T, T]
    scores below BLOCKWISE_FROM (8192) and ran XLA blockwise above."""
    config = gdla_config(PUBLISHED, dtype="bfloat16", param_dtype="bfloat16", attention_impl="auto")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GroupedDiffLatentAttention(config, rngs=nnx.Rngs(0))))

    def loss(state, x_BTD, segment_ids, windowed):
        rope = layer_rope_tables(config, jnp.arange(T)[None], x_BTD.dtype)
        out = nnx.merge(graphdef, state)(x_BTD, rope, segment_ids, constants={"global_attention": ~windowed})
        return jnp.sum(out.astype(jnp.float32))

    args = (jax.ShapeDtypeStruct((1, T, config.d_model), jnp.bfloat16), jax.ShapeDtypeStruct((1, T), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.bool_))
    with simulated_device(DEVICES["h100"]):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, *args).jaxpr
    equations = list(_equations(jaxpr))
    long = [(eqn.primitive.name, var.aval.shape) for eqn in equations for var in eqn.outvars
            if sum(n >= T for n in getattr(var.aval, "shape", ())) >= 2]
    assert not long, f"intermediates T x S in size: {long[:5]}"
    kernels = [str(eqn.params.get("name")) for eqn in equations if str(eqn.params.get("name")).startswith("diffjax_mgpu")]
    assert sorted(kernels) == sorted(f"diffjax_mgpu_single_{k}" for k in ("fwd", "bwd_dq", "bwd_dkdv") * 2), kernels


@pytest.mark.slow
def test_fused_pallas_tpu_kernel_takes_gdla_shapes(measured):
    """The fused Pallas TPU kernel (interpreted here) on GDLA's scores d wide and values dv < d wide, windowed and
    global, equals the XLA reference, forward and backward (the input's gradient)."""
    config = gdla_config(small_config(), init_std=0.2)
    cotangent = np.random.RandomState(2).randn(*X.shape).astype(np.float32)
    for layer in (0, 1):
        xla = GroupedDiffLatentAttention(config, rngs=nnx.Rngs(0))
        fused = GroupedDiffLatentAttention(config.replace(attention_impl="pallas_tpu"), rngs=nnx.Rngs(0))
        worst = relative(run(fused, layer), run(xla, layer))
        assert measured(f"GDLA pallas_tpu vs xla (layer {layer})", worst, 1e-5) <= 1e-5
        grads = [jax.grad(lambda x, m=m: jnp.sum(run(m, layer, x) * cotangent))(jnp.asarray(X)) for m in (fused, xla)]
        assert measured(f"GDLA pallas_tpu vs xla, gradient (layer {layer})", relative(*grads), 1e-4) <= 1e-4


def test_hf_export_refuses_yarn_rope(tmp_path):
    """The Llama / DiffLlama exports write default and llama3 RoPE only: a YaRN model is refused, not exported
    as plain RoPE."""
    import diffjax
    from diffjax.convert.common import ConversionError

    config = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, attention="standard", rope_type="yarn",
                         rope_original_max_len=16, max_seq_len=64)
    with pytest.raises(ConversionError, match="rope_type='yarn': HF llama exports write 'default' and 'llama3' RoPE"):
        diffjax.save_hf(TransformerLM(config, rngs=nnx.Rngs(0)), tmp_path / "hf")
