"""Hugging Face directories -> diffjax models, for every format of the table (diffjax.convert.formats: DiffLlama,
Llama, Motif, Motif 3; the inverse is diffjax.convert.export). A directory's format is detected once, from its
config.json; its ModelConfig and weight plan come from that row, and the tensors are read one at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path as FsPath

from flax import nnx

from diffjax.config import ModelConfig
from diffjax.convert import formats, hub
from diffjax.convert.common import ConversionError, build_module, np_dtype
from diffjax.convert.formats import CheckpointFormat
from diffjax.convert.hf_files import HFWeights
from diffjax.convert.weight_plan import Converter, canonical_names, check_names
from diffjax.model.transformer import TransformerLM


def config_from_hf(hf: dict, *, dtype=None, param_dtype=None) -> ModelConfig:
    """ModelConfig for an HF config.json dict. dtype None: the checkpoint's own dtype.

    Settings diffjax cannot express raise ConversionError naming the setting and what is allowed.
    """
    return formats.config_from_hf(hf, dtype=dtype, param_dtype=param_dtype)


def params_from_hf(tensors, config: ModelConfig, dtype=None, *, fmt: CheckpointFormat | None = None) -> dict:
    """HF state dict (name -> tensor or array) -> {diffjax path: numpy array} in the canonical layout, by the plan of
    `fmt` (None: the format that holds `config`).

    Missing, unexpected and mis-shaped keys raise ConversionError naming them. dtype: cast to it (None: keep).
    """
    fmt = fmt or formats.of_config(config)
    rows = fmt.weight_plan(config)
    names = canonical_names(tensors)
    check_names({names[k]: tuple(v.shape) for k, v in tensors.items()}, rows, fmt)
    converter = Converter(config, rows, np_dtype(dtype))
    for key, value in tensors.items():
        converter.add(names[key], value)
    return converter.params


def checked_weights(directory: str | os.PathLike, config: ModelConfig, fmt: CheckpointFormat):
    """(the weight files of an HF directory, their canonical names, `fmt`'s plan for `config`), the tensors' names and
    shapes checked from the file headers (nothing is read)."""
    weights = HFWeights(directory)
    rows, names = fmt.weight_plan(config), canonical_names(weights.shapes())
    check_names({names[k]: s for k, s in weights.shapes().items()}, rows, fmt)
    return weights, names, rows


def convert_files(weights: HFWeights, names: dict, converter: Converter, *, progress=None) -> None:
    """Feed every tensor to `converter`, one weight file at a time; each is dropped once converted.
    progress: called with (file name, index, count) before each file."""
    for index, file in enumerate(weights.files):
        if progress:
            progress(file.name, index, len(weights.files))
        for name, array in weights.tensors(file):
            converter.add(names[name], array)
            del array


def params_from_hf_dir(directory: str | os.PathLike, config: ModelConfig, dtype=None, *, progress=None,
                       fmt: CheckpointFormat | None = None) -> dict:
    """The params of an HF directory, read one weight file and one tensor at a time.

    Keys and shapes are checked from the file headers before any tensor is read. Peak memory is
    the converted params plus one tensor (safetensors) or one memory-mapped file (.bin).
    """
    fmt = fmt or formats.of_config(config)
    weights, names, rows = checked_weights(directory, config, fmt)
    converter = Converter(config, rows, np_dtype(dtype))
    convert_files(weights, names, converter, progress=progress)
    return converter.params


def read_hf_tensors(directory: str | os.PathLike) -> dict:
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
    """Load an HF model of any format of the table (diffjax.convert.formats: model_type diffllama, llama or motif): a
    local directory (config.json + safetensors, or PyTorch .bin files) or a Hugging Face Hub name `org/name` at
    `revision` (read through huggingface_hub's cache: diffjax.convert.hub; a local directory of that path wins).

    dtype: compute dtype (and parameter dtype unless param_dtype is given); None keeps the
    checkpoint's dtype. The returned model's `model.config` is its ModelConfig.
    rope_style: "interleaved" (canonical; q/k channels permuted at load) or "rotate_half" (HF order kept).
    """
    path = hub.resolve(path, revision=revision)
    hf = read_hf_config(path)
    return load_detected(path, hf, formats.detect(hf), dtype=dtype, param_dtype=param_dtype, rope_style=rope_style)


def load_detected(path, hf: dict, fmt: CheckpointFormat, *, dtype=None, param_dtype=None,
                  rope_style: str = "interleaved") -> TransformerLM:
    """load_hf of the local directory `path` whose config.json `hf` is of the format `fmt` (detected by the caller)."""
    config = formats.model_config(fmt, hf, dtype=dtype, param_dtype=param_dtype).replace(rope_style=rope_style)
    params = params_from_hf_dir(path, config, config.param_dtype, fmt=fmt)
    return build_module(lambda: TransformerLM(config, rngs=nnx.Rngs(0)), params, config.param_dtype, consume=True)
