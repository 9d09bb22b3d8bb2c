"""A PyTorch re-statement of Motif 3 (Motif Technologies, 2026): Grouped Differential Latent Attention (GDLA),
manifold-constrained hyper-connections (mHC), a 384-expert MoE with Grouped PolyNorm experts, per-layer sliding
windows and YaRN. Written from the public code, not copied:

- MotifTechnologies/vllm @ 4cd9eb4129883565e69d508038d783d59ee01867 -- the authority here, "kept in parity with
  training" by its own audit: vllm/model_executor/models/motif.py (MotifMHCLayer, MotifGDLAttention, MotifMLP,
  MotifMoEFused, MotifDecoderLayer, MotifModel, load_weights), motif_docs.md, motif_mtp.py,
  vllm/transformers_utils/configs/motif.py (MotifConfig), layers/fused_moe/motif_experts.py and the CUDA kernel
  grouped_poly_norm_forward it calls (csrc), layers/layernorm.py (RMSNorm, PolyNorm).
- vllm-project/vllm: fused_moe/router/fused_topk_bias_router.py (the routing MotifMoEFused delegates to) and
  rotary_embedding's YaRN (the frequencies; mscale not applied to cos/sin).
- Checked against, where they agree: llama.cpp's convert_hf_to_gguf Motif3Model (tensor names), MIT-RLX/rlx-models
  crates/rlx-motif @ f19c3f3d (README, config.rs, weights.rs), an mlx-lm port of Motif-3, arXiv:2512.24880 (mHC).

Parameter names are the checkpoint's (the names vLLM's load_weights reads before its renames), so state_dict() keys
ARE the Hugging Face tensor names; tests/motif3_published.py lists them with their shapes.

Choices, where the sources disagree or leave room (all follow vLLM's model file):
1. Sliding-window layers: "interleave" windows the layers with layer_idx % period != 0, so layer 0 is global
   (vLLM's code, mlx's code and rlx: 14 global layers of 53). motif_docs.md and mlx's docstring say
   (layer_idx + 1) % period; the code does not.
2. A windowed query sees itself and `sliding_window` keys before it (sliding_window + 1 keys): training passes
   flash-attn window (sliding_window, 0); vLLM passes sliding_window + 1 to a backend that subtracts 1.
3. h_post = (1 + mhc_h_post_alpha_end) * sigmoid(...), coefficient 1.0 for Motif 3 (not the paper's / the stale HF
   reference's 2 * sigmoid). Pre-sigmoid arguments clamped to [-10, 10]; the Sinkhorn input clamped to [-20, 20]
   before exp; then mhc_sinkhorn_iters (20) rounds of rows (sum over the last axis) then columns, each sum floored
   at 1e-8. The mHC RMSNorm's eps is 1e-6, not rms_norm_eps. h_res mixes as x'_i = sum_j h_res[i, j] x_j.
4. Global layers: YaRN inverse frequencies (beta_fast/beta_slow ramp, truncated correction range) over the
   qk_rope_head_dim dims with rope_theta; cos/sin are NOT scaled; instead the softmax scale is multiplied by
   (0.1 * mscale * ln(rope_factor) + 1)^2 when max_position_embeddings > original_seq_len (top-level rope_factor,
   mscale, original_seq_len, as vLLM reads them). Windowed layers: plain RoPE with swa_rope_theta, no mscale (if
   swa_rope_theta is unset they keep the global rotary, as vLLM does). RoPE is NeoX style (rotate halves), in fp32.
   The stale HF reference's plain-RoPE reset is not followed (vLLM docs: it disagrees with training).
5. GQA: query head h reads KV head h // (num_heads / num_kv_heads) (flash-attn's grouping; vLLM's MLA path
   repeat_interleaves the same way). The k_pe rope key is shared by every KV head. Groups of grouped_ratio + 1
   consecutive heads, the last of each being the noise head: out = signal - sigmoid(x W_lambda) * noise, then
   (optionally) * sigmoid(q_latent W_gate) element-wise, then wo.
6. Routing: scores = sigmoid (or softmax) of the fp32 router logits; experts chosen by top-k of scores +
   expert_bias; weights gathered from the unbiased scores, divided by their sum if route_norm (no eps, as vLLM's
   fused_topk_bias; training's torchtitan adds 1e-20), times route_scale; route_scale scales the routed experts only,
   the shared expert is added unscaled. expert_bias exists only when load_balance_coeff is set (vLLM).
7. Routed experts (GroupedPolyNorm, per-expert weight [E, 3] and bias [E, 1]): gate and up clamped to
   [-hidden_clamp, hidden_clamp], bias clamped to [-polynorm_bias_clamp, polynorm_bias_clamp] (vLLM clamps the
   loaded parameter once; training clamps in forward -- here in forward, so the stored bias stays as published),
   poly(gate) * up in fp32, the product clamped to [-hidden_clamp, hidden_clamp], then * polynorm_output_scale.
   Shared expert (PolyNorm): gate and up clamped, no bias clamp, no product clamp, poly * up in fp32, cast, then
   * polynorm_output_scale. Dense MLP: as the shared expert but without any clamp (vLLM's MotifDecoderLayer builds
   it without hidden_clamp). PolyNorm weights pass through a sigmoid when polynorm_sigmoid_weight (default True);
   PolyNorm eps is 1e-6. polynorm_output_scale_per_layer overrides the scale per layer.
8. hidden_clamp defaults to 1000 when a config omits it (vLLM's getattr default); None switches the clamps off.
9. The multi-token-prediction block (model.mtp_layers.<k>.*, num_nextn_predict_layers of them; vLLM motif_mtp.py,
   which says it mirrors the training code): depth k's layer is a MotifDecoderLayer (layer_idx num_hidden_layers +
   k) of the config with interleave_moe_layer_step 0 (dense), mhc_enabled false and sliding_window_pattern "all"
   (windowed everywhere, so swa_rope_theta and no YaRN factor; without a window in the config it attends the whole
   context). h' = input_proj(cat[previous hidden, embed_norm(embed(next token))]); h'' = the layer (pre-norm,
   residuals added, as vLLM's fused-residual form sums them); out = final_layernorm(h''); logits by the model's
   lm_head. Depth 1's previous hidden is the model's final (normed) hidden state, depth k's the output of depth k - 1.
   Trained in DeepSeek-V3's form (`mtp_hidden_states`): depth k runs on positions 0..T-1-k, reads token t + k at t
   and predicts token t + 1 + k.

Attention is eager (scores, masks, fp32 softmax). Computations vLLM does in fp32 run in fp32, or in float64 when the
model is float64. transformers 5 rewrites a config's `rope_scaling` into `rope_parameters` (also written to
config.json); both spellings are read here.

It is a transformers PreTrainedModel so that a directory can carry it as remote code (`modeling_motif.py` with an
auto_map, see save_with_remote_code) for `from_pretrained(..., trust_remote_code=True)`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class Motif3Config(PretrainedConfig):
    """vLLM's MotifConfig (its defaults), plus the fields its model file reads with getattr."""

    model_type = "Motif"

    def __init__(self, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0, rope_scaling=None,
                 use_sliding_window=False, sliding_window=4096, sliding_window_pattern="interleave",
                 sliding_window_period=2, swa_rope_theta=None, head_dim=None, num_noise_heads=0, num_experts=0,
                 experts_top_k=2, num_shared_experts=0, interleave_moe_layer_step=0, moe_intermediate_size=None,
                 score_func="softmax", route_norm=False, route_scale=1.0, load_balance_coeff=None,
                 n_dense_first_layers=0, polynorm_output_scale=1.0, polynorm_output_scale_per_layer=None,
                 polynorm_bias_clamp=None, polynorm_sigmoid_weight=True, hidden_clamp=1000.0, mhc_enabled=False,
                 mhc_expansion_rate=4, mhc_sinkhorn_iters=20, mhc_h_post_alpha_end=0.0, q_lora_rank=0,
                 kv_lora_rank=0, qk_rope_head_dim=None, v_head_dim=None, original_seq_len=32768, rope_factor=1.0,
                 mscale=1.0, elementwise_attn_output_gate=False, num_nextn_predict_layers=0, **kwargs):
        for name, value in dict(locals()).items():
            if name not in ("self", "kwargs", "__class__", "tie_word_embeddings", "rope_scaling"):
                setattr(self, name, value)
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.moe_intermediate_size = moe_intermediate_size if moe_intermediate_size is not None else intermediate_size
        self.polynorm_output_scale_per_layer = polynorm_output_scale_per_layer or {}
        self.sliding_window = sliding_window if use_sliding_window else None
        if head_dim is not None:  # MotifConfig's derived dims
            self.qk_rope_head_dim = qk_rope_head_dim if qk_rope_head_dim is not None else head_dim // 2
            self.qk_nope_head_dim = head_dim - self.qk_rope_head_dim
            self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        if rope_scaling is not None or "rope_parameters" not in kwargs:
            self.rope_scaling = rope_scaling  # transformers 5 turns it into rope_parameters
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def yarn_rope_parameters(config) -> dict | None:
    """The YaRN dict, whichever spelling holds it (rope_scaling / transformers 5's rope_parameters); None if plain."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope if rope.get("rope_type", rope.get("type")) == "yarn" else None


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: normalize in fp32, cast back, then multiply by the weight."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = at_least_fp32(x)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def poly_norm(x, weight, bias, eps=1e-6):
    """w0 x^3/rms(x^3) + w1 x^2/rms(x^2) + w2 x/rms(x) + b over the last axis, in (at least) fp32; weight [..., 3]
    and bias [..., 1] broadcast against x's leading axes."""
    g = at_least_fp32(x)
    g2, g3 = g * g, g * g * g
    rms2, rms4, rms6 = ((y * y).mean(-1, keepdim=True) + eps for y in (g, g2, g3))
    return (weight[..., 0:1] * g3 * torch.rsqrt(rms6) + weight[..., 1:2] * g2 * torch.rsqrt(rms4)
            + weight[..., 2:3] * g * torch.rsqrt(rms2) + bias)


