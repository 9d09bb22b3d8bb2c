"""Motif 3's published configuration, small configurations for tests, and the checkpoint's tensor names and shapes.

Plain Python (no jax, no torch) so that the PyTorch re-statement (tests/motif3_reference.py) and the diffjax side
can both read it.

PUBLISHED is the `config.json` of Motif-Technologies/Motif-3-Beta as far as public sources state it. No verbatim copy
of that file was reachable here, so it is reconstructed; FIELD_SOURCES names the source of every field:
- "explainer": a stored page that tabulates the published config.json field by field ("Motif-3-Beta -- GDLA,
  PolyNorm, MHC & MLA-Style KV Compression").
- "rlx": MIT-RLX/rlx-models crates/rlx-motif (config.rs's tests parse the published config.json verbatim and assert
  these values; README.md) @ f19c3f3d.
- "mlx": an mlx-lm port of Motif-3 (its ModelArgs defaults, "from the HF reference modeling_motif.py").
- "vllm": MotifTechnologies/vllm @ 4cd9eb41 (vllm/model_executor/models/motif_docs.md, motif.py,
  vllm/transformers_utils/configs/motif.py).
- "inferred": not stated by any source; chosen to match what the sources' code does with the field.
"""

from __future__ import annotations

import copy

PUBLISHED = {
    "architectures": ["MotifForCausalLM"],
    "model_type": "Motif",
    "vocab_size": 220160,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1280,
    "num_hidden_layers": 53,
    "num_attention_heads": 80,
    "num_key_value_heads": 16,
    "num_noise_heads": 16,
    "head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "q_lora_rank": 1024,
    "kv_lora_rank": 512,
    "k_ratio": 1,
    "attention_cls": "gdla",
    "diff_v2": True,
    "elementwise_attn_output_gate": True,
    "headwise_attn_output_gate": False,
    "hidden_act": "poly_norm",
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "max_position_embeddings": 262144,
    "original_seq_len": 4096,
    "rope_theta": 10000.0,
    "rope_factor": 64.0,
    "mscale": 1.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0},
    "swa_rope_theta": 10000.0,
    "use_sliding_window": True,
    "sliding_window": 128,
    "sliding_window_pattern": "interleave",
    "sliding_window_period": 4,
    "max_window_layers": 9,
    "num_experts": 384,
    "experts_top_k": 8,
    "num_shared_experts": 1,
    "n_dense_first_layers": 2,
    "interleave_moe_layer_step": 1,
    "score_func": "sigmoid",
    "route_norm": True,
    "route_scale": 2.0,
    "score_before_experts": False,
    "load_balance_coeff": 1e-4,
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
    "mhc_enabled": True,
    "mhc_expansion_rate": 4,
    "mhc_identity_init": False,
    "mhc_sinkhorn_iters": 20,
    "polynorm_output_scale": 0.5,
    "polynorm_output_scale_per_layer": {},
    "polynorm_bias_clamp": 0.5,
    "polynorm_sigmoid_weight": True,
    "hidden_clamp": 1e6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}

_EXPLAINER = ("vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
              "num_key_value_heads head_dim qk_rope_head_dim v_head_dim q_lora_rank kv_lora_rank k_ratio "
              "attention_cls diff_v2 elementwise_attn_output_gate headwise_attn_output_gate hidden_act rms_norm_eps "
              "initializer_range max_position_embeddings original_seq_len rope_theta swa_rope_theta "
              "use_sliding_window sliding_window sliding_window_pattern sliding_window_period max_window_layers "
              "num_experts experts_top_k num_shared_experts n_dense_first_layers interleave_moe_layer_step "
              "score_func route_norm route_scale score_before_experts load_balance_coeff router_aux_loss_coef "
              "output_router_logits mhc_enabled mhc_expansion_rate mhc_identity_init mhc_sinkhorn_iters "
              "polynorm_output_scale polynorm_output_scale_per_layer polynorm_bias_clamp hidden_clamp "
              "num_nextn_predict_layers tie_word_embeddings use_cache eos_token_id").split()
FIELD_SOURCES = {
    **{field: "explainer (rlx and mlx agree where they state it)" for field in _EXPLAINER},
    "architectures": "inferred: the class name vLLM, llama.cpp's converter and rlx register (MotifForCausalLM)",
    "model_type": "explainer, vllm MotifConfig.model_type, rlx",
    "num_noise_heads": "rlx (asserts 16 from the published config), mlx default 16",
    "rope_factor": "rlx (its test asserts mscale^2 from ln(64) on the published config), mlx default 64",
    "mscale": "rlx (top-level mscale, 1.0), mlx default 1.0",
    "rope_scaling": "explainer (rope_type yarn, factor 64, mscale 1, beta_fast 32, beta_slow 1); "
                    "original_max_position_embeddings inferred = original_seq_len (rlx falls back to it). Whatever "
                    "else it holds, cos/sin are not scaled (vllm docs: apply_yarn_scaling=false suppresses that "
                    "mscale; rlx: attention_factor pinned to 1.0); mscale^2 goes on the softmax scale",
    "polynorm_sigmoid_weight": "vllm docs (the deployed config must set it); mlx default True; rlx default True",
    "torch_dtype": "explainer (dtype bfloat16)",
}
assert set(FIELD_SOURCES) == set(PUBLISHED), set(PUBLISHED) ^ set(FIELD_SOURCES)
# Not in PUBLISHED: mhc_h_post_alpha_end (a Tenstorrent port: "absent -> 0"; vLLM and mlx default 0.0, so h_post's
# coefficient is 1.0). Read and never used by the modeling code: max_window_layers, k_ratio,
# headwise_attn_output_gate, diff_v2 (GDLA is v2), attention_cls, the training-only router fields.

