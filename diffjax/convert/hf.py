"""Hugging Face DiffLlama / Llama directories -> diffjax models (SEMANTICS.md sections 4 and 5).

HF orders the two maps of a differential head as halves (sub-heads j and j + nH/2) and uses
rotate_half RoPE; diffjax keeps unilm's interleaved layout. Loading regroups the heads and
permutes the q/k channels so that interleaved RoPE on the permuted weights equals rotate_half RoPE
on the original ones: the model never branches on where its weights came from.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path as FsPath

import numpy as np
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.convert.common import build_module, to_numpy
from diffjax.convert.safetensors_io import read_safetensors
from diffjax.model.rope import interleaved_from_rotate_half
from diffjax.model.transformer import TransformerLM

log = logging.getLogger(__name__)

MODEL_TYPES = ("diffllama", "llama")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_DEFAULT_EPS = {"diffllama": 1e-5, "llama": 1e-6}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _rope_fields(hf: dict) -> dict:
    """RoPE settings from either the 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters) form."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported; supported: 'default', 'llama3'")
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
            raise ValueError(f"config.json: llama3 rope scaling is missing {missing}") from None
    return fields


def config_from_hf(hf: dict, *, dtype=None, param_dtype=None) -> ModelConfig:
    """ModelConfig for an HF config.json dict. dtype None: the checkpoint's own dtype."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; supported: {MODEL_TYPES}")
    missing = [key for key in _REQUIRED if key not in hf]
    if missing:
        raise ValueError(f"config.json: missing required key(s) {missing}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"config.json: {flag}=true is not supported (diffjax layers have no biases)")
    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    n_heads = hf["num_attention_heads"]
    n_kv = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    if model_type == "diffllama":
        if n_heads % 2 or n_kv % 2:
            raise ValueError(
                f"config.json: DiffLlama needs even num_attention_heads and num_key_value_heads "
                f"(sub-heads come in pairs), got {n_heads} and {n_kv}"
            )
        n_heads, n_kv = n_heads // 2, n_kv // 2
    dtype = _dtype_name(dtype) if dtype is not None else _dtype_name(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        mlp_dim=hf["intermediate_size"],
        attention="diff" if model_type == "diffllama" else "standard",
        activation=_ACTIVATIONS[act],
        norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_EPS[model_type])),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        dtype=dtype,
        param_dtype=_dtype_name(param_dtype) if param_dtype is not None else dtype,
        **_rope_fields(hf),
    )


def _dtype_name(dtype) -> str:
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    return {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}.get(name, name)


# ------------------------------------------------------------------------------------------
# Weights


def _qk_from_hf(w, n_heads, d, permute):
    """(2 n d, D) rows [group * n + head, channel] -> (D, n, 2, d), channels in interleaved order."""
    w = w.reshape(2, n_heads, d, -1)
    if permute:
        w = w[:, :, interleaved_from_rotate_half(d), :]
    return w.transpose(3, 1, 0, 2)


def _v_from_hf(w, n_kv, d):
    """(2 Hkv d, D) rows [half * Hkv + kv_head, channel] -> (D, Hkv, 2d): kv head m owns [v_m | v_{m+Hkv}]."""
    return w.reshape(2, n_kv, d, -1).transpose(3, 1, 0, 2).reshape(-1, n_kv, 2 * d)


def _heads_from_hf(w, n_heads, d, permute):
    """Standard attention q/k (n d, D) -> (D, n, d)."""
    w = w.reshape(n_heads, d, -1)
    if permute:
        w = w[:, interleaved_from_rotate_half(d), :]
    return w.transpose(2, 0, 1)


def _weight_table(config: ModelConfig):
    """[(hf key, expected hf shape, diffjax path, transform)] for every parameter."""
    D, V, F = config.d_model, config.vocab_size, config.mlp_dim
    H, K, d = config.num_heads, config.num_kv_heads, config.head_dim
    permute = config.rope_style == "interleaved"
    T = np.transpose
    table = [("model.embed_tokens.weight", (V, D), ("embed", "embedding"), None)]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", ("blocks", i)
        table += [
            (hf + "input_layernorm.weight", (D,), ours + ("attn_norm", "scale"), None),
            (hf + "post_attention_layernorm.weight", (D,), ours + ("mlp_norm", "scale"), None),
            (hf + "mlp.gate_proj.weight", (F, D), ours + ("mlp", "gate_kernel"), T),
            (hf + "mlp.up_proj.weight", (F, D), ours + ("mlp", "up_kernel"), T),
            (hf + "mlp.down_proj.weight", (D, F), ours + ("mlp", "down_kernel"), T),
        ]
        attn, att = hf + "self_attn.", ours + ("attn",)
        if config.attention == "diff":
            table += [
                (attn + "q_proj.weight", (2 * H * d, D), att + ("q_kernel",), lambda w: _qk_from_hf(w, H, d, permute)),
                (attn + "k_proj.weight", (2 * K * d, D), att + ("k_kernel",), lambda w: _qk_from_hf(w, K, d, permute)),
                (attn + "v_proj.weight", (2 * K * d, D), att + ("v_kernel",), lambda w: _v_from_hf(w, K, d)),
                (attn + "o_proj.weight", (D, 2 * H * d), att + ("o_kernel",), lambda w: w.T.reshape(H, 2 * d, D)),
            ]
            table += [(attn + name, (d,), att + (name,), None) for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]
        else:
            table += [
                (attn + "q_proj.weight", (H * d, D), att + ("q_kernel",), lambda w: _heads_from_hf(w, H, d, permute)),
                (attn + "k_proj.weight", (K * d, D), att + ("k_kernel",), lambda w: _heads_from_hf(w, K, d, permute)),
                (attn + "v_proj.weight", (K * d, D), att + ("v_kernel",), lambda w: _heads_from_hf(w, K, d, False)),
                (attn + "o_proj.weight", (D, H * d), att + ("o_kernel",), lambda w: w.T.reshape(H, d, D)),
            ]
    table.append(("model.norm.weight", (D,), ("final_norm", "scale"), None))
    if not config.tie_embeddings:
        table.append(("lm_head.weight", (V, D), ("lm_head",), T))
    return table


def params_from_hf(tensors, config: ModelConfig) -> dict:
    """HF state dict (name -> tensor or array) -> {diffjax path: numpy array} in the canonical layout.

    Missing or mis-shaped keys raise ValueError naming the key; unexpected keys are logged.
    """
    if "embed_tokens.weight" in tensors and "model.embed_tokens.weight" not in tensors:
        # A bare DiffLlamaModel / LlamaModel checkpoint (no "model." prefix, no head).
        tensors = {("model." + k if not k.startswith("lm_head") else k): v for k, v in tensors.items()}
    table = _weight_table(config)
    missing = [key for key, *_ in table if key not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} key(s): {shown}")
    params = {}
    for key, shape, path, transform in table:
        array = to_numpy(tensors[key])
        if tuple(array.shape) != shape:
            raise ValueError(f"checkpoint key {key!r} has shape {tuple(array.shape)}, expected {shape} for this config")
        params[path] = transform(array) if transform else array
    expected = {key for key, *_ in table} | {"lm_head.weight"}
    unexpected = sorted(k for k in tensors if k not in expected and not k.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        log.warning("ignoring %d checkpoint key(s) diffjax does not use: %s", len(unexpected), unexpected[:5])
    if config.attention == "diff":  # HF DiffLlama's per-head norm has no weight: the subln scale is ones
        for i in range(config.num_layers):
            params[("blocks", i, "attn", "subln_scale")] = np.ones((2 * config.head_dim,), np.float32)
    return params


def read_hf_tensors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files of an HF directory (single file, sharded index or a set of shards)."""
    directory = FsPath(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no .safetensors files in {directory}; diffjax reads safetensors only "
            "(re-save a pytorch_model.bin checkpoint with save_pretrained(..., safe_serialization=True))"
        )
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(directory / name))
    return tensors


def load_hf(path: str | os.PathLike, dtype=None, *, param_dtype=None, rope_style: str = "interleaved") -> TransformerLM:
    """Load a local HF directory (config.json + safetensors) of model_type diffllama or llama.

    dtype: compute dtype (and parameter dtype unless param_dtype is given); None keeps the
    checkpoint's dtype. The returned model's `model.config` is its ModelConfig.
    rope_style: "interleaved" (canonical; q/k channels permuted at load) or "rotate_half" (HF order kept).
    """
    path = FsPath(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: {config_file} does not exist")
    config = config_from_hf(json.loads(config_file.read_text()), dtype=dtype, param_dtype=param_dtype)
    config = config.replace(rope_style=rope_style)
    params = params_from_hf(read_hf_tensors(path), config)
    return build_module(lambda: TransformerLM(config, rngs=nnx.Rngs(0)), params, config.param_dtype)