class PolyNorm(nn.Module):
    """act_fn of the dense MLP and the shared expert: weight [3], bias [1]; forward_mul is vLLM's PolyNorm(x) * up."""

    def __init__(self, sigmoid_weight=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3) / 3)
        self.bias = nn.Parameter(torch.zeros(1))
        self.sigmoid_weight = sigmoid_weight

    def coefficients(self):
        w = at_least_fp32(self.weight)
        return torch.sigmoid(w) if self.sigmoid_weight else w

    def forward_mul(self, x, up):
        poly = poly_norm(x, self.coefficients(), at_least_fp32(self.bias))
        return (poly * at_least_fp32(up)).to(x.dtype)


class MotifMLP(nn.Module):
    """Dense MLP and shared expert: down(PolyNorm(clamp(gate)) * clamp(up) * output_scale)."""

    def __init__(self, hidden, inner, output_scale, sigmoid_weight, hidden_clamp=None):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = PolyNorm(sigmoid_weight)
        self.output_scale, self.hidden_clamp = output_scale, hidden_clamp

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        hc = self.hidden_clamp
        if hc is not None:
            gate, up = gate.clamp(-hc, hc), up.clamp(-hc, hc)
        return self.down_proj(self.act_fn.forward_mul(gate, up) * self.output_scale)


