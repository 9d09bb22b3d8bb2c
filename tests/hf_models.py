"""Random Hugging Face DiffLlama / Llama models saved to disk, as users would have them."""

from __future__ import annotations

import numpy as np
import torch

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """An eager HF model with weights large enough that attention maps are far from uniform."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    config_cls, model_cls = {
        "diffllama": (DiffLlamaConfig, DiffLlamaForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[kind]
    kwargs = {**SMALL, "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, **overrides}
    if kind == "diffllama":
        kwargs.setdefault("lambda_std_dev", 0.3)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif "lambda" not in name:
                param.copy_(0.15 * torch.randn_like(param))
    return model


def random_tokens(vocab_size: int, shape=(2, 40), seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab_size, shape).astype(np.int32)


def max_relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())
