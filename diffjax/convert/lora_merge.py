"""A LoRA run's model with its adapters merged into the base weights: `diffjax-convert merge-lora RUN DST`
(a params-only run directory, which trains on, loads with load_model and exports like any conversion) and the lazy
mapping `diffjax-to-hf RUN DST` of a LoRA run exports from (hf_directories.diffjax_to_hf).

A LoRA run directory's checkpoints hold only what trained (the adapters and the lora.trainable base params)
and the checksums of the base it trained on; its config.yaml names the base (train.init_from) and the lora
settings. diffjax.params_checkpoint.lora_run reads both and compares the models; a base that changed since is
refused (the adapters would not fit it). Both commands read the base one leaf, or one layer of a stack, at a time
(LazyMergedParams over CheckpointParams), merging each as it is read: peak memory is a layer's tensors, not the
model (load_model and train.init_from of a LoRA run merge in memory: params_checkpoint.merged_lora_params).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from diffjax import lora
from diffjax.convert.common import refuse_overlap
from diffjax.params_checkpoint import CheckpointParams, is_stacked, lora_run, save_params_streamed
from diffjax.run_dir import RunDir
from diffjax.state_layout import PARAMS


def merge_lora_directory(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Write the LoRA run `src`'s merged model as a params-only run directory `dst` (with the base's hf/ files, so
    that diffjax-to-hf restores its tokenizer and token ids), one merged leaf (one layer of a stack) at a time
    (save_params_streamed); returns the step directory."""
    from diffjax.convert.conversion_dir import conversion_run_dir, keep_hf_files

    params = LazyMergedParams.of(src)
    if params is None:
        raise ValueError(f"{src} is not a LoRA run (its config.yaml has no lora section with rank > 0)")
    base = RunDir.of_step(params.root_step)
    refuse_overlap(base.path, dst, source_name="the LoRA run's base (train.init_from)")  # (SRC: checked by the CLI)
    leaves = {path: (params.shapes[path], params.dtypes[path]) for path in params}

    def fill(write):
        for path, (shape, _) in leaves.items():
            if is_stacked(path):  # a layer segment's stack: one layer at a time
                for depth in range(shape[0]):
                    write(path, depth, params.layer(path, depth))
            else:
                write(path, None, params[path])

    with conversion_run_dir(dst, overwrite=overwrite, command="merge-lora") as run:
        data = keep_hf_files(base.hf, run) if base.hf.is_dir() else None
        return save_params_streamed(run.path, leaves, fill, params.model_config, data=data)


class LazyMergedParams(Mapping):
    """The merged params of a LoRA run as CheckpointParams' read-only mapping {path: numpy array} (with `shapes`,
    `dtypes` and `layer(path, depth)`): each access reads one base leaf, or one layer of it, from disk, puts back
    the trained value of a lora.trainable param and adds its adapter's (alpha / r) A @ B in float32, as lora.merge
    does. The base's checksums are checked leaf by leaf on construction (one leaf in memory at a time).
    `model_config`; `root_step`: the first base that is no LoRA run (whose hf/ files an export keeps)."""

    def __init__(self, run):
        nested_base = lora_run(run.base_step, what=run.base_what)
        self.base = CheckpointParams(run.base_step) if nested_base is None else LazyMergedParams(nested_base)
        self.root_step = run.base_step if nested_base is None else self.base.root_step
        self.model_config, self.config = run.model_config, run.config
        self.shapes, self.dtypes = self.base.shapes, self.base.dtypes
        self._trained = dict(lora._flat(run.saved[PARAMS].get(lora.BASE, {})))
        self._adapters = dict(lora._adapter_pairs(run.saved[PARAMS][lora.ADAPTERS]))
        run.check_base({".".join(path): lora.host_checksum(self.base[path]) for path in self.base})

    @classmethod
    def of(cls, path) -> LazyMergedParams | None:
        """The lazy merged params of the LoRA run at `path`; None when it is not a LoRA run."""
        run = lora_run(path)
        return None if run is None else cls(run)

    def _merged(self, path, w, layer: slice | int):
        pair = self._adapters.get(path)
        if pair is None:
            return w
        update = lora.delta(pair[lora.A][layer], pair[lora.B][layer], w.shape, self.config.scale)
        return np.asarray((jnp.asarray(w, jnp.float32) + update).astype(w.dtype))

    def __getitem__(self, path) -> np.ndarray:
        w = self._trained[path] if path in self._trained else self.base[path]
        return self._merged(path, np.asarray(w), slice(None))

    def layer(self, path, depth: int) -> np.ndarray:
        w = self._trained[path][depth] if path in self._trained else self.base.layer(path, depth)
        return self._merged(path, np.asarray(w), depth)

    def __iter__(self):
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)
