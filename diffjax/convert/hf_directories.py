"""HF directories <-> diffjax run directories (the checkpoints train.py resumes from and load_model loads).

A converted run directory (diffjax/run_dir.py) is written by `diffjax.params_checkpoint.save_params_streamed`:

    DST/config.yaml                     a run config whose `model` section is the converted ModelConfig
    DST/checkpoints/0/state             Orbax, {"params": nnx pure dict}
    DST/hf/                             the source's config.json, tokenizer and generation files, kept
                                        so that diffjax-to-hf restores token ids and the tokenizer; with a
                                        tokenizer.json, config.yaml's data.tokenizer names it (kind hf), so
                                        train.py and generate use the checkpoint's own tokenizer

Every format's checkpoint is written tensor by tensor as its shards are read (save_params_streamed): peak memory is
about one shard, not the model (tests/test_convert_streaming.py measures it).
"""

from __future__ import annotations

from pathlib import Path

from diffjax.config import ModelConfig
from diffjax.convert import formats, hub
from diffjax.convert.common import np_dtype, refuse_overlap
from diffjax.convert.conversion_dir import conversion_run_dir, keep_hf_files
from diffjax.convert.export import save_hf
from diffjax.convert.hf import checked_weights, convert_files, read_hf_config
from diffjax.convert.weight_plan import Converter, leaf_shapes
from diffjax.params_checkpoint import CheckpointParams, resolve_checkpoint, save_params_streamed, saved_model_config
from diffjax.run_dir import RunDir


def _hf_side(run: RunDir) -> Path:
    """RUN/hf/: the run's own, or for a run trained from another (train.init_from) without one, the first of its
    bases' (a fine-tuned conversion exports with the source's config.json keys and tokenizer files)."""
    from diffjax.config_values import read_yaml_mapping

    seen = set()
    while not run.hf.is_dir() and run.config_file.exists() and run.path not in seen:
        seen.add(run.path)
        init_from = (read_yaml_mapping(run.config_file).get("train") or {}).get("init_from")
        if not init_from:
            break
        run = RunDir.of_step(resolve_checkpoint(init_from, f"{run.config_file}'s train.init_from"))
    return run.hf


def hf_to_diffjax(src, dst, *, dtype: str | None = None, overwrite: bool = False, progress=None,
                  revision: str | None = None, trust_remote_code: bool = False) -> Path:
    """Convert the HF directory or Hub name `src` (any format of diffjax.convert.formats; safetensors or .bin) into
    the diffjax run directory `dst`. dtype: parameter (and compute) dtype, None keeps the checkpoint's.
    revision, trust_remote_code: a Hub name's (diffjax.convert.hub; the repository's Python files are fetched, and
    kept in DST/hf/, only with trust_remote_code). Returns the step directory.

    Each converted tensor goes into its place in the checkpoint as its shard is read (Motif 3's published checkpoint
    is 629 GB): peak memory is about one shard, not the model."""
    if (resolved := hub.resolve(src, revision=revision, trust_remote_code=trust_remote_code)) != src:
        refuse_overlap(resolved, dst)  # a Hub name's snapshot (the CLI checks the name only)
    src = resolved
    hf = read_hf_config(src)
    fmt = formats.detect(hf)
    config = formats.model_config(fmt, hf, dtype=dtype)
    with conversion_run_dir(dst, overwrite=overwrite, command="hf-to-diffjax") as run:
        weights, names, rows = checked_weights(src, config, fmt)
        dtype = np_dtype(config.param_dtype)
        leaves = {path: (shape, dtype) for path, shape in leaf_shapes(config, rows).items()}

        def fill(write):
            convert_files(weights, names, Converter(config, rows, dtype, write), progress=progress)

        return save_params_streamed(run.path, leaves, fill, config, data=keep_hf_files(src, run))


def read_run_config(src) -> tuple[Path, Path, ModelConfig]:
    """(run dir, step dir, ModelConfig) of a diffjax run directory, checkpoints/ dir or step dir."""
    step_dir = resolve_checkpoint(src)
    return RunDir.of_step(step_dir).path, step_dir, saved_model_config(step_dir)


def diffjax_to_hf(src, dst, *, dtype: str | None = None, max_shard_size="5GB", overwrite: bool = False,
                  progress=None, license: str | None = None, card_name: str | None = None) -> Path:
    """Export a diffjax run directory or checkpoint (trainer-written or converted) as an HF directory with its model
    card (license: the Hub's license identifier, else the source's card's; card_name: the name it loads by, a Hub id
    it is pushed to), reading and writing one tensor at a time. A LoRA run's adapters are merged into its base as
    each base tensor is read (diffjax.convert.lora_merge.LazyMergedParams)."""
    from diffjax.convert.lora_merge import LazyMergedParams

    _, step_dir, config = read_run_config(src)
    source = f"the diffjax checkpoint `{step_dir}`"
    params = LazyMergedParams.of(step_dir)
    if params is not None:  # a LoRA run: its adapters merged into the base (train.init_from), whose hf/ files it has
        adapters_step, (config, step_dir) = step_dir, (params.model_config, params.root_step)
        source = f"the LoRA adapters of `{adapters_step}` merged into their base `{step_dir}`"
    else:
        params = CheckpointParams(step_dir)
    side = _hf_side(RunDir.of_step(step_dir))
    base = read_hf_config(side) if (side / "config.json").exists() else None
    extra = [f for f in sorted(side.iterdir()) if f.is_file()] if side.is_dir() else []
    if base is not None:
        source += " (converted from a Hugging Face checkpoint, whose config.json keys and files it keeps)"
    return save_hf(params, dst, config, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                   base_config=base, extra_files=extra, progress=progress, source=source, license=license,
                   card_name=card_name)
