"""Orbax checkpoints of a run: train state (params, optimizer state, step, RNG) and data-iterator state.

Layout (diffjax/run_dir.py): <run_dir>/checkpoints/<step>/{state, data, digest.json}. Orbax writes each checkpoint into a
temporary directory and renames it when complete, so a crash during a save leaves the previous checkpoint
as the latest restorable one (leftover temporary directories are removed on the next start). The digest
(integrity.py) is written when a save is complete and checked before a restore. At a start the Checkpointer
describes the run directory for start.plan_start (`survey`) and restores the plan's train state
(`restore_newest`), setting each damaged or unreadable checkpoint aside and trying the next.
Params-only checkpoints (load_params, save_params, load_model): diffjax.params_checkpoint (`diffjax.checkpoint`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from diffjax.log_lines import after_a_failed_write, drop_late_write_callbacks
from diffjax.params_checkpoint import check_same_params, load_model_params, refuse_per_layer
from diffjax.run_dir import COMMIT_FILE, DATA_ITEM, STATE_ITEM, TEMPORARY_MARK, RunDir
from diffjax.state_layout import PARAMS
from diffjax import integrity, storage
from diffjax.train.config import CheckpointConfig
from diffjax.train.mesh import allgather_json
from diffjax.train.start import RunDirState


class UnreadableCheckpoint(RuntimeError):
    """Orbax could not restore a checkpoint that matches its digest (damaged in a way the digest does not cover)."""


class Restored(NamedTuple):
    step: int
    state: Any
    data_state: dict | None  # this process's data-iterator state (None: saved by a different number of processes)


def _first_line(error: BaseException) -> str:
    return f"unreadable: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _newest_is_intact(step: int | None) -> str:
    return "no checkpoint had been saved before" if step is None else f"the newest checkpoint, step {step}, is intact"


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, most often); the earlier ones are intact."""


