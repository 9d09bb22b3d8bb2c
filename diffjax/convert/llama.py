"""Llama's Hugging Face format (transformers' `modeling_llama.py`, model_type "llama") <-> attention "standard", and
what the formats built on Llama's decoder layer share (diffjax.convert.diffllama, .motif): config.json's sizes, RoPE
(the 4.x rope_theta / rope_scaling and the 5.x rope_parameters forms, both read and both written), norms and MLP, a
layer's tensors but its attention, and the settings none of them can hold.

HF rotates q / k with rotate_half RoPE; diffjax keeps unilm's interleaved layout, so the q / k channels are permuted
on the way in and back on the way out (exact: HF -> diffjax -> HF is bit-exact) unless a model keeps rope_style
rotate_half.
"""

from __future__ import annotations

import logging

from diffjax.config import ModelConfig
from diffjax.convert import formats
from diffjax.convert.common import ConversionError
from diffjax.convert.weight_plan import (COPY, TRANSPOSED, Row, causal_lm_plan, interleaved_from_rotate_half, linear,
                                         out_projection)

log = logging.getLogger(__name__)

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}
EXPORT_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}  # (diffjax's -> config.json's)
ROPE_TYPES = ("default", "llama3")
# The block parts of a Llama-style layer: every format built on it holds these only (formats.Configs).
LAYER_KINDS = dict(mlp="gated", residual="plain")


def _rope_fields(hf: dict) -> dict:
    """RoPE settings from either the 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters) form."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    types = {form: d.get("rope_type", d.get("type"))
             for form, d in (("rope_parameters", params), ("rope_scaling", scaling))}
    if None not in types.values() and len(set(types.values())) > 1:
        raise ConversionError(f"config.json: rope_parameters and rope_scaling disagree on rope_type ({types})")
    rope_type = types["rope_scaling"] or types["rope_parameters"] or "default"
    if rope_type not in ROPE_TYPES:
        raise ConversionError(f"config.json: rope_type {rope_type!r} is not supported; supported: 'default', 'llama3'")
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConversionError(f"config.json: partial_rotary_factor={partial} is not supported (diffjax rotates every "
                              "q/k channel)")
    fields = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "llama3":
        try:
            fields.update(
                rope_factor=float(merged["factor"]),
                rope_low_freq_factor=float(merged["low_freq_factor"]),
                rope_high_freq_factor=float(merged["high_freq_factor"]),
                rope_original_max_len=int(merged["original_max_position_embeddings"]),
            )
        except KeyError as missing:
            raise ConversionError(f"config.json: llama3 rope scaling is missing {missing}") from None
    return fields


def config_fields(hf: dict, *, default_eps: float, activations: dict = ACTIVATIONS) -> dict:
    """ModelConfig fields of a Llama-style config.json (heads as config.json counts them); what diffjax cannot express
    raises ConversionError naming the setting and what is allowed."""
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConversionError(f"config.json: {flag}=true is not supported (diffjax layers have no biases)")
    act = hf.get("hidden_act", "silu")
    if act not in activations:
        raise ConversionError(f"config.json: hidden_act {act!r} is not supported; supported: {sorted(activations)}")
    if hf.get("attention_dropout"):
        log.warning("config.json: attention_dropout=%s is a training setting diffjax does not have; the weights "
                    "convert exactly and inference is unaffected", hf["attention_dropout"])
    n_heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=n_heads,
        num_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, mlp_dim=hf["intermediate_size"],
        activation=activations[act], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)), norm_eps=float(hf.get("rms_norm_eps", default_eps)),
        **_rope_fields(hf))
    if hf.get("initializer_range") is not None:
        fields["init_std"] = float(hf["initializer_range"])
    return fields


def _rope_json(config: ModelConfig) -> dict:
    """The 5.x form (rope_parameters) and the 4.x form (rope_theta, rope_scaling), both read by 5.x."""
    scaling = None
    if config.rope_type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": float(config.rope_factor),
            "low_freq_factor": float(config.rope_low_freq_factor),
            "high_freq_factor": float(config.rope_high_freq_factor),
            "original_max_position_embeddings": int(config.rope_original_max_len),
        }
    parameters = {"rope_theta": float(config.rope_theta), **(scaling or {"rope_type": "default"})}
    return {"rope_parameters": parameters, "rope_theta": float(config.rope_theta), "rope_scaling": scaling}


def config_json(config: ModelConfig, *, heads: int, activations: dict = EXPORT_ACTIVATIONS) -> dict:
    """The config.json keys of a Llama-style format; heads: config.json's heads per diffjax head (DiffLlama: 2)."""
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.mlp_dim,
        num_hidden_layers=config.num_layers, num_attention_heads=heads * config.num_heads,
        num_key_value_heads=heads * config.num_kv_heads, head_dim=config.head_dim,
        hidden_act=activations[config.activation], max_position_embeddings=config.max_seq_len,
        rms_norm_eps=float(config.norm_eps), tie_word_embeddings=bool(config.tie_embeddings),
        initializer_range=float(config.init_std), attention_bias=False,
        attention_dropout=0.0,  # diffjax has none (and transformers 5 refuses it for DiffLlama)
        **_rope_json(config))


