"""Orbax checkpoints of a run: train state (params, optimizer state, step, RNG) and data-iterator state.

Layout: <run_dir>/checkpoints/<step>/{state, data}. Orbax writes each checkpoint into a temporary
directory and renames it when complete, so a crash during a save leaves the previous checkpoint
as the latest restorable one (leftover temporary directories are removed on the next start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from diffjax.train.config import CheckpointConfig


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
        """Starts saving (in the background when async); the caller decides when to save."""
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
            force=True,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(state, data_state) of checkpoint `step`; `abstract_state` gives structure, shapes, dtypes, shardings."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
        )
        return restored["state"], restored["data"]

    def read(self, step: int) -> dict:
        """{"state": ..., "data": ...} of checkpoint `step` as saved (no target: host arrays), for inspection."""
        return dict(self.manager.restore(step))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_params(path: str | Path, abstract_state: Any) -> Any:
    """The params of a checkpoint: `path` is a run directory, its checkpoints/ directory (newest step)
    or one step's directory. `abstract_state` is this run's state, whose params must match in shape."""
    path = Path(path).absolute()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    step = int(path.name) if path.name.isdigit() else None
    directory = path.parent if step is not None else path
    if not directory.is_dir():
        raise FileNotFoundError(f"train.init_from: {path} is not a run directory or checkpoint")
    manager = ocp.CheckpointManager(directory, item_handlers={"state": ocp.StandardCheckpointHandler()},
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"train.init_from: no checkpoint under {directory}")
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    except (ValueError, KeyError) as error:
        raise ValueError(
            f"train.init_from: checkpoint {directory / str(step)} does not match this model and optimizer ({error})"
        ) from None
    finally:
        manager.close()
    return restored["state"]["params"]


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, as a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
