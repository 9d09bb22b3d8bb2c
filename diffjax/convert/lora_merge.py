"""`python -m diffjax.convert merge-lora RUN DST`: a LoRA run's model, its adapters merged into the base weights,
as a params-only run directory (which trains on, loads with load_model and exports like any conversion).

A LoRA run directory's checkpoints hold only what trained (the adapters and the lora.trainable base params)
and the checksums of the base it trained on; its config.yaml names the base (train.init_from) and the lora
settings. diffjax.params_checkpoint.merged_lora_params reads both, refuses a base that changed since (the
adapters would not fit it), and merges (diffjax.lora.merge). `diffjax-to-hf RUN DST` of a LoRA run merges on the
way (hf_directories.diffjax_to_hf). The whole base is held in host memory while merging.
"""

from __future__ import annotations

from pathlib import Path

from diffjax.convert.common import refuse_overlap
from diffjax.params_checkpoint import merged_lora_params, save_params
from diffjax.run_dir import RunDir


def merge_lora_directory(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Write the LoRA run `src`'s merged model as a params-only run directory `dst` (with the base's hf/ files, so
    that diffjax-to-hf restores its tokenizer and token ids); returns the step directory."""
    from diffjax.convert.hf_directories import conversion_run_dir, keep_hf_files

    result = merged_lora_params(src)
    if result is None:
        raise ValueError(f"{src} is not a LoRA run (its config.yaml has no lora section with rank > 0)")
    params, model_config, base_step = result
    base = RunDir.of_step(base_step)
    refuse_overlap(base.path, dst, source_name="the LoRA run's base (train.init_from)")  # (SRC: checked by the CLI)
    base_hf = base.hf
    with conversion_run_dir(dst, overwrite=overwrite) as run:
        data = keep_hf_files(base_hf, run) if base_hf.is_dir() else None
        return save_params(run.path, params, model_config, data=data)