class GroupedPolyNorm(nn.Module):
    """The routed experts' act_fn: one PolyNorm per expert, weight [E, 3], bias [E, 1]."""

    def __init__(self, num_experts):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_experts, 3) / 3)
        self.bias = nn.Parameter(torch.zeros(num_experts, 1))


class MotifExperts(nn.Module):
    """Stacked routed experts as the checkpoint stores them: gate_up_proj [E, 2I, D] (gate rows first),
    down_proj [E, D, I]; the activation is the CUDA grouped_poly_norm_forward's math (choice 7)."""

    def __init__(self, config):
        super().__init__()
        E, D, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inner, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, inner))
        self.act_fn = GroupedPolyNorm(E)
        self.sigmoid_weight, self.hidden_clamp = config.polynorm_sigmoid_weight, config.hidden_clamp
        self.bias_clamp = config.polynorm_bias_clamp

    def expert_activation(self, e, gate, up, output_scale):
        w, b = at_least_fp32(self.act_fn.weight[e]), at_least_fp32(self.act_fn.bias[e])
        w = torch.sigmoid(w) if self.sigmoid_weight else w
        if self.bias_clamp is not None:
            b = b.clamp(-self.bias_clamp, self.bias_clamp)
        hc = self.hidden_clamp
        if hc is not None and hc > 0:
            gate, up = gate.clamp(-hc, hc), up.clamp(-hc, hc)
        out = (poly_norm(gate, w, b) * at_least_fp32(up)).to(gate.dtype)
        if hc is not None and hc > 0:
            out = out.clamp(-hc, hc)
        return out * output_scale

    def forward(self, x_ND, expert_NK, weight_NK, output_scale):
        """x [N, D]; each token's k-th expert and routing weight -> sum_k weight * expert_k(x) [N, D]."""
        out = torch.zeros_like(x_ND)
        inner = self.down_proj.shape[-1]
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.nonzero(expert_NK == e, as_tuple=True)
            if token.numel() == 0:
                continue
            gate_up = x_ND[token] @ self.gate_up_proj[e].T
            act = self.expert_activation(e, gate_up[:, :inner], gate_up[:, inner:], output_scale)
            routed = (act @ self.down_proj[e].T) * weight_NK[token, slot, None].to(x_ND.dtype)
            out = out.index_add(0, token, routed)
        return out


class MotifRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)


def route(logits, expert_bias, top_k, score_func, route_norm, route_scale):
    """vLLM's fused_topk_bias: (experts [N, K], weights [N, K]) from router logits [N, E] (choice 6)."""
    logits = at_least_fp32(logits)
    scores = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(-1)
    choice = scores + expert_bias if expert_bias is not None else scores
    experts = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if route_norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights * route_scale


class MotifMoE(nn.Module):
    def __init__(self, config, output_scale):
        super().__init__()
        self.config, self.output_scale = config, output_scale
        self.router = MotifRouter(config)
        if config.load_balance_coeff is not None:
            self.expert_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        else:
            self.expert_bias = None
        self.experts = MotifExperts(config)
        self.shared_experts = None
        if config.num_shared_experts > 0:
            self.shared_experts = MotifMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts,
                                           output_scale, config.polynorm_sigmoid_weight, config.hidden_clamp)

    def forward(self, x):
        c, x_ND = self.config, x.reshape(-1, x.shape[-1])
        logits = at_least_fp32(x_ND) @ at_least_fp32(self.router.gate.weight).T
        bias = None if self.expert_bias is None else at_least_fp32(self.expert_bias)
        experts, weights = route(logits, bias, c.experts_top_k, c.score_func, c.route_norm, c.route_scale)
        out = self.experts(x_ND, experts, weights, self.output_scale)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_ND)
        return out.reshape(x.shape)


def sinkhorn(logits, iterations):
    """exp of the clamped logits, then `iterations` rounds of row then column normalization (choice 3)."""
    m = at_least_fp32(logits).clamp(-20.0, 20.0).exp()
    for _ in range(iterations):
        m = m / m.sum(-1, keepdim=True).clamp(min=1e-8)
        m = m / m.sum(-2, keepdim=True).clamp(min=1e-8)
    return m


class MotifMHC(nn.Module):
    """One mHC wrapper (mhc_attn or mhc_ffn): h_pre [.., E], h_post [.., E], h_res [.., E, E] from the RMS-normed
    flattened streams; biases and alphas in fp32 as vLLM keeps them."""

    def __init__(self, config):
        super().__init__()
        E, D = config.mhc_expansion_rate, config.hidden_size
        self.proj_pre, self.proj_post = nn.Linear(E * D, E, bias=False), nn.Linear(E * D, E, bias=False)
        self.proj_res = nn.Linear(E * D, E * E, bias=False)
        self.rms_norm = RMSNorm(E * D, eps=1e-6)
        self.bias_pre, self.bias_post = nn.Parameter(torch.zeros(E)), nn.Parameter(torch.zeros(E))
        self.bias_res = nn.Parameter(torch.zeros(E, E))
        self.alpha_pre, self.alpha_post, self.alpha_res = (nn.Parameter(torch.zeros(1)) for _ in range(3))
        self.h_post_coeff = 1.0 + float(config.mhc_h_post_alpha_end)
        self.iterations = config.mhc_sinkhorn_iters

    def forward(self, x_BTED):
        B, T, E, D = x_BTED.shape
        x_norm = self.rms_norm(x_BTED.reshape(B, T, E * D))
        pre, post = at_least_fp32(self.proj_pre(x_norm)), at_least_fp32(self.proj_post(x_norm))
        res = at_least_fp32(self.proj_res(x_norm)).reshape(B, T, E, E)
        h_pre = torch.sigmoid((self.alpha_pre * pre + self.bias_pre).clamp(-10, 10))
        h_post = self.h_post_coeff * torch.sigmoid((self.alpha_post * post + self.bias_post).clamp(-10, 10))
        h_res = sinkhorn(self.alpha_res * res + self.bias_res, self.iterations)
        return h_pre, h_post, h_res

    @staticmethod
    def collapse(x_BTED, h_pre):
        """apply_h_pre: the sublayer's input, sum_e h_pre[e] x[e]."""
        return (x_BTED * h_pre.unsqueeze(-1)).sum(dim=2).to(x_BTED.dtype)

    @staticmethod
    def combine(x_BTED, h_res, h_post, out_BTD):
        """h_res @ x + h_post (x) out, in fp32, cast back."""
        mixed = torch.einsum("btij,btjd->btid", h_res, at_least_fp32(x_BTED))
        return (mixed + h_post.unsqueeze(-1) * at_least_fp32(out_BTD).unsqueeze(2)).to(x_BTED.dtype)