class _OrbaxErrorsWeReport(logging.Filter):
    """Drops the exceptions Orbax logs with their tracebacks (~100 lines for a full disk, from whichever of its
    threads met it) while a Checkpointer is open: Orbax raises each to its caller too, and the Checkpointer
    reports it in one line (SaveError, UnreadableCheckpoint)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


class Checkpointer:
    def __init__(self, run: RunDir | str | Path, config: CheckpointConfig):
        self.run = (run if isinstance(run, RunDir) else RunDir.for_training(run)).absolute()  # (tests pass a path)
        self.directory = self.run.checkpoints
        self._async, self._saving, self._keep, self._failed = config.async_save, None, config.keep, False
        self._continuable_below = None  # of the save in flight: see save()
        self._quiet = _OrbaxErrorsWeReport()
        logging.getLogger("absl").addFilter(self._quiet)
        drop_late_write_callbacks(TEMPORARY_MARK)  # what a failed save leaves behind besides its SaveError
        self._remove_unfinished_saves()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # _rotate: never the newest checkpoint training can continue from
            # Always Orbax's async path, waited on at once when async_save is false: only it calls the digest
            # callback before the rename, so even a kill between the two never leaves a checkpoint without its digest.
            enable_async_checkpointing=True,
            cleanup_tmp_directories=False,  # done above: Orbax's runs in a thread its close() does not wait for
            create=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_digest),
        )
        handlers = {STATE_ITEM: ocp.StandardCheckpointHandler(), DATA_ITEM: ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def _remove_unfinished_saves(self) -> None:
        """The temporary directories of saves a crash interrupted (their checkpoints never became visible)."""
        if jax.process_index() == 0 and self.directory.is_dir():
            self._remove_temporaries("*")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("removed unfinished saves")

    def _remove_temporaries(self, step: str) -> None:
        """Orbax's temporary directories of step `step` ("*": of every step); on gs://, where Orbax saves in place,
        the step directories without its commit marker."""
        for temporary in self.directory.glob(f"{step}{TEMPORARY_MARK}*"):
            storage.rmtree(temporary, ignore_errors=True)
        if storage.is_url(self.directory):
            for step_dir in self.directory.glob(step):
                if step_dir.name.isdigit() and not (step_dir / COMMIT_FILE).exists():
                    storage.rmtree(step_dir, ignore_errors=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def _write_digest(self) -> None:
        """The digest of the save just completed, from Orbax's post-finalization callback, before the temporary
        directory is renamed into place: the digest arrives with the checkpoint."""
        if jax.process_index() == 0:
            temporary = sorted(self.directory.glob(f"{self._saving}{TEMPORARY_MARK}*"))
            integrity.write_digest(temporary[-1] if temporary else self.run.step_dir(self._saving))

    def state_keys(self, step: int) -> set[str]:
        """Top-level keys of a checkpoint's state: {"params"} alone for a params-only (converted) checkpoint."""
        return set(self.manager.item_metadata(step)[STATE_ITEM].keys())

    def holds_params_only(self, step: int) -> bool:
        return self.state_keys(step) == {PARAMS}

    def survey(self, log) -> RunDirState:
        """What the run directory holds, for start.plan_start: its newest intact checkpoint (each damaged newer one
        set aside first) and what that holds. (final_record is the trainer's to add: metrics are not checkpoints.)"""
        return self._state_at(self.newest_intact(log))

    def _state_at(self, newest: int | None) -> RunDirState:
        return RunDirState(self.run, newest, params_only=newest is not None and self.holds_params_only(newest),
                           set_aside=self.run.damaged())

    def newest_intact(self, log) -> int | None:
        """The newest checkpoint whose files match their digest and whose metadata reads; each damaged
        newer one is reported and set aside (integrity.py: one without a digest is damage where the run's other
        checkpoints have one; integrity.NotAdoptedError where none has, before anything is moved)."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            problem = integrity.find_damage(self.run.step_dir(step))
            if problem is None:
                try:
                    self.state_keys(step)
                except Exception as error:  # any failure to read it means the same: not usable
                    problem = _first_line(error)
            if problem is None:
                return step
            self.set_aside(step, problem, log)
        return None

    def restore_newest(self, step: int, abstract_state: Any, log) -> Restored | RunDirState:
        """The train state of checkpoint `step` or, when Orbax cannot read it, of the newest intact one below it:
        each unreadable checkpoint is set aside like a damaged one. When what is left holds params alone or nothing,
        the survey of it instead, for the caller to plan its start again (start.plan_start)."""
        while step is not None and not self.holds_params_only(step):
            try:
                return Restored(step, *self.restore(step, abstract_state))
            except UnreadableCheckpoint as error:
                self.set_aside(step, str(error), log)
                step = self.newest_intact(log)
        return self._state_at(step)

    def set_aside(self, step: int, problem: str, log) -> None:
        """Moves checkpoint `step` to damaged-checkpoints/ (process 0; every process waits for it), saying why."""
        step_dir = self.run.step_dir(step)
        if jax.process_index() == 0:
            moved = integrity.set_aside(step_dir)
            log(f"warning: checkpoint {step_dir} is damaged ({problem}); skipped it and moved it to {moved}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self.manager.reload()

    def fall_back_before(self, first_spoiled: int, log) -> str:
        """After steps were not finite (guard.py): sets aside the checkpoints they spoiled (step first_spoiled on,
        NonfiniteGuard.first_spoiled: the step after each was not finite, whatever the learning rate) and says which
        checkpoint a rerun continues from."""
        self.wait()
        spoiled = [step for step in self.manager.all_steps() if step >= first_spoiled]
        for step in spoiled:
            self.set_aside(step, f"training from it was not finite at step {step + 1}", log)
        moved = (f"checkpoint {', '.join(map(str, spoiled))} (training from it was not finite) was moved to "
                 f"{self.run.damaged_checkpoints}; " if spoiled else "nothing from that step on was saved; ")
        newest = self.manager.latest_step()
        if newest is not None:
            return moved + f"a rerun resumes from {self.run.step_dir(newest)}, the newest checkpoint training can continue from"
        if spoiled:
            return moved + (f"no checkpoint training can continue from remains: to start over from step 0, move "
                            f"{self.run.damaged_checkpoints} out of {self.run.path}, or choose another train.run_dir")
        return moved + "no checkpoint had been saved: a rerun starts over from step 0"

    def save(self, step: int, state: Any, data_state: dict, *, continuable_below: int | None = None) -> None:
        """Starts saving (in the background when async); every process calls it at the same step.
        The data item holds every process's iterator state (each reads its own shard).

        continuable_below: the checkpoints below this step are ones training can continue from (default `step`: all
        of them). Under train.on_nonfinite=skip, while steps are being skipped, only those before the stretch are:
        the newest of them outlives rotation (checkpoint.keep) until a newer one is known to be good too."""
        data = {"per_process": allgather_json(data_state)}
        self.wait()  # the previous save must have succeeded; the digest callback names the step being saved
        self._check_space(step)
        self._saving, self._continuable_below = step, step if continuable_below is None else continuable_below
        self.manager.save(
            step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state), DATA_ITEM: ocp.args.JsonSave(data)}),
            force=True
        )
        if not self._async:
            self.wait()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict | None]:
        """(state, this process's data-iterator state) of checkpoint `step`. `abstract_state` gives structure,
        shapes, dtypes and the shardings to restore onto (any mesh). The data state is None when the
        checkpoint was written by a different number of processes (their positions do not map)."""
        saved_params = self.manager.item_metadata(step)[STATE_ITEM][PARAMS]
        refuse_per_layer(self.run.step_dir(step), "resume", saved_params)
        check_same_params(
            saved_params, abstract_state[PARAMS],
            f"checkpoint {self.run.step_dir(step)} holds a different model than this run's (resume it with the "
            "model it was trained with, or choose another train.run_dir)",
        )
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state), DATA_ITEM: ocp.args.JsonRestore()}),
            )
        except Exception as error:  # whatever Orbax or tensorstore met: this checkpoint cannot be used
            raise UnreadableCheckpoint(_first_line(error)) from error
        per_process = restored[DATA_ITEM]["per_process"]
        data_state = per_process[jax.process_index()] if len(per_process) == jax.process_count() else None
        return restored[STATE_ITEM], data_state

    def read(self, step: int) -> dict:
        """{"state": ..., "data": ...} of checkpoint `step` as saved (no target: host arrays), for inspection."""
        return dict(self.manager.restore(step))

    def _check_space(self, step: int) -> None:
        """Refuse to start a save the disk cannot hold (the size of the newest checkpoint, from its digest):
        a clear stop now instead of Orbax's errors from its background thread one save later."""
        newest = self.manager.latest_step()
        needed = integrity.saved_bytes(self.run.step_dir(newest)) if newest is not None else 0
        free = storage.free_bytes(self.directory)
        if free is not None and needed > free:
            raise SaveError(
                f"not enough disk space to save the checkpoint of step {step} in {self.directory} "
                f"({free / 2**20:.1f} MiB free, a checkpoint takes {needed / 2**20:.1f} MiB); "
                f"{_newest_is_intact(newest)}: free some space and rerun to resume"
            )

    def wait(self) -> None:
        """Waits for the save in flight; its failure becomes a SaveError (and its temporary directory goes), its
        success rotates the checkpoints."""
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # Orbax re-raises whatever its background thread met
            raise self._failed_save(error) from None
        self._rotate()

    def _failed_save(self, error: Exception) -> SaveError:
        """The one line for the save that failed with `error` (its temporary directory removed)."""
        self._failed, self._continuable_below = True, None  # (nothing new to rotate)
        self._remove_temporaries(str(self._saving))
        after_a_failed_write()
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        return SaveError(f"saving the checkpoint of step {self._saving} in {self.directory} failed: {message}; "
                         f"{_newest_is_intact(self.manager.latest_step())}")

    def _rotate(self) -> None:
        """After a save: deletes all but the newest checkpoint.keep checkpoints, except the newest one training can
        continue from (below continuable_below of that save), which stays until a newer one is known to be good: a
        checkpoint saved just before a non-finite step, or during a stretch of skipped ones, is set aside when the
        run stops (fall_back_before), so rotation must not have deleted the one a rerun continues from."""
        if self._continuable_below is None:
            return
        steps = sorted(self.manager.all_steps())
        continuable = [step for step in steps if step < self._continuable_below]
        kept = set(steps[-self._keep:]) | set(continuable[-1:])
        for step in steps:
            if step not in kept:
                self.manager.delete(step)
        self._continuable_below = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            try:
                self.manager.close()  # its async checkpointer can raise a failed write once more
            except Exception as error:
                if not self._failed:  # (a failure already said is not said again, nor chained to itself)
                    raise self._failed_save(error) from None
            finally:
                logging.getLogger("absl").removeFilter(self._quiet)


def restore_params(path: str | Path, abstract_state: Any) -> Any:
    """train.init_from: the params of a run directory / checkpoint (a LoRA run's merged), shaped and placed like
    this run's."""
    return load_model_params(path, abstract_state[PARAMS], what="train.init_from")


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, as a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
