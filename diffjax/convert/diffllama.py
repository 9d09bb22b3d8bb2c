"""Hugging Face DiffLlama (transformers' `modeling_diffllama.py`, model_type "diffllama") <-> attention "diff" (DIFF
V1) with a SwiGLU-style MLP and the paper's lambda schedule (Motif's MLP or schedule is diffjax.convert.motif's).
The rest of the layer is Llama's (diffjax.convert.llama).

HF counts a differential head's two maps as sub-heads and orders them as halves (sub-heads j and j + nH/2 of q_proj's
rows are one head's two maps); diffjax keeps unilm's interleaved layout, so loading regroups the heads (and permutes the
q / k channels: llama.py). DiffLlama's per-head norm has no weight: the import sets diffjax's subln scale to ones and
the export folds it into o_proj's columns (exact: the norm is per head; exact in value when the scale is ones, as in
every model imported from HF, equal up to rounding otherwise).
"""

from __future__ import annotations

import numpy as np

from diffjax.config import ModelConfig, lambda_init_for_depth
from diffjax.convert import formats, llama
from diffjax.convert.common import ConversionError
from diffjax.convert.weight_plan import COPY, Row

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _config_in(hf: dict) -> dict:
    fields = llama.config_fields(hf, default_eps=1e-5)
    n_heads, n_kv = fields["num_heads"], fields["num_kv_heads"]
    if n_heads % 2 or n_kv % 2:  # HF counts DiffLlama's sub-heads: two per differential head
        raise ConversionError(f"config.json: DiffLlama needs even num_attention_heads and num_key_value_heads "
                              f"(sub-heads come in pairs), got {n_heads} and {n_kv}")
    fields.update(attention="diff", num_heads=n_heads // 2, num_kv_heads=n_kv // 2)
    if hf.get("lambda_std_dev") is not None:
        fields["lambda_std"] = float(hf["lambda_std_dev"])
    return fields


def _export_problems(config: ModelConfig) -> list[str]:
    problems = [] if config.subln else ["subln=false: HF diffllama always normalizes each head's output"]
    if config.subln_eps not in (None, config.norm_eps):
        problems.append(f"subln_eps={config.subln_eps}: HF DiffLlama's per-head norm uses rms_norm_eps "
                        f"(norm_eps={config.norm_eps})")
    if config.lambda_init is not None:
        schedule = [lambda_init_for_depth(i) for i in range(config.num_layers)]
        if any(abs(config.lambda_init - value) > 1e-12 for value in schedule):
            problems.append(
                f"lambda_init={config.lambda_init} (one constant for every layer): HF DiffLlama always uses "
                "lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx); only lambda_init=None (that schedule) can be exported")
    return problems + llama.export_problems(config, "diffllama")


# ------------------------------------------------------------------------------ weights


def _qk(n: int, d: int, channels):
    """(2 n d, D) rows [map * n + head, channel] <-> (D, n, 2, d), channels in diffjax's order."""
    inverse = None if channels is None else np.argsort(channels)

    def to_ours(w):
        w = w.reshape(2, n, d, -1)
        return ((w if channels is None else w[:, :, channels, :]).transpose(3, 1, 0, 2),)

    def to_hf(w):
        w = w.transpose(2, 1, 3, 0)
        return (w if inverse is None else w[:, :, inverse, :]).reshape(2 * n * d, -1)

    return to_ours, to_hf


def _v(n_kv: int, d: int):
    """(2 Hkv d, D) rows [half * Hkv + kv head, channel] <-> (D, Hkv, 2d): kv head m owns [v_m | v_{m+Hkv}]."""
    return (lambda w: (w.reshape(2, n_kv, d, -1).transpose(3, 1, 0, 2).reshape(-1, n_kv, 2 * d),),
            lambda w: w.reshape(-1, n_kv, 2, d).transpose(2, 1, 3, 0).reshape(2 * n_kv * d, -1))


def _o_and_subln(H: int, d: int, D: int):
    """o_proj (D, 2 H d) <-> o (H, 2d, D) and the per-head norm's scale (2d,): ones in, folded into o's rows out."""
    def to_hf(o, subln):
        if not np.all(subln == 1):  # x * 1 is exact, but skip the float32 detour for the common case
            o = (o.astype(np.float32) * subln.astype(np.float32)[None, :, None]).astype(o.dtype)
        return o.reshape(H * 2 * d, D).T

    return lambda w: (w.T.reshape(H, 2 * d, D), np.ones((2 * d,), w.dtype)), to_hf


def _attention_rows(config: ModelConfig, hf: str, leaf) -> list[Row]:
    D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    channels = llama.rope_channels(config)
    return [Row(hf + "q_proj.weight", (2 * H * d, D), (leaf("attn", "q_kernel"),), *_qk(H, d, channels)),
            Row(hf + "k_proj.weight", (2 * K * d, D), (leaf("attn", "k_kernel"),), *_qk(K, d, channels)),
            Row(hf + "v_proj.weight", (2 * K * d, D), (leaf("attn", "v_kernel"),), *_v(K, d)),
            Row(hf + "o_proj.weight", (D, 2 * H * d), (leaf("attn", "o_kernel"), leaf("attn", "subln_scale")),
                *_o_and_subln(H, d, D))
            ] + [Row(hf + name, (d,), (leaf("attn", name),), *COPY) for name in LAMBDAS]


FORMAT = formats.register(formats.CheckpointFormat(
    name="diffllama", label="DiffLlama", model_type="diffllama", architecture="DiffLlamaForCausalLM",
    # DIFF V1 with DiffLlama's MLPs and lambda schedule (PolyNorm or Motif's schedule: Motif's format)
    holds=(formats.Configs(attention="diff", activation=formats.Not("polynorm"), lambda_init_depth_offset=0,
                           **llama.LAYER_KINDS),),
    config_in=_config_in,
    config_out=lambda config: {**llama.config_json(config, heads=2), "lambda_std_dev": float(config.lambda_std)},
    weight_plan=lambda config: llama.plan(config, _attention_rows), export_problems=_export_problems,
))
