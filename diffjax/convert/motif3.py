"""Motif 3's config.json (model_type "Motif", as Motif-2's; tests/motif3_published.py lists the published one)
<-> ModelConfig, the format row "motif3": a variant of model_type "motif" recognised by Motif 3's keys (`is_motif3`);
the tensor names are diffjax.convert.motif3_weights'.

What each field becomes (tests/motif3_reference.py states what the model computes with them):
  q_lora_rank, kv_lora_rank, qk_rope_head_dim, v_head_dim, num_noise_heads, elementwise_attn_output_gate
      attention "gdla" and its options; head_dim (q/k, 192 as published) and the head counts as they are
  sliding_window W, sliding_window_pattern, sliding_window_period P
      attention_window W + 1 (a query sees W keys before it); "interleave": global_layers = multiples of P
  swa_rope_theta       window_rope_theta
  rope_scaling yarn    rope_type "yarn"; rope_mscale = mscale when max_position_embeddings > original_seq_len
  mhc_*                residual "mhc" (streams, sinkhorn_iters, h_post_alpha, identity_init)
  num_experts, ...     mlp "moe" (dense first layers as its options say); no experts: mlp "polynorm"
  num_nextn_predict_layers
      mtp_depths; mtp_layer as Motif's vLLM motif_mtp.py builds the MTP block's layer (_make_mtp_hf_config: the
      model's config with interleave_moe_layer_step 0, mhc_enabled false, sliding_window_pattern "all"): a dense
      PolyNorm MLP of intermediate_size without clamps (motif.py's dense MLP), no mHC, the model's window on every
      position with swa_rope_theta (plain RoPE, no YaRN factor on the softmax scale). The checkpoint's shapes
      (tests/motif3_published.py: mlp 12,288 wide, no mhc_* tensors) agree.
"""

from __future__ import annotations

from diffjax.config import ModelConfig
from diffjax.convert import formats, motif3_weights
from diffjax.convert.common import ConversionError

PUBLISHED_MODEL_TYPE, ARCHITECTURE = "Motif", "MotifForCausalLM"
MARKERS = ("q_lora_rank", "kv_lora_rank", "mhc_enabled", "num_experts", "diff_v2")  # keys Motif-2's config.json never sets
DEFAULT_HIDDEN_CLAMP = 1000.0  # vLLM's getattr default when a config omits hidden_clamp
DEFAULT_NORM_EPS = 1e-6  # MotifConfig's rms_norm_eps
DEFAULT_ORIGINAL_SEQ_LEN = 32768  # MotifConfig's original_seq_len


def is_motif3(hf: dict) -> bool:
    """Whether a Motif config.json is Motif 3's (GDLA, experts, mHC) rather than Motif-2's."""
    return any(hf.get(key) for key in MARKERS) or hf.get("attention_cls") == "gdla"


def _refuse_unsupported(hf: dict) -> None:
    """One line for the first config.json value diffjax's Motif 3 cannot compute."""
    checks = [  # (field, supported, what is)
        ("polynorm_output_scale_per_layer", not hf.get("polynorm_output_scale_per_layer"),
         "diffjax has one polynorm_output_scale for every layer (only an empty mapping)"),
        ("headwise_attn_output_gate", not hf.get("headwise_attn_output_gate"),
         "only the element-wise gate (elementwise_attn_output_gate) is supported"),
        ("score_before_experts", not hf.get("score_before_experts"), "only false (weights on the experts' outputs)"),
        ("hidden_act", hf.get("hidden_act", "poly_norm") == "poly_norm", "Motif 3's MLPs are 'poly_norm'"),
        ("attention_cls", hf.get("attention_cls", "gdla") == "gdla", "only 'gdla' is supported"),
        ("sliding_window_pattern", hf.get("sliding_window_pattern", "interleave") in ("interleave", "all"),
         "supported: 'interleave', 'all'"),
        ("q_lora_rank", (hf.get("q_lora_rank") or 0) > 0, "GDLA needs a q latent (q_lora_rank > 0)"),
        ("kv_lora_rank", (hf.get("kv_lora_rank") or 0) > 0, "GDLA needs a kv latent (kv_lora_rank > 0)"),
        ("num_noise_heads", (hf.get("num_noise_heads") or 0) > 0, "GDLA needs noise heads (num_noise_heads > 0)"),
        ("attention_bias", not hf.get("attention_bias"), "diffjax layers have no biases"),
        ("use_bias", not hf.get("use_bias"), "diffjax layers have no biases"),
    ]
    for field, supported, allowed in checks:
        if not supported:
            raise ConversionError(f"config.json: {field}={hf.get(field)!r} is not supported for Motif 3: {allowed}")


