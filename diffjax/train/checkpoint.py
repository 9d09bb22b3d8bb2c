"""Orbax checkpoints of a run: train state (params, optimizer state, step, RNG) and data-iterator state.

Layout: <run_dir>/checkpoints/<step>/{state, data, digest.json}. Orbax writes each checkpoint into a
temporary directory and renames it when complete, so a crash during a save leaves the previous checkpoint
as the latest restorable one (leftover temporary directories are removed on the next start). The digest
(integrity.py) is written when a save is complete and checked before a restore.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from diffjax.config import DataConfig, ModelConfig
from diffjax.model import TransformerLM
from diffjax.parallel import allgather_json
from diffjax.train import integrity
from diffjax.train.config import CheckpointConfig, RunConfig, TrainConfig, read_yaml, save_run_config
from diffjax.train.optimizer import path_name


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, most often); the earlier ones are intact."""


class Checkpointer:
    def __init__(self, run_dir: str | Path, config: CheckpointConfig):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self._async, self._saving = config.async_save, None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            enable_async_checkpointing=config.async_save,
            cleanup_tmp_directories=True,
            create=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_digest) if config.async_save else None,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def _write_digest(self) -> None:
        """The digest of the save just completed. Asynchronous saves call this from Orbax's post-finalization
        callback, before the temporary directory is renamed into place: the digest arrives with the checkpoint."""
        if jax.process_index() == 0:
            temporary = sorted(self.directory.glob(f"{self._saving}.orbax-checkpoint-tmp*"))
            integrity.write_digest(temporary[-1] if temporary else self.directory / str(self._saving))

    def state_keys(self, step: int) -> set[str]:
        """Top-level keys of a checkpoint's state: {"params"} alone for a params-only (converted) checkpoint."""
        return set(self.manager.item_metadata(step)["state"].keys())

    def newest_intact(self, log) -> int | None:
        """The newest checkpoint whose files match their digest and whose metadata reads; each damaged
        newer one is reported and set aside (integrity.py). A checkpoint without a digest (params-only,
        or a kill right after its save) is used after the metadata check alone."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            step_dir = self.directory / str(step)
            problem = integrity.find_damage(step_dir)
            if problem is None:
                try:
                    self.state_keys(step)
                except Exception as error:  # any failure to read it means the same: not usable
                    problem = f"unreadable: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if problem is None:
                if not integrity.has_digest(step_dir):
                    log(f"note: checkpoint {step_dir} has no digest; restoring it unverified")
                return step
            if jax.process_index() == 0:
                moved = integrity.set_aside(step_dir)
                log(f"warning: checkpoint {step_dir} is damaged ({problem}); skipped it and moved it to {moved}")
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
            self.manager.reload()
        return None

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Starts saving (in the background when async); every process calls it at the same step.
        The data item holds every process's iterator state (each reads its own shard)."""
        data = {"per_process": allgather_json(data_state)}
        self.wait()  # the previous save must have succeeded; the digest callback names the step being saved
        self._check_space(step)
        self._saving = step
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)), force=True
        )
        if not self._async:
            self._write_digest()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict | None]:
        """(state, this process's data-iterator state) of checkpoint `step`. `abstract_state` gives structure,
        shapes, dtypes and the shardings to restore onto (any mesh). The data state is None when the
        checkpoint was written by a different number of processes (their positions do not map)."""
        self._check_params_fit(step, abstract_state["params"])
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
        )
        per_process = restored["data"]["per_process"]
        data_state = per_process[jax.process_index()] if len(per_process) == jax.process_count() else None
        return restored["state"], data_state

    def _check_params_fit(self, step: int, abstract_params: Any) -> None:
        """A ValueError naming the differing parameters when checkpoint `step` holds another model (a run
        directory whose config.yaml is gone, resumed with a different model section)."""
        def shapes(tree):
            return {path_name(path): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)}

        saved, expected = shapes(self.manager.item_metadata(step)["state"]["params"]), shapes(abstract_params)
        differing = sorted(name for name in saved.keys() | expected.keys() if saved.get(name) != expected.get(name))
        if differing:
            shown = ", ".join(f"{name} (saved {saved.get(name, 'none')}, this model {expected.get(name, 'none')})"
                              for name in differing[:3])
            raise ValueError(
                f"checkpoint {self.directory / str(step)} holds a different model than this run's: {shown}"
                f"{f' and {len(differing) - 3} more' if len(differing) > 3 else ''}; resume it with the model it was "
                "trained with or choose another train.run_dir"
            )

    def read(self, step: int) -> dict:
        """{"state": ..., "data": ...} of checkpoint `step` as saved (no target: host arrays), for inspection."""
        return dict(self.manager.restore(step))

    def _check_space(self, step: int) -> None:
        """Refuse to start a save the disk cannot hold (the size of the newest checkpoint, from its digest):
        a clear stop now instead of Orbax's errors from its background thread one save later."""
        newest = self.manager.latest_step()
        needed = integrity.saved_bytes(self.directory / str(newest)) if newest is not None else 0
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise SaveError(
                f"not enough disk space to save the checkpoint of step {step} in {self.directory} "
                f"({free / 2**20:.1f} MiB free, a checkpoint takes {needed / 2**20:.1f} MiB); "
                f"the newest checkpoint, step {newest}, is intact: free some space and rerun to resume"
            )

    def wait(self) -> None:
        """Waits for the save in flight; its failure becomes a SaveError (and its temporary directory goes)."""
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # Orbax re-raises whatever its background thread met
            for temporary in self.directory.glob(f"{self._saving}.orbax-checkpoint-tmp*"):
                shutil.rmtree(temporary, ignore_errors=True)
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise SaveError(f"saving the checkpoint of step {self._saving} in {self.directory} failed: {message}; "
                            f"the newest checkpoint, step {self.manager.latest_step()}, is intact") from None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def resolve_checkpoint(path: str | Path, what: str = "checkpoint") -> Path:
    """One step's directory from `path`: a run directory or its checkpoints/ directory (newest step),
    or a step directory itself. `what` names the setting in errors (e.g. "train.init_from")."""
    path = Path(path).absolute()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.name.isdigit() and (path / "state").is_dir():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{what}: {path} is not a run directory or checkpoint")
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "state").is_dir())
    if not steps:
        raise FileNotFoundError(f"{what}: no checkpoint under {path}")
    return path / str(steps[-1])


