"""Hugging Face DiffLlama / Llama / Motif directories -> diffjax models (transformers' `modeling_diffllama.py` /
`modeling_llama.py`; Motif's in diffjax.convert.motif); the inverse is diffjax.convert.export.

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

import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import attention_kinds
from diffjax.config import ModelConfig
from diffjax.convert import hub, motif, motif3, motif3_weights
from diffjax.convert.common import ConversionError, build_module, name_and_shape_problems, to_numpy
from diffjax.convert.hf_files import HFWeights
from diffjax.model.rope import interleaved_from_rotate_half
from diffjax.model.transformer import TransformerLM

log = logging.getLogger(__name__)

MODEL_TYPES = ("diffllama", "llama", "motif")  # the HF formats whose weights this module maps
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_MOTIF_ACTIVATIONS = {**_ACTIVATIONS, "poly_norm": "polynorm"}
_DEFAULT_EPS = {"diffllama": 1e-5, "llama": 1e-6, "motif": motif.DEFAULT_NORM_EPS}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_model_type(config: ModelConfig) -> str | None:
    """The HF model_type `config` reads from and writes to: its attention kind's (attention_kinds.hf_model_type),
    except that DIFF V1 with Motif's MLP or lambda schedule is Motif's (None: no HF counterpart)."""
    model_type = attention_kinds.get(config.attention).hf_model_type
    if model_type == "diffllama" and (config.activation == "polynorm" or config.lambda_init_depth_offset != 0):
        return motif.MODEL_TYPE
    return model_type


def is_diffllama(config: ModelConfig) -> bool:
    """Whether `config`'s weights map as HF DiffLlama's."""
    return hf_model_type(config) == "diffllama"


def model_type_of(hf: dict) -> str:
    """config.json's model_type as MODEL_TYPES spells it: publishers' spellings differ in case (Motif's checkpoints
    and vLLM say "Motif")."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type.lower() not in MODEL_TYPES:
        raise ConversionError(f"config.json: model_type {model_type!r} is not supported; supported: {MODEL_TYPES} "
                              "(in any case)")
    return model_type.lower()


