"""A LoRA run's model with its adapters merged into the base weights (diffjax.lora.merge), for export.

A LoRA run directory's checkpoints hold only what trained (the adapters and the lora.trainable base params)
and the checksums of the base it trained on; its config.yaml names the base (train.init_from) and the lora
settings. `merged_lora_params` reads both, refuses a base that changed since (the adapters would not fit it),
and merges. `python -m diffjax.convert merge-lora RUN DST` writes the merged model as a params-only run
directory (which trains on, loads with load_model and exports like any conversion); `diffjax-to-hf RUN DST`
of a LoRA run merges on the way (hf_directories.diffjax_to_hf). The whole base is held in host memory while merging.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import yaml

from diffjax import lora
from diffjax.config import RUNTIME_FIELDS, ModelConfig
from diffjax.params_checkpoint import load_params, resolve_checkpoint, save_params, saved_model_config
from diffjax.run_dir import RunDir, state_dir

CHECKSUMS = "base_checksums"  # the trainer's state key (diffjax.train.step.sharded_lora_init)


def lora_settings(run_dir: str | Path) -> tuple[lora.LoraConfig, str] | None:
    """(LoraConfig, train.init_from) of a LoRA run directory; None for any other run directory."""
    from diffjax.train.config import build_config

    config_file = RunDir(Path(run_dir)).config_file
    saved = (yaml.safe_load(config_file.read_text()) or {}) if config_file.exists() else {}
    section = saved.get("lora") or {}
    if not section or not section.get("rank"):
        return None
    config = build_config(lora.LoraConfig, section, prefix="lora")
    init_from = (saved.get("train") or {}).get("init_from")
    if not init_from:
        raise ValueError(f"{config_file}: a LoRA run (lora.rank {config.rank}) without train.init_from (its base)")
    return config, init_from


def _read_state_items(step_dir: Path, keys: tuple[str, ...]) -> dict:
    """Items of a trainer checkpoint's state as host numpy arrays (nothing else is read)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(state_dir(step_dir)).item_metadata
    missing = [key for key in keys if saved.get(key) is None]
    if missing:
        raise ValueError(f"checkpoint {step_dir} holds no {', '.join(missing)}: not a LoRA trainer's checkpoint")
    target = {key: jax.tree.map(lambda m: np.empty(m.shape, m.dtype), dict(saved[key])) for key in keys}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    return checkpointer.restore(state_dir(step_dir), args=ocp.args.PyTreeRestore(
        target, restore_args=restore_args, partial_restore=True))


def merged_lora_params(src: str | Path) -> tuple[dict, ModelConfig, Path] | None:
    """(merged params as a nested dict of numpy arrays, the ModelConfig, the base's step directory) of the LoRA run
    directory / checkpoint `src` (its newest intact checkpoint); None when `src` is not a LoRA run."""
    step_dir = resolve_checkpoint(src)
    run = RunDir.of_step(step_dir)
    settings = lora_settings(run.path)
    if settings is None:
        return None
    config, init_from = settings
    model_config = saved_model_config(step_dir)
    base_step = resolve_checkpoint(init_from, f"{run.config_file}'s train.init_from (the LoRA run's base)")
    base_config = saved_model_config(base_step)
    differing = [f.name for f in dataclasses.fields(ModelConfig) if f.init and f.name not in RUNTIME_FIELDS
                 and getattr(base_config, f.name) != getattr(model_config, f.name)]
    if differing:
        raise ValueError(f"the LoRA run {run.path} and its base {base_step} (train.init_from) are different models "
                         f"(model.{', model.'.join(differing)} differ)")
    saved = _read_state_items(step_dir, ("params", CHECKSUMS))
    base = load_params(base_step, what="train.init_from")
    changed = lora.changed_leaves(saved[CHECKSUMS], jax.device_get(jax.jit(lora.checksums)(base)))
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ValueError(f"the base model changed since the LoRA checkpoint {step_dir} was saved: train.init_from "
                         f"{init_from} now holds different {', '.join(changed[:3])}{more}; the adapters fit the "
                         "base they were trained on only")
    merged = lora.model_params(saved["params"], base, config)
    return jax.tree.map(np.asarray, merged), model_config, base_step


def merge_lora_directory(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Write the LoRA run `src`'s merged model as a params-only run directory `dst` (with the base's hf/ files, so
    that diffjax-to-hf restores its tokenizer and token ids); returns the step directory."""
    from diffjax.convert.hf_directories import conversion_run_dir, keep_hf_files

    result = merged_lora_params(src)
    if result is None:
        raise ValueError(f"{src} is not a LoRA run (its config.yaml has no lora section with rank > 0)")
    params, model_config, base_step = result
    base_hf = RunDir.of_step(base_step).hf
    with conversion_run_dir(dst, overwrite=overwrite) as run:
        data = keep_hf_files(base_hf, run) if base_hf.is_dir() else None
        return save_params(run.path, params, model_config, data=data)