# The model card: 314B total, 13.2B active per token. Counted from the tensors the checkpoint ships (the model as
# built plus the multi-token-prediction block): 314.84B total (an mlx port's case study states 314.84B) and 13.23B
# active; the model as built (no MTP block) has 314.59B total and 12.98B active, so 13.2B counts the MTP block.
PUBLISHED_TOTAL_PARAMS = 314e9
PUBLISHED_ACTIVE_PARAMS = 13.2e9

# A small Motif 3 with every feature on: 4 layers (dense, then MoE; global on 0 and 2, a 3-key window on 1 and 3),
# groups of 4 signal + 1 noise heads over 2 KV heads as published, v narrower than q/k, YaRN on the global layers;
# load_balance_coeff 1e-2 (published 1e-4) keeps pace with configs/motif3/small.yaml's learning rate.
SMALL = {
    "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 4, "num_attention_heads": 10, "num_key_value_heads": 2, "num_noise_heads": 2,
    "head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 12,
    "attention_cls": "gdla", "diff_v2": True, "elementwise_attn_output_gate": True, "hidden_act": "poly_norm",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "original_seq_len": 16, "rope_theta": 10000.0,
    "rope_factor": 8.0, "mscale": 1.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0},
    "swa_rope_theta": 500.0, "use_sliding_window": True, "sliding_window": 3, "sliding_window_pattern": "interleave",
    "sliding_window_period": 2, "num_experts": 6, "experts_top_k": 2, "num_shared_experts": 1,
    "n_dense_first_layers": 1, "interleave_moe_layer_step": 1, "score_func": "sigmoid", "route_norm": True,
    "route_scale": 2.0, "load_balance_coeff": 1e-2, "mhc_enabled": True, "mhc_expansion_rate": 4,
    "mhc_sinkhorn_iters": 20, "mhc_h_post_alpha_end": 0.0, "polynorm_output_scale": 0.5,
    "polynorm_bias_clamp": 0.5, "polynorm_sigmoid_weight": True, "hidden_clamp": 1e6,
    "tie_word_embeddings": False,
}
VARIANTS = {
    "all_on": {},
    "mhc_off": {"mhc_enabled": False},
    "window_off": {"use_sliding_window": False},
    "dense_only": {"interleave_moe_layer_step": 0},
    "gate_off": {"elementwise_attn_output_gate": False},
    "yarn_off": {"rope_scaling": None, "max_position_embeddings": 16},  # plain RoPE, no mscale^2 on the scale
    # clamps tight enough to bite on the random test weights (hidden_clamp 1e6 never does)
    "tight_clamps": {"hidden_clamp": 0.3, "polynorm_bias_clamp": 0.05},
    "softmax_router": {"score_func": "softmax", "route_norm": False, "route_scale": 1.0},
}


def small_config(variant: str = "all_on", **overrides) -> dict:
    """SMALL with one variant's switches (and any overrides) applied."""
    if variant not in VARIANTS:
        raise KeyError(f"unknown Motif 3 test variant {variant!r}; known: {', '.join(VARIANTS)}")
    return {**copy.deepcopy(SMALL), **copy.deepcopy(VARIANTS[variant]), **overrides}


def is_moe_layer(config: dict, layer: int) -> bool:
    """vLLM's MotifDecoderLayer.moe_enabled."""
    step = config.get("interleave_moe_layer_step", 0)
    return (config.get("num_experts", 0) > 0 and layer >= config.get("n_dense_first_layers", 0) and step != 0
            and (layer + 1) % step == 0)


def is_sliding_layer(config: dict, layer: int) -> bool:
    """vLLM's MotifGDLAttention: "all" -> every layer; "interleave" -> layer % period != 0 (so layer 0 is global)."""
    if not config.get("use_sliding_window") or config.get("sliding_window") is None:
        return False
    if config.get("sliding_window_pattern", "interleave") == "all":
        return True
    return layer % config.get("sliding_window_period", 2) != 0


