"""Motif Technologies' Hugging Face format (model_type "Motif", read in any case) <-> diffjax: Motif-2.6B (DIFF V1
with PolyNorm MLPs) and Motif-2-12.7B (Grouped Differential Attention). diffjax.convert.hf and .export call these for
that model_type.

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

import numpy as np

from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError
from diffjax.model.rope import interleaved_from_rotate_half

MODEL_TYPE, ARCHITECTURE = "motif", "MotifForCausalLM"
PUBLISHED_MODEL_TYPE = "Motif"  # the spelling of Motif's checkpoints and vLLM's MotifConfig (read in any case)
LAMBDA_INIT_DEPTH_OFFSET = -1  # Motif's lambda_init counts layers from -1
DEFAULT_NORM_EPS = 1e-6


def config_fields(hf: dict) -> dict:
    """ModelConfig fields of a Motif-2 config.json's attention and MLP (the rest is read as for Llama; Motif 3's
    config.json goes to diffjax.convert.motif3 instead)."""
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
        raise ConversionError(f"config.json: num_key_value_heads must be even (pairs of the two maps' heads), got {n_kv}")
    n_signal = n_query - n_noise
    if not 0 < n_noise <= n_signal or n_signal % n_noise:
        raise ConversionError(f"config.json: num_noise_heads ({n_noise}) must divide the signal heads "
                              f"(num_attention_heads - num_noise_heads = {n_signal})")
    fields = dict(num_heads=n_signal, num_kv_heads=n_kv // 2, head_dim=hf.get("head_dim") or hf["hidden_size"] // n_query,
                  lambda_init_depth_offset=LAMBDA_INIT_DEPTH_OFFSET,
                  norm_eps=float(hf.get("rms_norm_eps", DEFAULT_NORM_EPS)))
    if hf.get("attn_rms_norm_eps") is not None:
        fields["subln_eps"] = float(hf["attn_rms_norm_eps"])
    if n_noise == n_signal:
        return {**fields, "attention": "diff"}
    return {**fields, "attention": "gda", "attention_options": {"num_noise_heads": n_noise}}


def export_fields(config: ModelConfig) -> dict:
    """config.json fields of `config` in Motif's terms."""
    H, N = config.num_heads, noise_heads(config)
    return dict(num_attention_heads=H + N, num_noise_heads=N, num_key_value_heads=2 * config.num_kv_heads,
                attn_rms_norm_eps=config.subln_norm_eps, use_bias=False, k_ratio=1)


def export_problems(config: ModelConfig) -> list[str]:
    problems = []
    if config.lambda_init is not None or config.lambda_init_depth_offset != LAMBDA_INIT_DEPTH_OFFSET:
        problems.append(
            f"lambda_init={config.lambda_init}, lambda_init_depth_offset={config.lambda_init_depth_offset}: Motif's "
            "code always uses lambda_init = 0.8 - 0.6 exp(-0.3 (layer_idx - 1)); only lambda_init=None with "
            f"lambda_init_depth_offset={LAMBDA_INIT_DEPTH_OFFSET} can be exported to it")
    return problems


def noise_heads(config: ModelConfig) -> int:
    if config.attention == "gda":  # (Motif's format is GDA's: it reads GDA's own options)
        return config.attention_options.num_noise_heads
    return config.num_heads  # DIFF V1: one noise head per signal head


# ------------------------------------------------------------------------------ weights


def _channels(w, axis, permute):
    return np.take(w, interleaved_from_rotate_half(w.shape[axis]), axis=axis) if permute else w


def q_from_hf(w, config, permute):
    """(N (G + 1) d, D) rows [group, head in group, channel] -> (D, N, G + 1, d), channels interleaved."""
    N, d = noise_heads(config), config.head_dim
    return _channels(w.reshape(N, config.num_heads // N + 1, d, -1), 2, permute).transpose(3, 0, 1, 2)


def k_from_hf(w, config, permute):
    """(2 Hkv d, D) rows [kv head, map, channel] -> (D, Hkv, 2, d)."""
    return _channels(w.reshape(config.num_kv_heads, 2, config.head_dim, -1), 2, permute).transpose(3, 0, 1, 2)


def v_from_hf(w, config):
    """(2 Hkv d, D) rows [kv head, map, channel] -> (D, Hkv, 2d): kv head m's value is [v_2m | v_2m+1]."""
    return w.reshape(config.num_kv_heads, 2 * config.head_dim, -1).transpose(2, 0, 1)


def qk_to_hf(w, permute):
    """q (D, N, G + 1, d) or k (D, Hkv, 2, d) -> HF rows; the inverse of q_from_hf / k_from_hf."""
    D, d = w.shape[0], w.shape[-1]
    w = w.transpose(1, 2, 3, 0)
    if permute:
        w = np.take(w, np.argsort(interleaved_from_rotate_half(d)), axis=2)
    return w.reshape(-1, D)


def v_to_hf(w):
    return w.transpose(1, 2, 0).reshape(-1, w.shape[0])


def attention_rows(config: ModelConfig, hf_prefix: str, path: tuple, permute: bool) -> list:
    """weight_table rows of one layer's attention: (hf key, hf shape, diffjax path, transform)."""
    D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    N = noise_heads(config)
    return [
        (hf_prefix + "q_proj.weight", ((H + N) * d, D), path + ("q_kernel",), lambda w: q_from_hf(w, config, permute)),
        (hf_prefix + "k_proj.weight", (2 * K * d, D), path + ("k_kernel",), lambda w: k_from_hf(w, config, permute)),
        (hf_prefix + "v_proj.weight", (2 * K * d, D), path + ("v_kernel",), lambda w: v_from_hf(w, config)),
        (hf_prefix + "o_proj.weight", (D, 2 * H * d), path + ("o_kernel",), lambda w: w.T.reshape(H, 2 * d, D)),
        (hf_prefix + "subln.weight", (2 * d,), path + ("subln_scale",), None),
    ] + [(hf_prefix + name, (d,), path + (name,), None) for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]


def attention_inverse(name: str, get, permute: bool):
    """A function producing the HF tensor of the attention parameter `name` (get() reads it)."""
    if name in ("q_kernel", "k_kernel"):
        return lambda: qk_to_hf(get(), permute)
    if name == "v_kernel":
        return lambda: v_to_hf(get())
    if name == "o_kernel":
        return lambda: (w := get()).reshape(-1, w.shape[-1]).T
    return get  # subln scale, lambda vectors
