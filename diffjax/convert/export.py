"""diffjax models -> Hugging Face DiffLlama / Llama / Motif directories (the inverse of diffjax.convert.hf).

`attention: diff` becomes `diffllama` (`motif` with PolyNorm or Motif's lambda schedule), `attention: gda`
becomes `motif` and `attention: standard` becomes `llama`. Export undoes
load_hf's re-layout exactly (head regrouping, q/k channel permutation, transposes), so HF ->
diffjax -> HF is bit-exact. diffjax's learnable subln scale has no counterpart in DiffLlama
(its per-head norm has no weight): it is folded into o_proj's columns (exact: the norm is per head), which
is exact when the scale is ones (every model imported from HF) and equal up to rounding otherwise.
Settings HF cannot express raise ConversionError naming the setting.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import attention_kinds
from diffjax.config import ModelConfig, lambda_init_for_depth
from diffjax.convert import motif, motif3, motif3_weights
from diffjax.convert.common import ConversionError, flatten, path_name, prepare_output_dir
from diffjax.convert.hf import hf_model_type, is_diffllama, stacked_path, weight_table
from diffjax.convert.safetensors_io import write_safetensors
from diffjax.params_checkpoint import CheckpointWriteError
from diffjax.model.rope import interleaved_from_rotate_half

_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
_MOTIF_ACTIVATIONS = {**_ACTIVATIONS, "polynorm": "poly_norm"}
# Files an export writes (and --overwrite may replace); anything else in the directory is left alone.
HF_OUTPUT_FILES = ("config.json", "model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                   "chat_template*", "added_tokens.json", "vocab.json", "merges.txt")
# config.json fields an export derives from the ModelConfig; others of a base config are kept.
_DERIVED_FIELDS = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_parameters", "rope_theta",
    "rope_scaling", "dtype", "torch_dtype", "lambda_std_dev", "transformers_version", "attention_dropout",
    "num_noise_heads", "attn_rms_norm_eps", "use_bias", "k_ratio",
}


def check_exportable(config: ModelConfig) -> None:
    """Raise ConversionError naming each setting of `config` that its HF format (DiffLlama, Llama, Motif) cannot express."""
    if motif3.is_motif3_config(config):  # Motif 3's own blocks: its exporter says what it cannot write
        if problems := motif3.export_problems(config):
            raise ConversionError("cannot export to Hugging Face (Motif 3): " + "; ".join(problems))
        return
    problems = []
    model_type = hf_model_type(config)
    if model_type is None:
        counterparts = [f"{k.hf_architecture.removesuffix('ForCausalLM')} (attention {k.name!r})"
                        for k in map(attention_kinds.get, attention_kinds.names()) if k.hf_model_type]
        problems.append(f"attention={config.attention!r}: Hugging Face has {', '.join(counterparts)} only")
    for part, built_in in (("mlp", "gated"), ("residual", "plain")):  # the HF formats' blocks
        if getattr(config, part) != built_in:
            problems.append(f"{part}={getattr(config, part)!r}: the Hugging Face formats hold {part}={built_in!r} only")
    if model_type in ("diffllama", motif.MODEL_TYPE) and not config.subln:
        problems.append(f"subln=false: HF {model_type} always normalizes each head's output")
    if model_type == motif.MODEL_TYPE:
        problems += motif.export_problems(config)
    elif model_type == "diffllama" and config.subln_eps not in (None, config.norm_eps):
        problems.append(f"subln_eps={config.subln_eps}: HF DiffLlama's per-head norm uses rms_norm_eps "
                        f"(norm_eps={config.norm_eps})")
    if model_type == "diffllama" and config.lambda_init is not None:
        schedule = [lambda_init_for_depth(i) for i in range(config.num_layers)]
        if any(abs(config.lambda_init - value) > 1e-12 for value in schedule):
            problems.append(
                f"lambda_init={config.lambda_init} (one constant for every layer): HF DiffLlama always uses "
                "lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx); only lambda_init=None (that schedule) can be exported"
            )
    activations = _MOTIF_ACTIVATIONS if model_type == motif.MODEL_TYPE else _ACTIVATIONS
    if config.activation not in activations:
        problems.append(f"activation={config.activation!r}: HF {model_type} exports support {sorted(activations)}")
    if config.attention_window is not None:
        problems.append(f"attention_window={config.attention_window}: HF DiffLlama and Llama attend the whole context "
                        "(they have no sliding window); a model trained with one would compute something else there")
    if config.rope_type not in ("default", "llama3"):
        problems.append(f"rope_type={config.rope_type!r}: HF {model_type} exports write 'default' and 'llama3' RoPE")
    if problems:
        raise ConversionError("cannot export to Hugging Face: " + "; ".join(problems))


def _rope_config(config: ModelConfig) -> dict:
    """The 5.x form (rope_parameters) and the 4.x form (rope_theta, rope_scaling), both read by 5.x."""
    scaling = None
    if config.rope_type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": float(config.rope_factor),
            "low_freq_factor": float(config.rope_low_freq_factor),
            "high_freq_factor": float(config.rope_high_freq_factor),
            "original_max_position_embeddings": int(config.rope_original_max_len),
        }
    parameters = {"rope_theta": float(config.rope_theta), **(scaling or {"rope_type": "default"})}
    return {"rope_parameters": parameters, "rope_theta": float(config.rope_theta), "rope_scaling": scaling}


def _model_type_spelling(model_type: str, base: Mapping | None) -> str:
    """model_type as the source spelled it (a base config of the same type, in any case), else as its publisher
    does (Motif: "Motif")."""
    spelled = (base or {}).get("model_type")
    if isinstance(spelled, str) and spelled.lower() == model_type:
        return spelled
    return motif.PUBLISHED_MODEL_TYPE if model_type == motif.MODEL_TYPE else model_type


def hf_config(config: ModelConfig, *, dtype: str | None = None, base: Mapping | None = None) -> dict:
    """config.json for `config`. base: an original HF config whose other fields (token ids,
    initializer_range, ...) and spelling of model_type are kept when it describes the same model_type."""
    check_exportable(config)
    if motif3.is_motif3_config(config):
        return _motif3_config(config, dtype or config.param_dtype, base)
    kind = attention_kinds.get(config.attention)
    model_type = hf_model_type(config)
    heads = kind.maps  # HF counts DiffLlama's sub-heads
    spelling = _model_type_spelling(model_type, base)
    same_type = spelling == (base or {}).get("model_type")
    values = {k: v for k, v in base.items() if k not in _DERIVED_FIELDS} if same_type else {}
    values.setdefault("initializer_range", float(config.init_std))
    values.setdefault("use_cache", True)
    dtype = dtype or config.param_dtype
    values.update(
        architectures=[motif.ARCHITECTURE if model_type == motif.MODEL_TYPE else kind.hf_architecture],
        model_type=spelling,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.mlp_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=heads * config.num_heads,
        num_key_value_heads=heads * config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act=_MOTIF_ACTIVATIONS[config.activation],
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=float(config.norm_eps),
        tie_word_embeddings=bool(config.tie_embeddings),
        attention_bias=False,
        attention_dropout=0.0,  # diffjax has none (and transformers 5 refuses it for DiffLlama)
        dtype=dtype,
        torch_dtype=dtype,
        **_rope_config(config),
    )
    if model_type == motif.MODEL_TYPE:
        values.update(motif.export_fields(config))
    elif is_diffllama(config):
        values["lambda_std_dev"] = float(config.lambda_std)
    else:
        values.update(mlp_bias=False, pretraining_tp=1)
    return dict(sorted(values.items()))


def _motif3_config(config: ModelConfig, dtype: str, base: Mapping | None) -> dict:
    """Motif 3's config.json: a Motif base config's other fields (token ids, ...) kept, the rest derived."""
    values = motif3.export_fields(config)
    same_type = str((base or {}).get("model_type", "")).lower() == motif.MODEL_TYPE
    kept = {k: v for k, v in base.items() if k not in values and k not in _DERIVED_FIELDS} if same_type else {}
    return dict(sorted({"use_cache": True, **kept, **values, "dtype": dtype, "torch_dtype": dtype}.items()))


# ------------------------------------------------------------------------------------------
# Weights: inverses of hf._qk_from_hf, _v_from_hf, _heads_from_hf


def _rotate_half_from_interleaved(d: int) -> np.ndarray:
    return np.argsort(interleaved_from_rotate_half(d))


def _qk_to_hf(w, permute):
    """(D, n, 2, d) -> (2 n d, D): rows [group * n + head, channel], channels in rotate_half order."""
    D, n, _, d = w.shape
    w = w.transpose(2, 1, 3, 0)
    if permute:
        w = w[:, :, _rotate_half_from_interleaved(d), :]
    return w.reshape(2 * n * d, D)


def _v_to_hf(w):
    """(D, Hkv, 2d) -> (2 Hkv d, D): kv head m's [v_m | v_{m+Hkv}] back to rows [half * Hkv + m]."""
    D, n, two_d = w.shape
    return w.reshape(D, n, 2, two_d // 2).transpose(2, 1, 3, 0).reshape(n * two_d, D)


def _heads_to_hf(w, permute):
    """Standard attention q/k/v (D, n, d) -> (n d, D)."""
    D, n, d = w.shape
    w = w.transpose(1, 2, 0)
    if permute:
        w = w[:, _rotate_half_from_interleaved(d), :]
    return w.reshape(n * d, D)


def _diff_o_to_hf(o, subln):
    """o (H, 2d, D) and subln (2d,) -> o_proj (D, 2 H d), the norm's scale folded into o's rows."""
    H, two_d, D = o.shape
    subln = np.asarray(subln)
    if not np.all(subln == 1):  # x * 1 is exact, but skip the float32 detour for the common case
        o = (o.astype(np.float32) * subln.astype(np.float32)[None, :, None]).astype(o.dtype)
    return o.reshape(H * two_d, D).T


def _inverse(config: ModelConfig, path: tuple, read, read_layer):
    """A function producing the HF tensor for diffjax parameter `path` (a layer's: ("blocks", i, ...)),
    given read(path) -> array and read_layer(stacked path, depth) -> that layer's slice."""
    permute = config.rope_style == "interleaved"
    name = path[-1]
    if path[0] == "blocks":
        get = lambda: np.asarray(read_layer(stacked_path(path), path[1]))  # noqa: E731
    else:
        get = lambda: np.asarray(read(path))  # noqa: E731
    if path[0] == "blocks" and path[2] == "attn":
        if hf_model_type(config) == motif.MODEL_TYPE:
            return motif.attention_inverse(name, get, permute)
        if is_diffllama(config):
            if name in ("q_kernel", "k_kernel"):
                return lambda: _qk_to_hf(get(), permute)
            if name == "v_kernel":
                return lambda: _v_to_hf(get())
            if name == "o_kernel":
                return lambda: _diff_o_to_hf(get(), read_layer(("blocks", "attn", "subln_scale"), path[1]))
            return get  # lambda vectors
        if name in ("q_kernel", "k_kernel", "v_kernel"):
            return lambda: _heads_to_hf(get(), permute and name != "v_kernel")
        return lambda: get().reshape(-1, config.d_model).T  # o (N, d, D) -> (D, N d)
    if name in ("gate_kernel", "up_kernel", "down_kernel", "lm_head"):
        return lambda: get().T
    return get  # embedding, norm scales


def hf_tensor_plan(config: ModelConfig, params: Mapping, dtype=None) -> list[tuple[str, tuple, np.dtype, object]]:
    """[(HF key, shape, dtype, produce())] for every tensor of the HF checkpoint, in HF's order.

    params: {diffjax path: array} (flat, as from `flatten`; layers stacked), or a lazy mapping with `shapes`
    and `dtypes` attributes and a `layer(path, depth)` method that reads an array (or one layer of a
    stacked one) only when asked (then nothing is read here).
    Missing, unexpected or mis-shaped params raise ConversionError, as does a config no HF format expresses.
    """
    check_exportable(config)  # (first: the weight table below is the HF formats')
    shapes = getattr(params, "shapes", None) or {p: tuple(np.shape(v)) for p, v in params.items()}
    dtypes = getattr(params, "dtypes", None) or {p: np.asarray(v).dtype for p, v in params.items()}
    expected = _diffjax_shapes(config)
    problems = [f"missing parameter {path_name(p)} {s}" for p, s in expected.items() if p not in shapes]
    problems += [f"unexpected parameter {path_name(p)} {s}" for p, s in shapes.items() if p not in expected]
    problems += [
        f"parameter {path_name(p)} has shape {shapes[p]}, expected {s}"
        for p, s in expected.items() if p in shapes and tuple(shapes[p]) != s
    ]
    if problems:
        raise ConversionError("params do not match the model config: " + "; ".join(problems))
    read_layer = getattr(params, "layer", None) or (lambda path, depth: params[path][depth])
    if motif3.is_motif3_config(config):
        out_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
        return motif3_weights.export_plan(config, lambda path: params[path], read_layer, dtypes, out_dtype)
    plan = []
    for key, shape, path, _ in weight_table(config):
        leaf = stacked_path(path) if path[0] == "blocks" else path
        out_dtype = np.dtype(jnp.dtype(dtype)) if dtype is not None else np.dtype(dtypes[leaf])
        produce = _inverse(config, path, lambda path: params[path], read_layer)
        plan.append((key, shape, out_dtype, lambda produce=produce, out_dtype=out_dtype: np.asarray(produce()).astype(out_dtype, copy=False)))
    return plan


def _diffjax_shapes(config: ModelConfig) -> dict[tuple, tuple]:
    from diffjax.model.transformer import TransformerLM

    abstract = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    return {path: tuple(v.shape) for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def parse_size(size) -> int:
    """Bytes from an int or a string such as "5GB" (10^9), "500MiB" (2^20), "100KB"."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not match:
        raise ConversionError(f"shard size {size!r} is not a size; use e.g. 5GB, 500MB, 2GiB or a number of bytes")
    number, unit, binary = match.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def _shards(plan, max_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for entry in plan:
        nbytes = int(np.prod(entry[1], dtype=np.int64)) * entry[2].itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return shards + [current] if current else shards


def save_hf(
    model_or_params,
    directory: str | os.PathLike,
    config: ModelConfig | None = None,
    *,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    base_config: Mapping | None = None,
    extra_files: Iterable[str | os.PathLike] = (),
    progress=None,
) -> Path:
    """Write a diffjax model as a Hugging Face directory: config.json and safetensors, sharded past
    `max_shard_size` (model-0000k-of-0000n.safetensors + model.safetensors.index.json).

    model_or_params: a TransformerLM, or its params (an nnx pure dict, nested or flat by path, or a
      lazy `diffjax.checkpoint.CheckpointParams`) with `config`.
    dtype: "float32" / "bfloat16" / "float16" for the saved tensors (None: the params' dtype).
    base_config: an original config.json (dict) whose non-structural fields (token ids, ...) are kept.
    extra_files: files copied alongside (tokenizer, generation_config.json).
    Tensors are produced and written one at a time. A non-empty `directory` is refused unless `overwrite`.
    Loads with `transformers.AutoModelForCausalLM.from_pretrained(directory)`.
    """
    if config is None:
        if not hasattr(model_or_params, "config"):
            raise TypeError("save_hf: pass config= with a params dict (a TransformerLM carries its own)")
        config = model_or_params.config
    if isinstance(model_or_params, nnx.Module):
        params = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model_or_params, nnx.Param))}
    elif hasattr(model_or_params, "shapes") or all(isinstance(k, tuple) for k in model_or_params):
        params = model_or_params  # flat by path (possibly lazy: CheckpointParams)
    else:
        params = flatten(model_or_params)
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise ConversionError(f"dtype must be one of float32, bfloat16, float16, got {dtype!r}")
    plan = hf_tensor_plan(config, params, dtype)  # checks params before touching the directory
    config_json = hf_config(config, dtype=dtype or str(plan[0][2]), base=base_config)
    created = not Path(directory).exists()
    directory = prepare_output_dir(directory, overwrite=overwrite, owned=HF_OUTPUT_FILES)
    written: list[Path] = []
    try:
        _write_export(directory, plan, parse_size(max_shard_size), extra_files, config_json, progress, written)
    except OSError as error:  # a full disk, most often: nothing partial is left
        for path in written:
            path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise CheckpointWriteError(f"writing the export {directory} failed: {error.strerror or error}; nothing of it "
                                   "was kept") from None
    return directory


def _write_export(directory: Path, plan, max_shard_bytes: int, extra_files, config_json: dict, progress,
                  written: list[Path]) -> None:
    """The safetensors shards (and their index), the extra files and config.json, last: it marks a complete export.
    Each file is added to `written` before it is written."""
    def target(name: str) -> Path:
        written.append(directory / name)
        return directory / name

    shards = _shards(plan, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    produce = {key: fn for key, _, _, fn in plan}
    weight_map, total = {}, 0
    for index, (name, shard) in enumerate(zip(names, shards)):
        if progress:
            progress(name, index, len(shards))
        total += write_safetensors(target(name), [(k, s, d) for k, s, d, _ in shard], lambda key: produce[key]())
        weight_map.update({key: name for key, *_ in shard})
    if len(shards) > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        target("model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    for file in extra_files:
        file = Path(file)
        if file.name != "config.json" and not file.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copy2(file, target(file.name))
    target("config.json").write_text(json.dumps(config_json, indent=2) + "\n")
