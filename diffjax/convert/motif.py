"""Motif Technologies' Hugging Face format (model_type "Motif", read in any case) <-> diffjax: Motif-2.6B (DIFF V1
with PolyNorm MLPs) and Motif-2-12.7B (Grouped Differential Attention), the format row "motif": the plain format of
model_type "motif" (Motif 3's config.json, recognised by its own keys, is diffjax.convert.motif3's). The rest of the
layer is Llama's (diffjax.convert.llama).

What the checkpoints compute is what their serving code computes: vLLM's `model_executor/models/motif.py` (Motif's
fork MotifTechnologies/vllm, branch `motif`, with `v1/attention/backends/grouped_diff_attn.py` and PolyNorm in
`layers/layernorm.py`; the model repositories' own `modeling_motif.py` was not reachable). In its terms:
  num_attention_heads  query heads of head_dim d, signal and noise: H + N (DIFF V1: 2H, half-heads)
  num_noise_heads      N (absent: half the query heads, which is DIFF V1); q_proj rows in N groups of H / N signal
                       heads then one noise head (V1: even half-heads signal, odd noise)
  num_key_value_heads  2 Hkv half-heads: k_proj / v_proj rows alternate the two maps' heads (k1, k2 = even, odd)
  o_proj               input 2 d per signal head; `self_attn.subln.weight` [2d] with eps attn_rms_norm_eps
  lambda_init          0.8 - 0.6 exp(-0.3 (layer_idx - 1)): ModelConfig.lambda_init_depth_offset = -1
  hidden_act poly_norm PolyNorm with `mlp.act_fn.weight` [3] and `mlp.act_fn.bias` [1]; RoPE rotate-half (NeoX)
A config with N = H loads as attention "diff" (V1's kernels and analyses), any other N as "gda".
"""

from __future__ import annotations

from diffjax.config import ModelConfig
from diffjax.convert import formats, llama
from diffjax.convert.common import ConversionError
from diffjax.convert.weight_plan import COPY, Row, linear, out_projection

MODEL_TYPE, ARCHITECTURE = "motif", "MotifForCausalLM"
PUBLISHED_MODEL_TYPE = "Motif"  # the spelling of Motif's checkpoints and vLLM's MotifConfig (read in any case)
LAMBDA_INIT_DEPTH_OFFSET = -1  # Motif's lambda_init counts layers from -1
DEFAULT_NORM_EPS = 1e-6
ACTIVATIONS = {**llama.ACTIVATIONS, "poly_norm": "polynorm"}
EXPORT_ACTIVATIONS = {**llama.EXPORT_ACTIVATIONS, "polynorm": "poly_norm"}


def _attention_fields(hf: dict) -> dict:
    """ModelConfig fields of a Motif-2 config.json's attention (heads, noise heads, lambda schedule, per-head norm)."""
    for flag in ("use_bias", "qkv_bias"):
        if hf.get(flag):
            raise ConversionError(f"config.json: {flag}=true is not supported (diffjax layers have no biases)")
    if hf.get("use_sliding_window"):
        raise ConversionError("config.json: use_sliding_window=true is not supported for Motif (its serving code "
                              "attends the whole context)")
    if hf.get("k_ratio", 1) != 1:
        raise ConversionError(f"config.json: k_ratio={hf['k_ratio']} is not supported (Motif's serving code uses 1)")
    n_query, n_kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    n_noise = hf.get("num_noise_heads")
    if n_noise is None:
        if n_query % 2:
            raise ConversionError(f"config.json: num_attention_heads ({n_query}) must be even without num_noise_heads "
                                  "(half the query heads are noise heads)")
        n_noise = n_query // 2
    elif hf.get("head_dim") is None:
        raise ConversionError("config.json: num_noise_heads needs head_dim (as Motif's serving code requires)")
    if n_kv % 2:
        raise ConversionError(f"config.json: num_key_value_heads must be even (pairs of the two maps' heads), "
                              f"got {n_kv}")
    n_signal = n_query - n_noise
    if not 0 < n_noise <= n_signal or n_signal % n_noise:
        raise ConversionError(f"config.json: num_noise_heads ({n_noise}) must divide the signal heads "
                              f"(num_attention_heads - num_noise_heads = {n_signal})")
    fields = dict(num_heads=n_signal, num_kv_heads=n_kv // 2,
                  head_dim=hf.get("head_dim") or hf["hidden_size"] // n_query,
                  lambda_init_depth_offset=LAMBDA_INIT_DEPTH_OFFSET)
    if hf.get("attn_rms_norm_eps") is not None:
        fields["subln_eps"] = float(hf["attn_rms_norm_eps"])
    if n_noise == n_signal:
        return {**fields, "attention": "diff"}
    return {**fields, "attention": "gda", "attention_options": {"num_noise_heads": n_noise}}


