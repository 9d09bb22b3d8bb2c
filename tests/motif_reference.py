"""A PyTorch re-statement of Motif-2.6B and Motif-2-12.7B (Grouped Differential Attention), written from the code
that serves their checkpoints: vLLM's `model_executor/models/motif.py`, Motif's `grouped_diff_attn` attention
backend and vLLM's PolyNorm (`layers/layernorm.py`), as in Motif's fork MotifTechnologies/vllm, branch `motif`
@ 477e4d79. The model repositories' own `modeling_motif.py` was not reachable.

The backend's composition is kept as written there: q_proj's heads regrouped by `split_q_heads` (groups of signal
heads then one noise head), k and v split into even / odd heads (`split_heads`), four causal GQA attentions
(q1 k1 against v1 and v2, q2 k2 against v1 and v2), the noise output repeated over its group's signal heads, then
attn1 - lambda attn2, the subln RMSNorm with its weight and (1 - lambda_init), lambda_init = 0.8 - 0.6 exp(-0.3
(layer_idx - 1)). Attention is eager (scores, causal mask, float32 softmax), as flash-attn computes it.

It is a transformers PreTrainedModel so that a test directory can carry it as remote code (`modeling_motif.py`
with an auto_map), as the real checkpoints do, for `diffjax.convert.verify(..., trust_remote_code=True)`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class MotifConfig(PretrainedConfig):
    model_type = "motif"

    def __init__(self, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=4, num_noise_heads=None, head_dim=None, hidden_act="poly_norm", rms_norm_eps=1e-6,
                 attn_rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
                 **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        if num_noise_heads is not None:  # as the served configs: absent on Motif-2.6B
            self.num_noise_heads = num_noise_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act, self.rms_norm_eps, self.attn_rms_norm_eps = hidden_act, rms_norm_eps, attn_rms_norm_eps
        self.rope_theta, self.max_position_embeddings = rope_theta, max_position_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


class PolyNorm(nn.Module):
    """vLLM's PolyNorm.forward_native (tp_size 1)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3) / 3)
        self.bias = nn.Parameter(torch.zeros(1))
        self.eps = eps

    def forward(self, x):
        x_float = x.to(torch.float32)
        x_2 = x_float.pow(2)
        x_3 = x_2 * x_float
        H = x.shape[-1]
        x_2_mean, x_4_mean, x_6_mean = x_2.sum(-1, keepdim=True) / H, (x_2 * x_2).sum(-1, keepdim=True) / H, (x_3 * x_3).sum(-1, keepdim=True) / H
        norm = lambda z, mean: z / torch.sqrt(mean + self.eps)  # noqa: E731
        out = self.weight[0] * norm(x_3, x_6_mean) + self.weight[1] * norm(x_2, x_4_mean) + self.weight[2] * norm(x_float, x_2_mean) + self.bias
        return out.to(x.dtype)


def rotate_half_rope(x, positions, theta):
    """NeoX-style RoPE (vLLM get_rope with is_neox_style=True) on x [B, T, heads, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions[:, None].float() * inv_freq[None]
    cos, sin = freqs.cos()[None, :, None], freqs.sin()[None, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def causal_gqa(q, k, v, scale):
    """flash-attn's causal attention, kv head h // (Hq / Hkv) for query head h: q [B, T, Hq, d] -> [B, T, Hq, dv]."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k).float() * scale
    T = q.shape[1]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1).to(v.dtype), v)


class MotifAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        D, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_noise_heads = getattr(config, "num_noise_heads", config.num_attention_heads // 2)
        self.head_dim, self.rope_theta = d, config.rope_theta
        self.q_proj = nn.Linear(D, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(D, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(D, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(2 * (self.num_heads - self.num_noise_heads) * d, D, bias=False)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (layer_idx - 1))
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(d).normal_(mean=0, std=0.1)))
        self.subln = RMSNorm(2 * d, eps=config.attn_rms_norm_eps)

    def forward(self, x, positions):
        B, T, _ = x.shape
        d = self.head_dim
        q = rotate_half_rope(self.q_proj(x).view(B, T, self.num_heads, d), positions, self.rope_theta)
        k = rotate_half_rope(self.k_proj(x).view(B, T, self.num_kv_heads, d), positions, self.rope_theta)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, d)
        # split_q_heads: "(num_groups group_size) D -> num_groups group_size D", signal heads first in each group.
        groups = q.view(B, T, self.num_noise_heads, self.num_heads // self.num_noise_heads, d)
        q1, q2 = groups[..., :-1, :].flatten(2, 3), groups[..., -1:, :].flatten(2, 3)
        # split_heads: "(H two) D -> H two D".
        k1, k2 = k.view(B, T, -1, 2, d).unbind(3)
        v1, v2 = v.view(B, T, -1, 2, d).unbind(3)
        scale = d ** -0.5
        attn1 = torch.cat([causal_gqa(q1, k1, v1, scale), causal_gqa(q1, k1, v2, scale)], dim=-1)
        attn2 = torch.cat([causal_gqa(q2, k2, v1, scale), causal_gqa(q2, k2, v2, scale)], dim=-1)
        attn2 = attn2.repeat_interleave(q1.shape[2] // q2.shape[2], dim=2)  # repeat "... H D -> ... (H r) D"
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1).float())
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1).float())
        lambda_full = lambda_1 - lambda_2 + self.lambda_init
        attn = self.subln(attn1 - lambda_full * attn2) * (1 - self.lambda_init)
        return self.o_proj(attn.reshape(B, T, -1))


class MotifMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, F = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(D, F, bias=False), nn.Linear(D, F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)
        self.act_fn = PolyNorm()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MotifDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn, self.mlp = MotifAttention(config, layer_idx), MotifMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class MotifModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MotifDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1])
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class MotifForCausalLM(PreTrainedModel):
    config_class = MotifConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = MotifModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):  # the tests draw their own weights; keep what the modules made
        pass

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))


def make_motif_model(seed: int = 0, **overrides) -> MotifForCausalLM:
    """A random small Motif model with weights large enough that attention maps are far from uniform (float32)."""
    torch.manual_seed(seed)
    model = MotifForCausalLM(MotifConfig(**overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("subln.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("act_fn.weight"):
                param.copy_(torch.tensor([0.2, 0.3, 0.5]) + 0.05 * torch.randn(3))
            elif name.endswith("act_fn.bias"):
                param.copy_(0.1 * torch.randn(1))
            elif "lambda" in name:
                param.copy_(0.3 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model


def save_with_remote_code(model: MotifForCausalLM, directory) -> None:
    """config.json + safetensors as Motif's repositories ship them, this file as their remote code."""
    import shutil
    from pathlib import Path

    model.config.auto_map = {"AutoConfig": "modeling_motif.MotifConfig", "AutoModelForCausalLM": "modeling_motif.MotifForCausalLM"}
    model.save_pretrained(directory)
    shutil.copy(Path(__file__), Path(directory) / "modeling_motif.py")