def _attention_shapes(c: dict, prefix: str) -> dict:
    D, H, Hkv, N = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["num_noise_heads"]
    dqk, drope, dv = c["head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    signal = (H - N) // N * N
    shapes = {"wq_a.weight": (c["q_lora_rank"], D), "q_norm.weight": (c["q_lora_rank"],),
              "wq_b.weight": (H * dqk, c["q_lora_rank"]),
              "wkv_a.weight": (c["kv_lora_rank"] + drope, D), "kv_norm.weight": (c["kv_lora_rank"],),
              "wkv_b.weight": (Hkv * (dqk - drope + dv), c["kv_lora_rank"]),
              "lambda_proj.weight": (signal, D), "wo.weight": (D, signal * dv)}
    if c.get("elementwise_attn_output_gate"):
        shapes["wq_b_gate.weight"] = (signal * dv, c["q_lora_rank"])
    return {f"{prefix}self_attn.{k}": v for k, v in shapes.items()}


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict:
    return {f"{prefix}gate_proj.weight": (inner, hidden), f"{prefix}up_proj.weight": (inner, hidden),
            f"{prefix}down_proj.weight": (hidden, inner), f"{prefix}act_fn.weight": (3,),
            f"{prefix}act_fn.bias": (1,)}


def _moe_shapes(c: dict, prefix: str) -> dict:
    D, E, inner = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    shapes = {f"{prefix}moe.router.gate.weight": (E, D),
              f"{prefix}moe.experts.gate_up_proj": (E, 2 * inner, D), f"{prefix}moe.experts.down_proj": (E, D, inner),
              f"{prefix}moe.experts.act_fn.weight": (E, 3), f"{prefix}moe.experts.act_fn.bias": (E, 1)}
    if c.get("load_balance_coeff") is not None:
        shapes[f"{prefix}moe.expert_bias"] = (E,)
    if c.get("num_shared_experts", 0) > 0:
        shapes.update(_mlp_shapes(f"{prefix}moe.shared_experts.", D, inner * c["num_shared_experts"]))
    return shapes


def _mhc_shapes(c: dict, prefix: str) -> dict:
    E, D = c["mhc_expansion_rate"], c["hidden_size"]
    shapes = {}
    for which in ("mhc_attn", "mhc_ffn"):
        shapes.update({f"{prefix}{which}.{k}": v for k, v in {
            "proj_pre.weight": (E, E * D), "proj_post.weight": (E, E * D), "proj_res.weight": (E * E, E * D),
            "rms_norm.weight": (E * D,), "bias_pre": (E,), "bias_post": (E,), "bias_res": (E, E),
            "alpha_pre": (1,), "alpha_post": (1,), "alpha_res": (1,)}.items()})
    return shapes


def _mtp_shapes(c: dict) -> dict:
    """The multi-token-prediction block the checkpoint ships and the modeling code never builds (vLLM
    motif_mtp.py's docstring): a dense, sliding-window decoder layer without mHC, plus its input norm/projection."""
    D, shapes = c["hidden_size"], {}
    for i in range(c.get("num_nextn_predict_layers", 0)):
        p = f"model.mtp_layers.{i}."
        shapes.update({f"{p}embed_norm.weight": (D,), f"{p}input_proj.weight": (D, 2 * D),
                       f"{p}final_layernorm.weight": (D,), f"{p}input_layernorm.weight": (D,),
                       f"{p}post_attention_layernorm.weight": (D,)})
        shapes.update(_attention_shapes(c, p))
        shapes.update(_mlp_shapes(f"{p}mlp.", D, c["intermediate_size"]))
    return shapes


def checkpoint_shapes(config: dict, include_mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor name the published loaders read (vLLM's load_weights before its renames, llama.cpp's
    convert_hf_to_gguf Motif3Model, mlx's sanitize) -> its shape, for this config."""
    c, D = config, config["hidden_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], D), "model.norm.weight": (D,),
              "lm_head.weight": (c["vocab_size"], D)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({f"{p}input_layernorm.weight": (D,), f"{p}post_attention_layernorm.weight": (D,)})
        shapes.update(_attention_shapes(c, p))
        if is_moe_layer(c, layer):
            shapes.update(_moe_shapes(c, p))
        else:
            shapes.update(_mlp_shapes(f"{p}mlp.", D, c["intermediate_size"]))
        if c.get("mhc_enabled"):
            shapes.update(_mhc_shapes(c, p))
    if c.get("tie_word_embeddings"):
        del shapes["lm_head.weight"]
    if include_mtp:
        shapes.update(_mtp_shapes(c))
    return shapes


def parameter_counts(config: dict, include_mtp: bool = False) -> tuple[int, int]:
    """(total, active per token) from checkpoint_shapes: active leaves out the routed experts a token does not use
    (num_experts - experts_top_k of them per MoE layer) and counts the embedding and lm_head."""
    total, unused = 0, 0
    unused_fraction = 1 - config.get("experts_top_k", 0) / max(config.get("num_experts", 1), 1)
    for name, shape in checkpoint_shapes(config, include_mtp).items():
        size = 1
        for n in shape:
            size *= n
        total += size
        if ".moe.experts." in name:
            unused += round(size * unused_fraction)
    return total, total - unused