def export_problems(config: ModelConfig, model_type: str, activations: dict = EXPORT_ACTIVATIONS) -> list[str]:
    """What no Llama-style format can hold (of the configs it holds: LAYER_KINDS)."""
    problems = []
    if config.activation not in activations:
        problems.append(f"activation={config.activation!r}: HF {model_type} exports support {sorted(activations)}")
    if config.attention_window is not None:
        problems.append(f"attention_window={config.attention_window}: HF DiffLlama and Llama attend the whole context "
                        "(they have no sliding window); a model trained with one would compute something else there")
    if config.rope_type not in ROPE_TYPES:
        problems.append(f"rope_type={config.rope_type!r}: HF {model_type} exports write 'default' and 'llama3' RoPE")
    return problems


# ------------------------------------------------------------------------------ weights


def rope_channels(config: ModelConfig):
    """The q / k channel order of the weights in diffjax (None: HF's own, rope_style rotate_half)."""
    return interleaved_from_rotate_half(config.head_dim) if config.rope_style == "interleaved" else None


def _layer_rows(config: ModelConfig, hf: str, leaf) -> list[Row]:
    """A layer's norms and MLP (SwiGLU, or PolyNorm with Motif's act_fn)."""
    D, F = config.d_model, config.mlp_dim
    rows = [Row(hf + "input_layernorm.weight", (D,), (leaf("attn_norm", "scale"),), *COPY),
            Row(hf + "post_attention_layernorm.weight", (D,), (leaf("mlp_norm", "scale"),), *COPY),
            Row(hf + "mlp.gate_proj.weight", (F, D), (leaf("mlp", "gate_kernel"),), *TRANSPOSED),
            Row(hf + "mlp.up_proj.weight", (F, D), (leaf("mlp", "up_kernel"),), *TRANSPOSED),
            Row(hf + "mlp.down_proj.weight", (D, F), (leaf("mlp", "down_kernel"),), *TRANSPOSED)]
    if config.activation == "polynorm":
        rows += [Row(hf + "mlp.act_fn.weight", (3,), (leaf("mlp", "polynorm_weight"),), *COPY),
                 Row(hf + "mlp.act_fn.bias", (1,), (leaf("mlp", "polynorm_bias"),), *COPY)]
    return rows


def plan(config: ModelConfig, attention_rows) -> list[Row]:
    """A Llama-style checkpoint's rows; attention_rows(config, "model.layers.<i>.self_attn.", leaf) gives a layer's
    attention."""
    return causal_lm_plan(config, lambda segment_config, depth, hf, leaf: (
        _layer_rows(segment_config, hf, leaf) + attention_rows(segment_config, hf + "self_attn.", leaf)))


def attention_rows(config: ModelConfig, hf: str, leaf) -> list[Row]:
    """Llama's attention tensors (q, k, v, o projections) of a layer."""
    D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    channels = rope_channels(config)
    return [Row(hf + "q_proj.weight", (H * d, D), (leaf("attn", "q_kernel"),), *linear((H, d), channels)),
            Row(hf + "k_proj.weight", (K * d, D), (leaf("attn", "k_kernel"),), *linear((K, d), channels)),
            Row(hf + "v_proj.weight", (K * d, D), (leaf("attn", "v_kernel"),), *linear((K, d))),
            Row(hf + "o_proj.weight", (D, H * d), (leaf("attn", "o_kernel"),), *out_projection(D, H, d))]


FORMAT = formats.register(formats.CheckpointFormat(
    name="llama", label="Llama", model_type="llama", architecture="LlamaForCausalLM",
    holds=(formats.Configs(attention="standard", **LAYER_KINDS),),
    config_in=lambda hf: {**config_fields(hf, default_eps=1e-6), "attention": "standard"},
    config_out=lambda config: {**config_json(config, heads=1), "mlp_bias": False, "pretraining_tp": 1},
    weight_plan=lambda config: plan(config, attention_rows),
    export_problems=lambda config: export_problems(config, "llama"),
))