def state_keys(step_dir: Path) -> set[str]:
    """Top-level keys of a checkpoint's state: {"params"} alone for a params-only (converted) checkpoint."""
    return set(ocp.PyTreeCheckpointer().metadata(Path(step_dir) / "state").item_metadata.keys())


def load_params(path: str | Path, abstract_params: Any = None, *, what: str = "checkpoint") -> Any:
    """The params of a checkpoint (full train state or params-only), without reading the optimizer state.

    `abstract_params` (ShapeDtypeStructs, optionally with shardings) checks shapes and places the arrays;
    None gives host numpy arrays in the saved structure.
    """
    step_dir = resolve_checkpoint(path, what)
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(step_dir / "state").item_metadata.get("params")
    if saved is None:
        raise ValueError(f"{what}: checkpoint {step_dir} holds no params")
    if abstract_params is None:
        abstract_params = _int_keys(jax.tree.map(lambda m: np.empty(m.shape, m.dtype), saved))
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract_params)
    else:
        _check_same_params(saved, abstract_params, f"{what}: checkpoint {step_dir} does not match this model")
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
    try:
        restored = checkpointer.restore(
            step_dir / "state",
            args=ocp.args.PyTreeRestore({"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True),
        )
    except (ValueError, KeyError) as error:
        raise ValueError(f"{what}: checkpoint {step_dir} does not match this model ({error})") from None
    return restored["params"]


def _int_keys(tree: Any) -> Any:
    """Digit-string dict keys back to ints (the layer indices of an nnx pure dict)."""
    if not isinstance(tree, dict):
        return tree
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in tree.items()}


def _check_same_params(saved: Any, expected: Any, message: str) -> None:
    """Raise ValueError(message + the missing, unexpected and mis-shaped parameter paths)."""
    def shapes(tree):  # Orbax stores the int keys of layer lists as strings: compare dotted names
        return {path_name(path): tuple(x.shape)
                for path, x in jax.tree_util.tree_leaves_with_path(tree)}

    saved_shapes, expected_shapes = shapes(saved), shapes(expected)
    problems = []
    if missing := sorted(set(expected_shapes) - set(saved_shapes)):
        problems.append(f"missing {missing}")
    if unexpected := sorted(set(saved_shapes) - set(expected_shapes)):
        problems.append(f"unexpected {unexpected}")
    problems += [
        f"{key} has shape {saved_shapes[key]}, expected {shape}"
        for key, shape in sorted(expected_shapes.items()) if key in saved_shapes and saved_shapes[key] != shape
    ]
    if problems:
        raise ValueError(f"{message}: {'; '.join(problems)}")


def restore_params(path: str | Path, abstract_state: Any) -> Any:
    """train.init_from: the params of a run directory / checkpoint, shaped and placed like this run's."""
    return load_params(path, abstract_state["params"], what="train.init_from")


def save_params(run_dir: str | Path, params: Any, model_config: ModelConfig, *, step: int = 0) -> Path:
    """A params-only checkpoint in run-directory layout: <run_dir>/config.yaml and checkpoints/<step>/state.

    `train.py train.run_dir=<run_dir>` continues training from it (a fresh optimizer), `train.init_from`
    fine-tunes from it and `load_model` loads it. Refuses a directory that already holds checkpoints.
    """
    run_dir = Path(run_dir).absolute()
    if (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        raise FileExistsError(f"{run_dir / 'checkpoints'} already holds checkpoints; choose an empty directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    data = DataConfig(seq_len=min(DataConfig.seq_len, model_config.max_seq_len))
    # Peak memory ~ the params alone (the converter streams models larger than half the machine's memory):
    # OCDBT would hold the whole encoded checkpoint until it commits, and the default numpy handler copies
    # every array (needed only for asynchronous saves; this one is synchronous).
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, save_concurrent_gb=1, type_handler_registry=registry)
    manager = ocp.CheckpointManager(run_dir / "checkpoints", item_handlers={"state": handler},
                                    options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
    params = jax.tree.map(np.asarray, params)  # jax arrays to host numpy (numpy arrays: no copy)
    manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"params": params})), force=True)
    manager.wait_until_finished()
    manager.close()
    save_run_config(RunConfig(model=model_config, data=data, train=TrainConfig(run_dir=str(run_dir))), run_dir / "config.yaml")
    return run_dir / "checkpoints" / str(step)


def saved_model_config(step_dir: Path, *, what: str = "checkpoint") -> ModelConfig:
    """The ModelConfig of a checkpoint: the `model` section of its run directory's config.yaml."""
    config_path = Path(step_dir).parent.parent / "config.yaml"
    if not config_path.exists():
        raise FileNotFoundError(f"{what}: {config_path} is missing: cannot tell which model {step_dir} holds")
    model = read_yaml(config_path).get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{what}: {config_path} has no `model` section")
    return ModelConfig.from_dict(model)


def load_model(path: str | Path, *, what: str = "checkpoint") -> TransformerLM:
    """The model of a run directory or checkpoint (its config.yaml's model section, its saved params)."""
    step_dir = resolve_checkpoint(path, what)
    model_config = saved_model_config(step_dir, what=what)
    abstract_model = nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nnx.to_pure_dict(abstract_params))
    params = load_params(step_dir, target, what=what)
    nnx.replace_by_pure_dict(abstract_params, params)
    return nnx.merge(graphdef, abstract_params)


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, as a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