def _yarn(hf: dict) -> dict | None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise ConversionError(f"config.json: rope_scaling rope_type {kind!r}: Motif 3 uses 'yarn' or none")
    return rope if kind == "yarn" else None


def _rope_fields(hf: dict) -> dict:
    """RoPE fields: YaRN on the global layers, its mscale^2 on their softmax scale when the context is stretched
    (MotifConfig's defaults where a field is absent: original_seq_len 32768, rope_factor 1, so no factor)."""
    yarn = _yarn(hf)
    theta = float((yarn or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    original = hf.get("original_seq_len", DEFAULT_ORIGINAL_SEQ_LEN)
    top_factor = float(hf.get("rope_factor", 1.0))  # the softmax factor's (vLLM reads the top-level field)
    scaled = hf.get("max_position_embeddings", 0) > original and top_factor != 1.0
    if yarn is None:
        if scaled:
            raise ConversionError(f"config.json: rope_factor={top_factor} with max_position_embeddings > "
                                  "original_seq_len but no yarn rope_scaling: diffjax applies that factor with YaRN only")
        return {"rope_theta": theta}
    factor = float(yarn["factor"])
    if scaled and top_factor != factor:
        raise ConversionError(f"config.json: rope_factor ({top_factor}) differs from rope_scaling's factor "
                              f"({factor}); diffjax uses one factor for YaRN's frequencies and its mscale")
    return dict(rope_theta=theta, rope_type="yarn", rope_factor=factor,
                rope_original_max_len=int(yarn.get("original_max_position_embeddings", original)),
                rope_beta_fast=float(yarn.get("beta_fast", 32.0)), rope_beta_slow=float(yarn.get("beta_slow", 1.0)),
                rope_mscale=float(hf.get("mscale", 1.0)) if scaled else None)


def _window_fields(hf: dict) -> dict:
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return {}
    layers = range(hf["num_hidden_layers"])
    period = hf.get("sliding_window_period", 2)
    interleaved = hf.get("sliding_window_pattern", "interleave") == "interleave"
    return dict(attention_window=int(hf["sliding_window"]) + 1,
                global_layers=[i for i in layers if i % period == 0] if interleaved else [],
                window_rope_theta=hf.get("swa_rope_theta"))


def _mlp_fields(hf: dict) -> dict:
    hidden_clamp = hf.get("hidden_clamp", DEFAULT_HIDDEN_CLAMP)
    scale, sigmoid = float(hf.get("polynorm_output_scale", 1.0)), bool(hf.get("polynorm_sigmoid_weight", True))
    step = hf.get("interleave_moe_layer_step", 0)
    if not hf.get("num_experts") or not step or hf.get("n_dense_first_layers", 0) >= hf["num_hidden_layers"]:
        return dict(mlp="polynorm", mlp_options=dict(output_scale=scale, sigmoid_weight=sigmoid, hidden_clamp=None))
    return dict(mlp="moe", mlp_options=dict(
        num_experts=hf["num_experts"], top_k=hf.get("experts_top_k", 2),
        expert_inner=hf.get("moe_intermediate_size") or hf["intermediate_size"],
        num_shared_experts=hf.get("num_shared_experts", 0), score_func=hf.get("score_func", "softmax"),
        route_norm=bool(hf.get("route_norm", False)), route_scale=float(hf.get("route_scale", 1.0)),
        expert_bias=hf.get("load_balance_coeff") is not None,
        load_balance_coeff=hf.get("load_balance_coeff"), output_scale=scale, sigmoid_weight=sigmoid,
        bias_clamp=hf.get("polynorm_bias_clamp"), hidden_clamp=hidden_clamp,
        dense_first_layers=hf.get("n_dense_first_layers", 0), moe_layer_step=step))


def _residual_fields(hf: dict) -> dict:
    if not hf.get("mhc_enabled"):
        return {}
    return dict(residual="mhc", residual_options=dict(
        streams=hf.get("mhc_expansion_rate", 4), sinkhorn_iters=hf.get("mhc_sinkhorn_iters", 20),
        h_post_alpha=float(hf.get("mhc_h_post_alpha_end") or 0.0), identity_init=bool(hf.get("mhc_identity_init"))))


def config_fields(hf: dict) -> dict:
    """ModelConfig fields of a Motif 3 config.json (dtype aside); unsupported values raise one line each."""
    _refuse_unsupported(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim, mlp_dim=hf["intermediate_size"], attention="gdla", attention_options=dict(
            q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
            qk_rope_head_dim=hf.get("qk_rope_head_dim") or head_dim // 2, v_head_dim=hf.get("v_head_dim") or head_dim,
            num_noise_heads=hf["num_noise_heads"], output_gate=bool(hf.get("elementwise_attn_output_gate"))),
        norm_eps=float(hf.get("rms_norm_eps", DEFAULT_NORM_EPS)), rope_style="rotate_half",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        **({"init_std": float(hf["initializer_range"])} if hf.get("initializer_range") is not None else {}),
        **_rope_fields(hf), **_window_fields(hf), **_mlp_fields(hf), **_residual_fields(hf), **_mtp_fields(hf))


def _mtp_fields(hf: dict) -> dict:
    """mtp_depths and the MTP block's layer (module docstring) of a Motif 3 config.json."""
    depths = int(hf.get("num_nextn_predict_layers") or 0)
    if not depths:
        return {}
    layer = dict(mlp="polynorm", mlp_dim=hf["intermediate_size"], residual="plain",
                 mlp_options=dict(output_scale=float(hf.get("polynorm_output_scale", 1.0)), hidden_clamp=None,
                                  sigmoid_weight=bool(hf.get("polynorm_sigmoid_weight", True))))
    window = _window_fields(hf)
    if window:  # (without a window vLLM's MTP layer attends the whole context, as the global layers)
        layer.update(attention_window=window["attention_window"], window_rope_theta=window["window_rope_theta"])
    return dict(mtp_depths=depths, mtp_layer=layer)


# ------------------------------------------------------------------------------ ModelConfig -> config.json


def export_problems(config: ModelConfig) -> list[str]:
    """What Motif 3's config.json cannot say about `config` (empty: exportable)."""
    problems = []
    if config.mlp == "polynorm" and config.mlp_options.hidden_clamp is not None:
        problems.append(f"mlp_options.hidden_clamp={config.mlp_options.hidden_clamp}: Motif 3's dense MLP is unclamped")
    if config.mlp == "moe" and config.mlp_options.shared_inner != (
            config.mlp_options.expert_inner * config.mlp_options.num_shared_experts):
        problems.append("mlp_options.shared_inner: Motif 3's shared experts are num_shared_experts x expert_inner wide")
    if config.rope_type not in ("default", "yarn"):
        problems.append(f"rope_type={config.rope_type!r}: Motif 3 has 'default' or 'yarn'")
    if config.rope_type == "yarn" and config.rope_mscale is None and config.max_seq_len > config.rope_original_max_len:
        problems.append("rope_mscale=None with max_seq_len > rope_original_max_len: Motif 3 then applies mscale")
    if config.rope_mscale is not None and config.max_seq_len <= config.rope_original_max_len:
        problems.append(f"rope_mscale={config.rope_mscale} with max_seq_len <= rope_original_max_len: Motif 3 applies "
                        "mscale only to a stretched context")
    if config.mtp_depths and config.mtp_layer_config() != _published_mtp_layer(config):
        problems.append("mtp_layer: Motif 3's MTP layer is a dense PolyNorm MLP of mlp_dim (no clamp, the model's "
                        "output_scale and sigmoid_weight), no mHC and the model's window with window_rope_theta")
    if config.attention_window is not None and config.global_layers:
        period = config.global_layers[1] if len(config.global_layers) > 1 else config.num_layers
        if list(config.global_layers) != list(range(0, config.num_layers, period)):
            problems.append(f"global_layers={list(config.global_layers)}: Motif 3's are the multiples of a period")
    return problems


def _published_mtp_layer(config: ModelConfig) -> ModelConfig:
    """The MTP layer config Motif 3's config.json says for `config` (what config_fields would read back)."""
    o = config.mlp_options
    return config.replace(mtp_layer=dict(
        mlp="polynorm", mlp_dim=config.mlp_dim, residual="plain",
        mlp_options=dict(output_scale=o.output_scale, sigmoid_weight=o.sigmoid_weight, hidden_clamp=None))
    ).mtp_layer_config()


def _window_export(config: ModelConfig) -> dict:
    if config.attention_window is None:
        return dict(use_sliding_window=False, sliding_window=None)
    layers = config.global_layers
    return dict(use_sliding_window=True, sliding_window=config.attention_window - 1,
                sliding_window_pattern="interleave" if layers else "all",
                sliding_window_period=(layers[1] if len(layers) > 1 else config.num_layers) if layers else 2,
                swa_rope_theta=config.window_rope_theta)


def _rope_export(config: ModelConfig) -> dict:
    if config.rope_type != "yarn":
        return dict(rope_theta=float(config.rope_theta), rope_scaling=None, original_seq_len=config.max_seq_len)
    # (rope_theta inside rope_scaling too: config_fields reads it from there first, so a source's own would go stale)
    yarn = dict(rope_type="yarn", rope_theta=float(config.rope_theta), factor=float(config.rope_factor),
                beta_fast=float(config.rope_beta_fast), beta_slow=float(config.rope_beta_slow),
                original_max_position_embeddings=config.rope_original_max_len, mscale=float(config.rope_mscale or 1.0))
    return dict(rope_theta=float(config.rope_theta), rope_scaling=yarn, rope_factor=float(config.rope_factor),
                mscale=float(config.rope_mscale or 1.0), original_seq_len=config.rope_original_max_len)


def _load_balance_coeff(o) -> float | None:
    """Motif 3's load_balance_coeff: the bias's update speed; a bias without one (never updated here) says 1e-4,
    as the published config does (vLLM makes the bias exactly when the key is set)."""
    if o.load_balance_coeff is not None:
        return o.load_balance_coeff
    return 1e-4 if o.expert_bias else None


def _mlp_export(config: ModelConfig) -> dict:
    o = config.mlp_options
    common = dict(polynorm_output_scale=o.output_scale, polynorm_sigmoid_weight=o.sigmoid_weight)
    if config.mlp == "polynorm":
        return dict(common, num_experts=0, interleave_moe_layer_step=0, hidden_clamp=None)
    return dict(common, num_experts=o.num_experts, experts_top_k=o.top_k, moe_intermediate_size=o.expert_inner,
                num_shared_experts=o.num_shared_experts, score_func=o.score_func, route_norm=o.route_norm,
                route_scale=o.route_scale, load_balance_coeff=_load_balance_coeff(o),
                polynorm_bias_clamp=o.bias_clamp, hidden_clamp=o.hidden_clamp,
                n_dense_first_layers=o.dense_first_layers, interleave_moe_layer_step=o.moe_layer_step)


def export_fields(config: ModelConfig) -> dict:
    """config.json of `config` with the published field names (tests/motif3_published.py's PUBLISHED)."""
    a = config.attention_options
    mhc = config.residual == "mhc"
    r = config.residual_options
    return dict(
        attention_cls="gdla", diff_v2=True,
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.mlp_dim,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, num_noise_heads=a.num_noise_heads, head_dim=config.head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank, k_ratio=1, elementwise_attn_output_gate=a.output_gate,
        headwise_attn_output_gate=False, hidden_act="poly_norm", rms_norm_eps=float(config.norm_eps),
        initializer_range=float(config.init_std), max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=bool(config.tie_embeddings), score_before_experts=False,
        polynorm_output_scale_per_layer={}, num_nextn_predict_layers=config.mtp_depths, mhc_enabled=mhc,
        **(dict(mhc_expansion_rate=r.streams, mhc_sinkhorn_iters=r.sinkhorn_iters,
                mhc_h_post_alpha_end=r.h_post_alpha, mhc_identity_init=r.identity_init) if mhc else {}),
        **_window_export(config), **_rope_export(config), **_mlp_export(config))


FORMAT = formats.register(formats.CheckpointFormat(
    name="motif3", label="Motif 3", model_type="motif", architecture=ARCHITECTURE,
    holds=(formats.Configs(attention="gdla", mlp=("moe", "polynorm"), residual=("plain", "mhc")),),
    detect=is_motif3, config_in=config_fields, config_out=export_fields, weight_plan=motif3_weights.plan,
    export_problems=export_problems, spelling=PUBLISHED_MODEL_TYPE, remote_code=True,
))
