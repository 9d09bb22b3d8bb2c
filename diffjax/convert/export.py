"""diffjax models -> Hugging Face directories, for every format of the table (diffjax.convert.formats; the inverse
of diffjax.convert.hf). A model's format is derived once from its ModelConfig (`formats.check_exportable`: the one row
that holds it, and nothing it cannot hold); its weight plan's inverse transforms undo the import's re-layout exactly,
so HF -> diffjax -> HF is bit-exact, and its config.json keeps every key of the source's that diffjax does not model.
Settings a format cannot express raise ConversionError naming the setting.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.convert import formats
from diffjax.convert.common import ConversionError, flatten, np_dtype, path_name, prepare_output_dir
from diffjax.convert.formats import CheckpointFormat, check_exportable
from diffjax.convert.model_card import CARD_FILE, model_card
from diffjax.convert.safetensors_io import write_safetensors
from diffjax.convert.weight_plan import export_plan
from diffjax.params_checkpoint import CheckpointWriteError

# Files an export writes (and --overwrite may replace); anything else in the directory is left alone.
HF_OUTPUT_FILES = ("config.json", "model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                   "chat_template*", "added_tokens.json", "vocab.json", "merges.txt", CARD_FILE)


def hf_config(config: ModelConfig, *, dtype: str | None = None, base: Mapping | None = None,
              fmt: CheckpointFormat | None = None) -> dict:
    """config.json for `config` (in `fmt`, None: the format that holds it). base: the config.json it was converted
    from: every key of it the format does not model is kept verbatim (token ids, ...), and its spelling of
    model_type, when it is of the same format."""
    fmt = fmt or check_exportable(config)
    return formats.config_json(fmt, config, dtype=dtype or config.param_dtype, source=base)


def hf_tensor_plan(config: ModelConfig, params: Mapping, dtype=None, *,
                   fmt: CheckpointFormat | None = None) -> list[tuple[str, tuple, np.dtype, object]]:
    """[(HF key, shape, dtype, produce())] for every tensor of the HF checkpoint of `fmt` (None: the format that
    holds `config`), in the checkpoint's order.

    params: {diffjax path: array} (flat, as from `flatten`; layers stacked), or a lazy mapping with `shapes`
    and `dtypes` attributes and a `layer(path, depth)` method that reads an array (or one layer of a
    stacked one) only when asked (then nothing is read here).
    Missing, unexpected or mis-shaped params raise ConversionError, as does a config no HF format expresses.
    """
    fmt = fmt or check_exportable(config)
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
    return export_plan(fmt.weight_plan(config), lambda path: params[path], read_layer, dtypes, np_dtype(dtype))


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
    source: str = "a diffjax model (diffjax.save_hf)",
    license: str | None = None,
    card_name: str | None = None,
) -> Path:
    """Write a diffjax model as a Hugging Face directory: config.json and safetensors, sharded past
    `max_shard_size` (model-0000k-of-0000n.safetensors + model.safetensors.index.json), and its model card README.md
    (diffjax.convert.model_card: `source`, a phrase saying where the weights came from; `license`, the Hub's license
    identifier, else an extra README.md's (a source's card, which follows ours); `card_name`, the name to load it
    by, default the directory).

    model_or_params: a TransformerLM, or its params (an nnx pure dict, nested or flat by path, or a
      lazy `diffjax.checkpoint.CheckpointParams`) with `config`.
    dtype: "float32" / "bfloat16" / "float16" for the saved tensors (None: the params' dtype).
    base_config: the config.json it was converted from (dict): every key its format does not model (token ids, ...)
      is kept verbatim.
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
    fmt = check_exportable(config)  # the format, derived once
    plan = hf_tensor_plan(config, params, dtype, fmt=fmt)  # checks params before touching the directory
    config_json = hf_config(config, dtype=dtype or str(plan[0][2]), base=base_config, fmt=fmt)
    extra_files = [Path(file) for file in extra_files]
    source_card = next((file.read_text(encoding="utf-8") for file in extra_files if file.name == CARD_FILE), None)
    card = model_card(config, fmt, parameters=sum(int(np.prod(shape)) for _, shape, _, _ in plan),
                      dtype=str(plan[0][2]), source=source, name=card_name or str(directory),
                      license_id=license, source_card=source_card)
    created = not Path(directory).exists()
    directory = prepare_output_dir(directory, overwrite=overwrite, owned=HF_OUTPUT_FILES)
    written: list[Path] = []
    try:
        _write_export(directory, plan, parse_size(max_shard_size), extra_files, config_json, card, progress, written)
    except OSError as error:  # a full disk, most often: nothing partial is left
        for path in written:
            path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise CheckpointWriteError(f"writing the export {directory} failed: {error.strerror or error}; nothing of it "
                                   "was kept") from None
    return directory


def _write_export(directory: Path, plan, max_shard_bytes: int, extra_files, config_json: dict, card: str, progress,
                  written: list[Path]) -> None:
    """The safetensors shards (and their index), the extra files, the model card (in place of an extra one) and
    config.json, last: it marks a complete export. Each file is added to `written` before it is written."""
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
        if file.name not in ("config.json", CARD_FILE) and not file.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copy2(file, target(file.name))
    target(CARD_FILE).write_text(card, encoding="utf-8")
    target("config.json").write_text(json.dumps(config_json, indent=2) + "\n")
