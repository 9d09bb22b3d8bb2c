"""Motif 3's checkpoint tensors <-> diffjax params: the format's weight plan, one diffjax.convert.weight_plan.Row per
checkpoint name (tests/motif3_published.py's checkpoint_shapes lists them): transposes, reshapes and one split only
(experts.gate_up_proj is the gate and up kernels). Layers after the dense first ones are their own stack
("blocks_from_<start>": diffjax.kinds.layer_segments). The names inside a layer follow the modules' docstrings
(diffjax.model.attention.gdla, .residual.mhc, .mlp.moe, .mlp.polynorm). The multi-token-prediction depths
(model.mtp_layers.<k>.*, as Motif's vLLM motif_mtp.py reads them) are the "blocks_mtp" stack
(diffjax.model.mtp.PredictionBlock): embed_norm, input_proj (its input is [hidden, normed embedding]),
final_layernorm, and a decoder layer's names (the MTP layer's config: dense MLP, no mHC).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from diffjax.config import ModelConfig
from diffjax.convert.weight_plan import COPY, TRANSPOSED, Row, causal_lm_plan, linear, out_projection, rope_perm
from diffjax.kinds import param_stacks


def _attention_rows(config: ModelConfig, hf: str, leaf: Callable) -> list[Row]:
    o, D, H, K = config.attention_options, config.d_model, config.num_heads, config.num_kv_heads
    S, dv, dn, dr = H - o.num_noise_heads, o.v_head_dim, o.qk_nope_head_dim, o.qk_rope_head_dim
    permute = config.rope_style == "interleaved"
    rows = [
        ("wq_a.weight", (o.q_lora_rank, D), "q_down_kernel", linear((o.q_lora_rank,))),
        ("q_norm.weight", (o.q_lora_rank,), "q_norm_scale", COPY),
        ("wq_b.weight", (H * config.head_dim, o.q_lora_rank), "q_up_kernel",
         linear((H, config.head_dim), rope_perm(dn, dr, permute))),
        ("wkv_a.weight", (o.kv_lora_rank + dr, D), "kv_down_kernel",
         linear((o.kv_lora_rank + dr,), rope_perm(o.kv_lora_rank, dr, permute))),
        ("kv_norm.weight", (o.kv_lora_rank,), "kv_norm_scale", COPY),
        ("wkv_b.weight", (K * (dn + dv), o.kv_lora_rank), "kv_up_kernel", linear((K, dn + dv))),
        ("lambda_proj.weight", (S, D), "lambda_kernel", linear((S,))),
        ("wo.weight", (D, S * dv), "o_kernel", out_projection(D, S, dv)),
    ]
    if o.output_gate:
        rows.append(("wq_b_gate.weight", (S * dv, o.q_lora_rank), "gate_kernel", linear((S, dv))))
    return [Row(hf + name, shape, (leaf("attn", ours),), *fns) for name, shape, ours, fns in rows]


def _polynorm_rows(hf: str, leaf: Callable, D: int, inner: int, *prefix: str) -> list[Row]:
    return [Row(hf + "gate_proj.weight", (inner, D), (leaf(*prefix, "gate_kernel"),), *TRANSPOSED),
            Row(hf + "up_proj.weight", (inner, D), (leaf(*prefix, "up_kernel"),), *TRANSPOSED),
            Row(hf + "down_proj.weight", (D, inner), (leaf(*prefix, "down_kernel"),), *TRANSPOSED),
            Row(hf + "act_fn.weight", (3,), (leaf(*prefix, "polynorm_weight"),), *COPY),
            Row(hf + "act_fn.bias", (1,), (leaf(*prefix, "polynorm_bias"),), *COPY)]


def _moe_rows(config: ModelConfig, hf: str, leaf: Callable) -> list[Row]:
    o, D = config.mlp_options, config.d_model
    E, inner = o.num_experts, o.expert_inner
    swap = (0, 2, 1)
    rows = [
        Row(hf + "router.gate.weight", (E, D), (leaf("mlp", "router_kernel"),), *TRANSPOSED),
        Row(hf + "experts.gate_up_proj", (E, 2 * inner, D),
            (leaf("mlp", "expert_gate_kernel"), leaf("mlp", "expert_up_kernel")),
            lambda w: (w[:, :inner].transpose(swap), w[:, inner:].transpose(swap)),
            lambda gate, up: np.concatenate([gate.transpose(swap), up.transpose(swap)], axis=1)),
        Row(hf + "experts.down_proj", (E, D, inner), (leaf("mlp", "expert_down_kernel"),),
            lambda w: (w.transpose(swap),), lambda w: w.transpose(swap)),
        Row(hf + "experts.act_fn.weight", (E, 3), (leaf("mlp", "expert_polynorm_weight"),), *COPY),
        Row(hf + "experts.act_fn.bias", (E, 1), (leaf("mlp", "expert_polynorm_bias"),), *COPY),
    ]
    if o.expert_bias:
        rows.append(Row(hf + "expert_bias", (E,), (leaf("mlp", "expert_bias"),), *COPY))
    if o.num_shared_experts:
        rows += _polynorm_rows(hf + "shared_experts.", leaf, D, o.shared_inner, "mlp", "shared_expert")
    return rows


def _mhc_rows(config: ModelConfig, hf: str, leaf: Callable, ours: str) -> list[Row]:
    E, D = config.residual_options.streams, config.d_model
    rows = [Row(hf + "rms_norm.weight", (E * D,), (leaf(ours, "norm", "scale"),), *COPY)]
    for part, width in (("pre", E), ("post", E), ("res", E * E)):
        rows += [Row(f"{hf}proj_{part}.weight", (width, E * D), (leaf(ours, f"{part}_kernel"),), *TRANSPOSED),
                 Row(f"{hf}bias_{part}", (E, E) if part == "res" else (E,), (leaf(ours, f"{part}_bias"),), *COPY),
                 Row(f"{hf}alpha_{part}", (1,), (leaf(ours, f"{part}_alpha"),), lambda w: (w.reshape(()),),
                     lambda w: w.reshape(1))]
    return rows


def _layer_rows(config: ModelConfig, hf: str, leaf: Callable) -> list[Row]:
    """A layer's tensors; config: its segment's (the MoE's dense first layers have mlp "polynorm")."""
    D = config.d_model
    rows = [Row(hf + "input_layernorm.weight", (D,), (leaf("attn_norm", "scale"),), *COPY),
            Row(hf + "post_attention_layernorm.weight", (D,), (leaf("mlp_norm", "scale"),), *COPY)]
    rows += _attention_rows(config, hf + "self_attn.", leaf)
    if config.mlp == "moe":
        rows += _moe_rows(config, hf + "moe.", leaf)
    else:
        rows += _polynorm_rows(hf + "mlp.", leaf, D, config.mlp_dim, "mlp")
    if config.residual == "mhc":
        rows += _mhc_rows(config, hf + "mhc_attn.", leaf, "attn_residual")
        rows += _mhc_rows(config, hf + "mhc_ffn.", leaf, "mlp_residual")
    return rows


def _mtp_rows(config: ModelConfig) -> list[Row]:
    """The MTP depths' tensors (model.mtp_layers.<k>.*), each depth a slice of the "blocks_mtp" stack."""
    if not config.mtp_depths:
        return []
    stack, D, rows = param_stacks(config)[-1], config.d_model, []
    for k in range(config.mtp_depths):
        def leaf(*path, k=k):
            return (stack.name,) + path, k
        hf = f"model.mtp_layers.{k}."
        rows += [Row(hf + "embed_norm.weight", (D,), (leaf("embed_norm", "scale"),), *COPY),
                 Row(hf + "input_proj.weight", (D, 2 * D), (leaf("input_proj_kernel"),), *TRANSPOSED),
                 Row(hf + "final_layernorm.weight", (D,), (leaf("final_norm", "scale"),), *COPY)]
        rows += _layer_rows(stack.config, hf, leaf)
    return rows


def plan(config: ModelConfig) -> list[Row]:
    """Every checkpoint tensor of `config`'s Motif 3, in the checkpoint's order, the MTP depths' last."""
    return causal_lm_plan(config, lambda segment_config, depth, hf, leaf: _layer_rows(segment_config, hf, leaf)) + \
        _mtp_rows(config)
