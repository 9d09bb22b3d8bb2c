"""Orbax checkpoints of a run: train state (params, optimizer state, step, RNG) and data-iterator state.

Layout: <run_dir>/checkpoints/<step>/{state, data}. Orbax writes each checkpoint into a temporary
directory and renames it when complete, so a crash during a save leaves the previous checkpoint
as the latest restorable one (leftover temporary directories are removed on the next start).
Params-only checkpoints (load_params, save_params, load_model): diffjax.checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from diffjax.checkpoint import load_params, refuse_per_layer, state_keys  # noqa: F401  (state_keys: the loop's)
from diffjax.train.config import CheckpointConfig
from diffjax.train.mesh import allgather_json


class Checkpointer:
    def __init__(self, run_dir: str | Path, config: CheckpointConfig):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            enable_async_checkpointing=config.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Starts saving (in the background when async); every process calls it at the same step.
        The data item holds every process's iterator state (each reads its own shard)."""
        data = {"per_process": allgather_json(data_state)}
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)), force=True
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict | None]:
        """(state, this process's data-iterator state) of checkpoint `step`. `abstract_state` gives structure,
        shapes, dtypes and the shardings to restore onto (any mesh). The data state is None when the
        checkpoint was written by a different number of processes (their positions do not map)."""
        refuse_per_layer(self.directory / str(step), "resume")
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
        )
        per_process = restored["data"]["per_process"]
        data_state = per_process[jax.process_index()] if len(per_process) == jax.process_count() else None
        return restored["state"], data_state

    def read(self, step: int) -> dict:
        """{"state": ..., "data": ...} of checkpoint `step` as saved (no target: host arrays), for inspection."""
        return dict(self.manager.restore(step))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_params(path: str | Path, abstract_state: Any) -> Any:
    """train.init_from: the params of a run directory / checkpoint, shaped and placed like this run's."""
    return load_params(path, abstract_state["params"], what="train.init_from")


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, as a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
