"""Weights & Biases logging (train.wandb): a trainer hook. W&B is the optional `wandb` extra
(pip install "diffjax[wandb]"), imported only when train.wandb is on, so the core and the trainer do not load it.

What it logs, on the main process only:
  - every record MetricsLog writes to metrics.jsonl (it is one of MetricsLog.listeners: the same floats, not
    recomputed), under TensorBoard's names: train/loss, train/grad_norm, train/lr, train/lambda/layer_<i>,
    train/tokens_per_second, train/tflops_per_device, train/mfu, train/skipped, eval/loss; at W&B step = the
    training step (a step's eval joins its train row);
  - the run config (RunConfig.to_dict()) as the W&B run's config, and the final sample as summary["sample"].
W&B's files go to <run_dir>/wandb/ (or $WANDB_DIR when set); mode "offline" writes only those, to upload later with
`wandb sync <run_dir>/wandb/offline-run-*`.

Resumes: the W&B run's id and the last step logged to it are kept in <run_dir>/wandb-run.json. A run resumed from a
checkpoint (start step > 0) calls wandb.init(id=<that id>, resume="allow"), so it continues the same W&B run (after
changed settings too: allow_val_change). W&B takes a run's steps in increasing order only, and a resumed run repeats
the steps between its checkpoint and where the run before it stopped: nothing at or below the last step logged to the
W&B run (the larger of wandb-run.json's and, online, W&B's own starting step) is logged again. W&B keeps the values it
has for those steps, which the repeat reproduces unless the config changed; metrics.jsonl has the repeat's. A run that
starts at step 0 (a new run directory, or one whose checkpoints are gone) starts a new W&B run.
The run ends with run.finish(exit_code=): 0, 1 when the training raised, 128 + the signal when one stopped it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

from diffjax import storage
from diffjax.train.hooks import Hook, MetricsLog

INSTALL = 'pip install "diffjax[wandb]"'


def _setup_error(message: str) -> ValueError:
    error = ValueError(message)
    error.during_setup = True  # train.py prints it as one line
    return error


def require_wandb() -> None:
    """Before a run is set up: a one-line error when train.wandb is on but W&B is not installed (not imported here)."""
    if importlib.util.find_spec("wandb") is None:
        raise _setup_error(f"train.wandb.project is set but Weights & Biases (wandb) is not installed: {INSTALL} "
                           "(or leave train.wandb.project unset)")


def read_run_file(path: Path) -> dict:
    """wandb-run.json: {"id", "project", "entity", "step"}; {} when absent or unreadable."""
    try:
        record = json.loads(storage.as_path(path).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) else {}


class WandbLog(Hook):
    """Logs a run to Weights & Biases (module docstring). Made by train() when train.wandb is on, on the main process,
    and fed by `metrics_log` (the trainer's MetricsLog)."""

    def __init__(self, metrics_log: MetricsLog):
        self.wb = None  # the wandb Run, between on_start and on_end
        self.floor = 0  # steps <= floor are in the W&B run already
        self.logged = 0  # the last step logged to it
        self.run_file: Path | None = None
        self.identity: dict = {}  # project and entity, for wandb-run.json
        metrics_log.listeners.append(self.record)

    def on_start(self, run):
        settings = run.config.train.wandb
        try:
            import wandb
        except ImportError as error:
            raise _setup_error(f"train.wandb is on but wandb cannot be imported ({error}): {INSTALL}") from None
        run_dir = run.directory.absolute()
        self.run_file = run_dir.wandb_run_file
        saved = read_run_file(self.run_file)
        resume_id = saved.get("id") if run.start_step > 0 else None
        if saved and resume_id is None:
            run.log(f"note: this run starts at step 0: a new W&B run (its earlier start logged to W&B run {saved['id']})")
        try:
            self.wb = wandb.init(
                project=settings.project, entity=settings.entity, name=settings.name or run_dir.path.name,
                group=settings.group, tags=list(settings.tags) or None, mode=settings.mode,
                config=run.config.to_dict(), allow_val_change=True,
                # W&B writes its files locally: a gs:// run's go to WANDB_DIR or ./wandb
                dir=None if os.environ.get("WANDB_DIR") or storage.is_url(run_dir.path) else str(run_dir.path),
                id=resume_id, resume="allow" if resume_id else None,
                reinit="create_new",  # its own run object: a run the user's code has open is left alone
            )
        except Exception as error:  # no API key online, an unknown entity, ...: W&B's message, in one line
            message = " ".join(str(error).split())
            raise _setup_error(f"Weights & Biases could not start the run ({type(error).__name__}: {message}); "
                               "check train.wandb, log in (wandb login), or set train.wandb.mode=offline") from error
        if self.wb.disabled:  # WANDB_MODE=disabled: nothing is recorded, the saved id stays
            self.wb.finish()
            self.wb = None
            return
        self.identity = {"project": settings.project, "entity": settings.entity}
        if resume_id is not None:
            self.floor = max(int(saved.get("step", 0)), (self.wb.starting_step or 0) - 1, 0)
        self.logged = self.floor
        self._save_run_file()
        where = f"offline, in {Path(self.wb.dir).parent}" if self.wb.offline else self.wb.url
        continued = f"continuing after step {self.floor}" if resume_id is not None else "new"
        run.log(f"W&B: run {self.wb.id} ({continued}), {where}")

    def record(self, step: int, kind: str, values: dict[str, float]) -> None:
        """MetricsLog's listener: one metrics.jsonl record."""
        if self.wb is None or step <= self.floor:
            return
        self.wb.log({f"{kind}/{key}": value for key, value in values.items()}, step=step)
        if step > self.logged:
            self.logged = step
            self._save_run_file()

    def on_end(self, run, result):
        if self.wb is None:
            return
        wb, self.wb = self.wb, None
        if result is None:
            exit_code = 1
        elif result.interrupted:
            exit_code = 128 + signal.Signals[result.interrupted].value
        else:
            exit_code = 0
        try:
            if result is not None and result.sample:
                wb.summary["sample"] = result.sample
        finally:
            wb.finish(exit_code=exit_code)

    def _save_run_file(self):
        record = {"id": self.wb.id, **self.identity, "step": self.logged}
        storage.write_text_atomically(self.run_file, json.dumps(record) + "\n")