def rope_inv_freq(dim, theta, yarn=None, dtype=torch.float32):
    """Plain RoPE frequencies, or vLLM's YaRNScalingRotaryEmbedding._compute_inv_freq (choice 4)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
    if yarn is None:
        return 1.0 / pos_freqs
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    beta_fast, beta_slow = yarn.get("beta_fast", 32), yarn.get("beta_slow", 1)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 keeps the original frequency (high frequencies), 0 divides it by factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def apply_neox_rope(x, positions, inv_freq):
    """x [B, T, heads, d]: rotate the two halves by the positions' angles (vLLM is_neox_style=True), in fp32."""
    x32 = at_least_fp32(x)
    freqs = positions.to(x32.dtype)[:, None] * inv_freq.to(x32.dtype)[None]
    cos, sin = freqs.cos()[None, :, None], freqs.sin()[None, :, None]
    x1, x2 = x32[..., : x.shape[-1] // 2], x32[..., x.shape[-1] // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention_mask(T, window=None):
    """[T, T] bool, True where query i may read key j: causal, and i - j <= window when windowed (window + 1 keys)."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = j <= i
    return mask & (i - j <= window) if window is not None else mask


def gqa_attention(q, k, v, scale, mask):
    """q [B, T, H, dqk], k [B, T, Hkv, dqk], v [B, T, Hkv, dv] -> [B, T, H, dv]; query head h reads KV head
    h // (H / Hkv); fp32 (or fp64) scores and softmax."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = at_least_fp32(torch.einsum("bthd,bshd->bhts", q, k)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)


def differential_combine(attn_BTHV, lambda_BTS, num_noise_heads):
    """Groups of grouped_ratio + 1 consecutive heads, the last one noise: signal - sigmoid(lambda) * noise."""
    B, T, H, dv = attn_BTHV.shape
    groups = attn_BTHV.reshape(B, T, num_noise_heads, H // num_noise_heads, dv)
    signal, noise = groups[:, :, :, :-1].reshape(B, T, -1, dv), groups[:, :, :, -1:]
    noise = noise.repeat_interleave(H // num_noise_heads - 1, dim=2).reshape(B, T, -1, dv)
    lam = torch.sigmoid(at_least_fp32(lambda_BTS)).to(signal.dtype).unsqueeze(-1)
    return signal - lam * noise


class MotifGDLAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        D, H, Hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.num_noise_heads = H, Hkv, config.num_noise_heads
        self.head_dim = config.head_dim if config.head_dim is not None else D // H
        self.rope_dim = config.qk_rope_head_dim if config.qk_rope_head_dim is not None else self.head_dim // 2
        self.nope_dim = self.head_dim - self.rope_dim
        self.v_dim = config.v_head_dim if config.v_head_dim is not None else self.head_dim
        self.kv_lora_rank = config.kv_lora_rank
        signal = (H - self.num_noise_heads) // self.num_noise_heads * self.num_noise_heads
        self.wq_a = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, H * self.head_dim, bias=False)
        if config.elementwise_attn_output_gate:
            self.wq_b_gate = nn.Linear(config.q_lora_rank, signal * self.v_dim, bias=False)
        self.wkv_a = nn.Linear(D, config.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.wkv_b = nn.Linear(config.kv_lora_rank, Hkv * (self.nope_dim + self.v_dim), bias=False)
        self.lambda_proj = nn.Linear(D, signal, bias=False)
        self.wo = nn.Linear(signal * self.v_dim, D, bias=False)
        self._set_positions(config, layer_idx)

    def _set_positions(self, config, layer_idx):
        """The window, the RoPE frequencies and the softmax scale of this layer (choices 1, 2, 4)."""
        self.window = None
        if config.use_sliding_window and config.sliding_window is not None:
            if config.sliding_window_pattern == "all" or layer_idx % config.sliding_window_period != 0:
                self.window = config.sliding_window
        yarn = yarn_rope_parameters(config)
        if self.window is not None and config.swa_rope_theta is not None:
            self.rope_theta, self.yarn = config.swa_rope_theta, None
        else:
            self.rope_theta, self.yarn = (yarn or {}).get("rope_theta", config.rope_theta), yarn
        self.scale = self.head_dim ** -0.5
        if self.window is None and config.max_position_embeddings > config.original_seq_len:
            mscale = 0.1 * config.mscale * math.log(config.rope_factor) + 1.0
            self.scale *= mscale * mscale

    def forward(self, x, positions):
        B, T, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(B, T, self.num_heads, self.head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(B, T, self.num_kv_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        inv_freq = rope_inv_freq(self.rope_dim, self.rope_theta, self.yarn)  # fp32 on the CPU, as vLLM's cache
        q_pe = apply_neox_rope(q_pe, positions, inv_freq)
        k_pe = apply_neox_rope(k_pe.unsqueeze(2), positions, inv_freq).expand(-1, -1, self.num_kv_heads, -1)
        attn = gqa_attention(torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v, self.scale,
                             attention_mask(T, self.window))
        out = differential_combine(attn, self.lambda_proj(x), self.num_noise_heads)
        if hasattr(self, "wq_b_gate"):
            out = out * torch.sigmoid(self.wq_b_gate(q_latent).view(B, T, -1, self.v_dim))
        return self.wo(out.reshape(B, T, -1))


class MotifDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MotifGDLAttention(config, layer_idx)
        step = config.interleave_moe_layer_step
        self.moe_enabled = (config.num_experts > 0 and layer_idx >= config.n_dense_first_layers and step != 0
                            and (layer_idx + 1) % step == 0)
        per_layer = config.polynorm_output_scale_per_layer
        scale = float(per_layer.get(layer_idx) or per_layer.get(str(layer_idx)) or config.polynorm_output_scale)
        if self.moe_enabled:
            self.moe = MotifMoE(config, scale)
        else:
            self.mlp = MotifMLP(config.hidden_size, config.intermediate_size, scale, config.polynorm_sigmoid_weight)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mhc_enabled = config.mhc_enabled
        if self.mhc_enabled:
            self.mhc_attn, self.mhc_ffn = MotifMHC(config), MotifMHC(config)

    def ffn(self, x):
        return self.moe(x) if self.moe_enabled else self.mlp(x)

    def forward(self, x, positions):
        """x [B, T, D], or [B, T, E, D] with mHC."""
        if not self.mhc_enabled:
            x = x + self.self_attn(self.input_layernorm(x), positions)
            return x + self.ffn(self.post_attention_layernorm(x))
        h_pre, h_post, h_res = self.mhc_attn(x)
        attn_out = self.self_attn(self.input_layernorm(MotifMHC.collapse(x, h_pre)), positions)
        x = MotifMHC.combine(x, h_res, h_post, attn_out)
        h_pre, h_post, h_res = self.mhc_ffn(x)
        ffn_out = self.ffn(self.post_attention_layernorm(MotifMHC.collapse(x, h_pre)))
        return MotifMHC.combine(x, h_res, h_post, ffn_out)


class MotifModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MotifDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1])
        x = self.embed_tokens(input_ids)
        if self.config.mhc_enabled:  # E copies of the embedding, averaged back before the final norm
            x = x.unsqueeze(2).expand(-1, -1, self.config.mhc_expansion_rate, -1).contiguous()
        for layer in self.layers:
            x = layer(x, positions)
        if self.config.mhc_enabled:
            x = x.mean(dim=2)
        return self.norm(x)


def mtp_layer_config(config):
    """vLLM motif_mtp.py's _make_mtp_hf_config: the model's config, dense, without mHC, windowed everywhere."""
    import copy

    mtp = copy.copy(config)
    mtp.interleave_moe_layer_step, mtp.mhc_enabled = 0, False
    mtp.use_sliding_window, mtp.sliding_window_pattern = True, "all"
    return mtp


class MotifMTPLayer(nn.Module):
    """One MTP depth (choice 9), parameter names as the checkpoint's model.mtp_layers.<k>.*."""

    def __init__(self, config, layer_idx):
        super().__init__()
        D = config.hidden_size
        self.embed_norm = RMSNorm(D, config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * D, D, bias=False)
        block = MotifDecoderLayer(mtp_layer_config(config), layer_idx)
        for name, module in block.named_children():  # the block's parts under the checkpoint's names
            setattr(self, name, module)
        self.block = [block]  # (a list: not registered twice)
        self.final_layernorm = RMSNorm(D, config.rms_norm_eps)

    def forward(self, hidden, next_embedded, positions):
        x = self.input_proj(torch.cat([hidden, self.embed_norm(next_embedded)], dim=-1))
        return self.final_layernorm(self.block[0](x, positions))


class Motif3ForCausalLM(PreTrainedModel):
    config_class = Motif3Config
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = MotifModel(config)
        self.model.mtp_layers = nn.ModuleList(MotifMTPLayer(config, config.num_hidden_layers + k)
                                              for k in range(config.num_nextn_predict_layers or 0))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.post_init()

    def _init_weights(self, module):  # the tests draw their own weights; keep what the modules made
        pass

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))

    def mtp_hidden_states(self, input_ids):
        """The MTP depths' final hidden states in DeepSeek-V3's training form (choice 9): depth k's [B, T - k, D]."""
        T, hidden, out = input_ids.shape[1], self.model(input_ids), []
        for k, layer in enumerate(self.model.mtp_layers, start=1):
            hidden = layer(hidden[:, :T - k], self.model.embed_tokens(input_ids[:, k:]), torch.arange(T - k))
            out.append(hidden)
        return out


@torch.no_grad()
def greedy_generate(model, input_ids, max_new_tokens):
    """Greedy decoding by re-running the whole prefix each step (no cache: exact by construction)."""
    tokens = torch.as_tensor(input_ids, dtype=torch.long)
    for _ in range(max_new_tokens):
        next_token = model(tokens).logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


def _draw(name, param):
    """Random weights that make every part matter: attention maps far from uniform, routed-expert biases past the
    bias clamp, an expert_bias that changes some choices, h_res far from uniform."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1 + 0.2 * torch.randn_like(param)
    if name.endswith("act_fn.weight"):
        return torch.randn_like(param)
    if name.endswith("act_fn.bias"):
        return 0.8 * torch.randn_like(param)
    if name.endswith(("alpha_pre", "alpha_post", "alpha_res")):
        return 1 + 0.3 * torch.randn_like(param)
    if name.endswith(("bias_pre", "bias_post", "bias_res")):
        return torch.randn_like(param)
    if name.endswith("expert_bias"):
        return 0.1 * torch.randn_like(param)
    if name.endswith(("proj_pre.weight", "proj_post.weight", "proj_res.weight")):
        return 2 * torch.randn_like(param) / param.shape[1] ** 0.5
    if name.endswith("embed_tokens.weight"):
        return torch.randn_like(param)
    return 0.3 * torch.randn_like(param) / param.shape[-1] ** 0.5 * 4


def make_motif3_model(config: dict, seed: int = 0, dtype=torch.float32) -> Motif3ForCausalLM:
    """A random Motif 3 of this config (a dict of config.json fields) in eval mode."""
    torch.manual_seed(seed)
    model = Motif3ForCausalLM(Motif3Config(**config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_draw(name, param))
    return model.to(dtype)


def save_with_remote_code(model: Motif3ForCausalLM, directory) -> None:
    """config.json + safetensors, this file as the directory's remote code (modeling_motif.py + auto_map)."""
    import shutil
    from pathlib import Path

    model.config.auto_map = {"AutoConfig": "modeling_motif.Motif3Config",
                             "AutoModelForCausalLM": "modeling_motif.Motif3ForCausalLM"}
    model.save_pretrained(directory)
    shutil.copy(Path(__file__), Path(directory) / "modeling_motif.py")
