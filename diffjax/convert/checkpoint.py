"""HF directories <-> diffjax run directories (the checkpoints train.py resumes from and load_model loads).

A converted run directory is written by `diffjax.checkpoint.save_params`:

    DST/config.yaml                     a run config whose `model` section is the converted ModelConfig
    DST/checkpoints/0/state             Orbax, {"params": nnx pure dict}
    DST/hf/                             the source's config.json, tokenizer and generation files, kept
                                        so that diffjax-to-hf restores token ids and the tokenizer

save_params writes without OCDBT and without Orbax's defensive copy of host arrays, so it adds a
bounded amount of memory to the params (tests/test_convert_streaming.py measures it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from diffjax.checkpoint import CheckpointParams, resolve_checkpoint, save_params, saved_model_config
from diffjax.config import ModelConfig
from diffjax.convert.common import nested, prepare_output_dir
from diffjax.convert.export import save_hf
from diffjax.convert.hf import config_from_hf, params_from_hf_dir, read_hf_config

DIFFJAX_OUTPUT_FILES = ("config.yaml", "checkpoints", "hf")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def hf_to_diffjax(src, dst, *, dtype: str | None = None, overwrite: bool = False, progress=None) -> Path:
    """Convert the HF directory `src` (diffllama or llama; safetensors or .bin) into the diffjax run
    directory `dst`, streaming one weight file at a time. dtype: parameter (and compute) dtype,
    None keeps the checkpoint's. Returns the step directory."""
    src, dst = Path(src), Path(dst)
    config = config_from_hf(read_hf_config(src), dtype=dtype)
    created = not dst.exists()
    dst = prepare_output_dir(dst, overwrite=overwrite, owned=DIFFJAX_OUTPUT_FILES)
    try:
        params = params_from_hf_dir(src, config, config.param_dtype, progress=progress)
        (dst / "hf").mkdir()
        for file in sorted(src.iterdir()):  # config.json, tokenizer, generation config: everything but weights
            if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(file, dst / "hf" / file.name)
        tree = nested(params)
        del params
        return save_params(dst, tree, config)
    except BaseException:
        if created:  # leave no half-written directory behind
            shutil.rmtree(dst, ignore_errors=True)
        raise


def read_run_config(src) -> tuple[Path, Path, ModelConfig]:
    """(run dir, step dir, ModelConfig) of a diffjax run directory, checkpoints/ dir or step dir."""
    step_dir = resolve_checkpoint(src)
    return step_dir.parent.parent, step_dir, saved_model_config(step_dir)


def diffjax_to_hf(src, dst, *, dtype: str | None = None, max_shard_size="5GB", overwrite: bool = False,
                  progress=None) -> Path:
    """Export a diffjax run directory or checkpoint (trainer-written or converted) as an HF directory,
    reading and writing one tensor at a time."""
    run_dir, step_dir, config = read_run_config(src)
    params = CheckpointParams(step_dir)
    side = run_dir / "hf"
    base = read_hf_config(side) if (side / "config.json").exists() else None
    extra = [f for f in sorted(side.iterdir()) if f.is_file()] if side.is_dir() else []
    return save_hf(params, dst, config, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                   base_config=base, extra_files=extra, progress=progress)