def _rope_fields(hf: dict) -> dict:
    """RoPE settings from either the 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters) form."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    types = {form: d.get("rope_type", d.get("type")) for form, d in (("rope_parameters", params), ("rope_scaling", scaling))}
    if None not in types.values() and len(set(types.values())) > 1:
        raise ConversionError(f"config.json: rope_parameters and rope_scaling disagree on rope_type ({types})")
    rope_type = types["rope_scaling"] or types["rope_parameters"] or "default"
    if rope_type not in ("default", "llama3"):
        raise ConversionError(f"config.json: rope_type {rope_type!r} is not supported; supported: 'default', 'llama3'")
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConversionError(f"config.json: partial_rotary_factor={partial} is not supported (diffjax rotates every q/k channel)")
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
            raise ConversionError(f"config.json: llama3 rope scaling is missing {missing}") from None
    return fields


def config_from_hf(hf: dict, *, dtype=None, param_dtype=None) -> ModelConfig:
    """ModelConfig for an HF config.json dict. dtype None: the checkpoint's own dtype.

    Settings diffjax cannot express raise ConversionError naming the setting and what is allowed.
    """
    model_type = model_type_of(hf)
    missing = [key for key in _REQUIRED if key not in hf]
    if missing:
        raise ConversionError(f"config.json: missing required key(s) {missing}")
    if model_type == motif.MODEL_TYPE and motif3.is_motif3(hf):
        name = _dtype_name(dtype) if dtype is not None else _dtype_name(hf.get("dtype") or hf.get("torch_dtype") or "float32")
        config = motif3.config_from_hf(hf, name)
        return config if param_dtype is None else config.replace(param_dtype=_dtype_name(param_dtype))
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConversionError(f"config.json: {flag}=true is not supported (diffjax layers have no biases)")
    act = hf.get("hidden_act", "silu")
    activations = _MOTIF_ACTIVATIONS if model_type == motif.MODEL_TYPE else _ACTIVATIONS
    if act not in activations:
        raise ConversionError(f"config.json: hidden_act {act!r} is not supported; supported: {sorted(activations)}")
    if hf.get("attention_dropout"):
        log.warning("config.json: attention_dropout=%s is a training setting diffjax does not have; the weights "
                    "convert exactly and inference is unaffected", hf["attention_dropout"])
    n_heads = hf["num_attention_heads"]
    n_kv = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    extra = {"norm_eps": float(hf.get("rms_norm_eps", _DEFAULT_EPS[model_type]))}
    kind = attention_kinds.for_hf_model_type(model_type)
    if model_type == motif.MODEL_TYPE:
        extra.update(motif.config_fields(hf))
        kind = attention_kinds.get(extra.pop("attention"))
        n_heads, n_kv, head_dim = extra.pop("num_heads"), extra.pop("num_kv_heads"), extra.pop("head_dim")
    elif kind.maps == 2:  # HF counts DiffLlama's sub-heads: two per differential head
        if n_heads % 2 or n_kv % 2:
            raise ConversionError(
                f"config.json: DiffLlama needs even num_attention_heads and num_key_value_heads "
                f"(sub-heads come in pairs), got {n_heads} and {n_kv}"
            )
        n_heads, n_kv = n_heads // 2, n_kv // 2
        if hf.get("lambda_std_dev") is not None:
            extra["lambda_std"] = float(hf["lambda_std_dev"])
    if hf.get("initializer_range") is not None:
        extra["init_std"] = float(hf["initializer_range"])
    dtype = _dtype_name(dtype) if dtype is not None else _dtype_name(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            mlp_dim=hf["intermediate_size"],
            attention=kind.name,
            activation=activations[act],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            dtype=dtype,
            param_dtype=_dtype_name(param_dtype) if param_dtype is not None else dtype,
            **_rope_fields(hf),
            **extra,
        )
    except ValueError as error:  # ModelConfig's own validation, e.g. num_heads not divisible by num_kv_heads
        raise ConversionError(f"config.json describes a model diffjax cannot build: {error}") from None


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


def stacked_path(layer_path: tuple) -> tuple:
    """("blocks", i, *rest) (a layer's tensor, as weight_table names it) -> ("blocks", *rest) (its stacked leaf)."""
    return layer_path[:1] + layer_path[2:]


def weight_table(config: ModelConfig):
    """[(hf key, expected hf shape, diffjax path, transform)] for every parameter. A layer's tensors have
    the path ("blocks", i, ...): slice i of the stacked leaf `stacked_path(path)`."""
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
        if config.activation == "polynorm":
            table += [(hf + "mlp.act_fn.weight", (3,), ours + ("mlp", "polynorm_weight"), None),
                      (hf + "mlp.act_fn.bias", (1,), ours + ("mlp", "polynorm_bias"), None)]
        attn, att = hf + "self_attn.", ours + ("attn",)
        if hf_model_type(config) == motif.MODEL_TYPE:
            table += motif.attention_rows(config, attn, att, permute)
        elif is_diffllama(config):
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


def _canonical_names(names) -> dict[str, str]:
    """checkpoint name -> DiffLlamaForCausalLM name. A bare DiffLlamaModel / LlamaModel checkpoint
    has no "model." prefix (and no head)."""
    names = list(names)
    if "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names:
        return {n: n if n.startswith("lm_head") else "model." + n for n in names}
    return {n: n for n in names}


def check_checkpoint(shapes: dict[str, tuple], config: ModelConfig) -> None:
    """Raise ConversionError naming the missing, unexpected and mis-shaped keys of a checkpoint (name -> shape,
    already in DiffLlamaForCausalLM naming) against `config`."""
    expected = {key: shape for key, shape, *_ in weight_table(config)}
    if problems := name_and_shape_problems(
            shapes, expected, ignored=lambda key: key.endswith(_IGNORED_SUFFIXES), missing_what="key(s)",
            unexpected_what=f"unexpected key(s) that a {config.attention!r}-attention CausalLM of this config does not have"):
        raise ConversionError(problems)


def _np_dtype(name) -> np.dtype | None:
    return None if name is None else np.dtype(jnp.dtype(name))


def params_from_hf(tensors, config: ModelConfig, dtype=None) -> dict:
    """HF state dict (name -> tensor or array) -> {diffjax path: numpy array} in the canonical layout.

    Missing, unexpected and mis-shaped keys raise ConversionError naming them. dtype: cast to it (None: keep).
    """
    if motif3.is_motif3_config(config):
        return motif3_weights.params_from_hf(tensors, config, _np_dtype(dtype))
    names = _canonical_names(tensors)
    renamed = {names[k]: v for k, v in tensors.items()}
    check_checkpoint({k: tuple(v.shape) for k, v in renamed.items()}, config)
    converter = _Converter(config, _np_dtype(dtype))
    for key, value in renamed.items():
        converter.add(key, value)
    return converter.finish()


class _Converter:
    """Turns HF tensors, fed one at a time in any order, into diffjax params (contiguous copies,
    so that nothing keeps the source buffers alive)."""

    def __init__(self, config: ModelConfig, dtype: np.dtype | None):
        self.config, self.dtype = config, dtype
        self.table = {key: (path, transform) for key, _, path, transform in weight_table(config)}
        self.params: dict = {}

    def add(self, key: str, value) -> None:
        if key not in self.table:
            return  # ignored buffer, or a tied model's lm_head
        path, transform = self.table[key]
        array = to_numpy(value)
        array = transform(array) if transform else array  # a view where it can be: one copy below
        dtype = self.dtype or array.dtype
        if path[0] != "blocks":
            self.params[path] = np.array(array, dtype=dtype, order="C", copy=True)
            return
        # Layer i's tensor goes into slice i of the stacked [L, ...] leaf (allocated at its first layer).
        stacked = stacked_path(path)
        if stacked not in self.params:
            self.params[stacked] = np.empty((self.config.num_layers,) + array.shape, dtype)
        self.params[stacked][path[1]] = array

    def finish(self) -> dict:
        if is_diffllama(self.config):  # HF DiffLlama's per-head norm has no weight: the subln scale is ones
            shape = (self.config.num_layers, 2 * self.config.head_dim)
            self.params[("blocks", "attn", "subln_scale")] = np.ones(shape, self.dtype or np.dtype(np.float32))
        return self.params


def params_from_hf_dir(directory: str | os.PathLike, config: ModelConfig, dtype=None, *, progress=None) -> dict:
    """The params of an HF directory, read one weight file and one tensor at a time.

    Keys and shapes are checked from the file headers before any tensor is read. Peak memory is
    the converted params plus one tensor (safetensors) or one memory-mapped file (.bin).
    progress: called with (file name, index, count) before each file.
    """
    if motif3.is_motif3_config(config):
        return motif3_weights.params_from_hf_dir(directory, config, _np_dtype(dtype), progress=progress)
    weights = HFWeights(directory)
    names = _canonical_names(weights.shapes())
    check_checkpoint({names[k]: s for k, s in weights.shapes().items()}, config)
    converter = _Converter(config, _np_dtype(dtype))
    for index, file in enumerate(weights.files):
        if progress:
            progress(file.name, index, len(weights.files))
        for name, array in weights.tensors(file):
            converter.add(names[name], array)
            del array
    return converter.finish()


def read_hf_tensors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory's weight files (safetensors, or .bin with weights_only=True)."""
    weights = HFWeights(directory)
    return {name: array for file in weights.files for name, array in weights.tensors(file)}


def read_hf_config(path: str | os.PathLike) -> dict:
    path = FsPath(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: {config_file} does not exist")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{config_file}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{config_file}: a JSON {type(config).__name__}, not an object of the model's settings")
    return config


def load_hf(path: str | os.PathLike, dtype=None, *, param_dtype=None, rope_style: str = "interleaved",
            revision: str | None = None) -> TransformerLM:
    """Load an HF model of model_type diffllama, llama or motif: a local directory (config.json + safetensors, or
    PyTorch .bin files) or a Hugging Face Hub name `org/name` at `revision` (read through huggingface_hub's cache:
    diffjax.convert.hub; a local directory of that path wins).

    dtype: compute dtype (and parameter dtype unless param_dtype is given); None keeps the
    checkpoint's dtype. The returned model's `model.config` is its ModelConfig.
    rope_style: "interleaved" (canonical; q/k channels permuted at load) or "rotate_half" (HF order kept).
    """
    path = hub.resolve(path, revision=revision)
    config = config_from_hf(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    config = config.replace(rope_style=rope_style)
    params = params_from_hf_dir(path, config, config.param_dtype)
    return build_module(lambda: TransformerLM(config, rngs=nnx.Rngs(0)), params, config.param_dtype, consume=True)