def config_fields(hf: dict) -> dict:
    """ModelConfig fields of a Motif-2 config.json (dtypes aside)."""
    return {**llama.config_fields(hf, default_eps=DEFAULT_NORM_EPS, activations=ACTIVATIONS), **_attention_fields(hf)}


def _config_out(config: ModelConfig) -> dict:
    """config.json of `config` in Motif's terms."""
    H, N = config.num_heads, noise_heads(config)
    return {**llama.config_json(config, heads=1, activations=EXPORT_ACTIVATIONS),
            **dict(num_attention_heads=H + N, num_noise_heads=N, num_key_value_heads=2 * config.num_kv_heads,
                   attn_rms_norm_eps=config.subln_norm_eps, use_bias=False, k_ratio=1)}


# DIFF V1 with PolyNorm or Motif's lambda schedule (DiffLlama holds neither), and GDA
HOLDS = (formats.Configs(attention="diff", activation="polynorm", **llama.LAYER_KINDS),
         formats.Configs(attention="diff", activation=formats.Not("polynorm"),
                         lambda_init_depth_offset=formats.Not(0), **llama.LAYER_KINDS),
         formats.Configs(attention="gda", **llama.LAYER_KINDS))


def export_problems(config: ModelConfig) -> list[str]:
    problems = [] if config.subln else [f"subln=false: HF {MODEL_TYPE} always normalizes each head's output"]
    if config.lambda_init is not None or config.lambda_init_depth_offset != LAMBDA_INIT_DEPTH_OFFSET:
        problems.append(
            f"lambda_init={config.lambda_init}, lambda_init_depth_offset={config.lambda_init_depth_offset}: Motif's "
            "code always uses lambda_init = 0.8 - 0.6 exp(-0.3 (layer_idx - 1)); only lambda_init=None with "
            f"lambda_init_depth_offset={LAMBDA_INIT_DEPTH_OFFSET} can be exported to it")
    return problems + llama.export_problems(config, MODEL_TYPE, EXPORT_ACTIVATIONS)


def noise_heads(config: ModelConfig) -> int:
    if config.attention == "gda":  # (Motif's format is GDA's: it reads GDA's own options)
        return config.attention_options.num_noise_heads
    return config.num_heads  # DIFF V1: one noise head per signal head


# ------------------------------------------------------------------------------ weights


def attention_rows(config: ModelConfig, hf: str, leaf) -> list[Row]:
    """A layer's attention: q rows [group, head in group (signal heads, then the noise head), channel], k and v rows
    [kv head, map, channel] (V1: even half-heads signal, odd noise), o_proj, the per-head norm and lambda vectors."""
    D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    N, channels = noise_heads(config), llama.rope_channels(config)
    return [
        Row(hf + "q_proj.weight", ((H + N) * d, D), (leaf("attn", "q_kernel"),), *linear((N, H // N + 1, d), channels)),
        Row(hf + "k_proj.weight", (2 * K * d, D), (leaf("attn", "k_kernel"),), *linear((K, 2, d), channels)),
        Row(hf + "v_proj.weight", (2 * K * d, D), (leaf("attn", "v_kernel"),), *linear((K, 2 * d))),
        Row(hf + "o_proj.weight", (D, 2 * H * d), (leaf("attn", "o_kernel"),), *out_projection(D, H, 2 * d)),
        Row(hf + "subln.weight", (2 * d,), (leaf("attn", "subln_scale"),), *COPY),
    ] + [Row(hf + name, (d,), (leaf("attn", name),), *COPY)
         for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]


FORMAT = formats.register(formats.CheckpointFormat(
    name="motif", label="Motif", model_type=MODEL_TYPE, architecture=ARCHITECTURE,
    holds=HOLDS, config_in=config_fields, config_out=_config_out,
    weight_plan=lambda config: llama.plan(config, attention_rows), export_problems=export_problems,
    spelling=PUBLISHED_MODEL_TYPE, remote_code=True,
))
