"""Hooks: what the training loop calls besides stepping. The trainer's metrics, progress display and
non-finite check are one (MetricsLog); `train(config, hooks=[...])` adds the user's after it.

The loop calls, on each hook in order:
  on_start(run)                 before the first step
  on_step(run, step, metrics)   after each step is dispatched. metrics: device arrays (loss, grad_norm, lr,
                                ok, loss_tokens; and the model's kinds' own, their facets': diffjax.model.facets,
                                e.g. lambda [L], router); reading
                                one waits for the step, so read them rarely (MetricsLog reads a window of steps
                                in one transfer)
  on_eval(run, step, loss)      after each held-out evaluation, the final one included (mean loss per token)
  on_checkpoint(run, step)      before checkpoint `step` is saved: write out what the hook holds of steps
                                <= step; raising stops the save
  on_end(run, result)           when the run ends: its TrainResult, or None when it ends on an error
`run` is the Run (run.py): config, directory (its RunDir; run_dir: the path), state, step, log, ...
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from diffjax import storage
from diffjax.model.facets import model_facets
from diffjax.train.guard import DivergedError, NonfiniteGuard
from diffjax.train.metrics import MetricsWriter, peak_flops_per_device, read_records, training_flops_per_token
from diffjax.train.progress import Progress


class Hook:
    """Override the calls you need (module docstring); the others do nothing."""

    def on_start(self, run) -> None:
        pass

    def on_step(self, run, step: int, metrics: dict[str, jax.Array]) -> None:
        pass

    def on_eval(self, run, step: int, loss: float) -> None:
        pass

    def on_checkpoint(self, run, step: int) -> None:
        pass

    def on_end(self, run, result) -> None:
        pass


class ProfileWindow(Hook):
    """A jax.profiler trace of steps first..last (train.profile_steps) into the run's TensorBoard directory: started
    once step first - 1 has finished, stopped once step last has (so the trace holds the window's steps only)."""

    def __init__(self, first: int, last: int):
        self.first, self.last, self.tracing = first, last, False
        self.target, self.local = None, None  # a gs:// run's trace is written locally, then copied up

    def _start(self, run):
        self.tracing, self.target = True, run.directory.tensorboard
        if storage.is_url(self.target):
            self.local = Path(tempfile.mkdtemp(prefix="diffjax-profile-"))
        jax.profiler.start_trace(str(self.local or self.target))

    def on_start(self, run):
        if run.step + 1 == self.first:
            self._start(run)

    def on_step(self, run, step, metrics):
        if step + 1 == self.first:
            jax.block_until_ready(metrics)
            self._start(run)
        elif step == self.last and self.tracing:
            jax.block_until_ready(metrics)
            self._stop()
            run.log(f"profile of steps {self.first}-{self.last} written under {run.directory.tensorboard} "
                    "(TensorBoard / XProf, profile tab)")

    def on_end(self, run, result):
        self._stop()  # a run that ended inside the window

    def _stop(self):
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
            if self.local is not None:
                storage.copy_tree(self.local, self.target)
                shutil.rmtree(self.local, ignore_errors=True)


class MetricsLog(Hook):
    """Each step's metrics into metrics.jsonl / TensorBoard and the progress display, with throughput and
    MFU, each step checked finite (guard.py) as it is written.

    Metrics stay on the device until a window of steps is written in one transfer: every train.log_every
    steps, before an eval's record and before each checkpoint is saved, so every step <= a checkpoint is
    in metrics.jsonl and checked finite before that checkpoint exists. The first step compiles: it is
    written at once and not timed; time spent evaluating or saving is not counted (run.clock).

    `listeners` (e.g. wandb_log.WandbLog) are given each record as it is written, on the main process only:
    listener(step, kind, values), kind "train" or "eval", values the record's floats as metrics.jsonl has them
    (before non-finite values become null there).
    """

    def __init__(self, run):
        config = run.config
        self.writer = MetricsWriter(run.directory, tensorboard=config.train.tensorboard, resume_step=run.start_step,
                                    enabled=run.is_main_process)
        if self.writer.kept_as:
            run.log(f"note: this run starts at step 0; the metrics of its earlier start are kept in {self.writer.kept_as}")
        self.facets = model_facets(config.model, config)  # the kinds' own metrics, guards and displayed values
        self.progress = Progress(config.train.progress if run.is_main_process else "lines", run.start_step,
                                 config.train.steps, run.tokens_per_step, run.log,
                                 lambda values: {k: v for facet in self.facets for k, v in facet.shown(values).items()})
        run.log = self.progress.log  # hooks' and the loop's lines clear the bar first
        self.flops_per_token = training_flops_per_token(config.model, config.data.seq_len)
        self.peak = peak_flops_per_device(jax.devices()[0].device_kind, config.train.peak_tflops_per_device)
        self.guard = NonfiniteGuard(config.train.on_nonfinite, config.train.max_skipped_steps,
                                    lambda values: "".join(facet.nonfinite_reasons(values) for facet in self.facets),
                                    first_step=run.start_step + 1)
        self.pending = []  # (step, device metrics) not yet written: converting to floats would stall the device
        self.losses: dict[int, float] = {}
        self.listeners: list[Callable[[int, str, dict[str, float]], None]] = []
        self.tokens_per_second: float | None = None
        self.window_start, self.timed_steps = 0.0, 0

    def on_step(self, run, step, metrics):
        self.pending.append((step, metrics))
        if step == run.start_step + 1:  # compiled: time from here
            self.flush(run)
        else:
            self.timed_steps += 1
        if step % run.config.train.log_every == 0 or step == run.config.train.steps:
            self.flush(run)

    def on_eval(self, run, step, loss):
        self.flush(run)
        if step > run.start_step or not any(r["step"] == step and r["kind"] == "eval"  # a kill lost it
                                            for r in read_records(run.directory.metrics_file)):
            self._write(step, "eval", {"loss": loss})
        self.progress.note(f"step {step}: eval loss {loss:.4f}")

    def on_checkpoint(self, run, step):
        self.flush(run, report=False)
        self.writer.flush(force=True)  # (gs://) every record up to a checkpoint is stored before it

    def on_end(self, run, result):
        try:
            if result is not None:
                self.flush(run)
                if result.sample:
                    self.progress.note(f"sample (temperature {run.config.train.sample_temperature}):\n{result.sample}")
        finally:
            self.progress.close()
            self.writer.close(report=result is not None)  # (None: an error is stopping the run; it is the one said)

    def _write(self, step: int, kind: str, values: dict[str, float], histograms: dict | None = None):
        self.writer.write(step, kind, values, histograms)
        if self.writer.enabled:
            for listener in self.listeners:
                listener(step, kind, values)

    def flush(self, run, report: bool = True):
        """Writes the pending steps' metrics (checking each step was finite) and, if `report`, a progress line."""
        if not self.pending:
            return
        rate = None
        if self.timed_steps:
            jax.block_until_ready(self.pending[-1][1])
            rate = self.timed_steps * run.tokens_per_step / (run.clock.seconds() - self.window_start)
            self.tokens_per_second = rate
        host_metrics = jax.device_get([metrics for _, metrics in self.pending])  # one transfer for the window
        for (step, _), metrics in zip(self.pending, host_metrics):
            values = {key: float(value) for key, value in metrics.items()  # (the facets write the others)
                      if key != "ok" and not isinstance(value, dict) and np.ndim(value) == 0}
            if not self.guard.check(step, metrics, lambda spoiled: run.checkpointer.fall_back_before(spoiled, run.log)):
                values["skipped"] = 1.0
                self.progress.note(f"step {step}: loss {values['loss']}, gradient norm {values['grad_norm']}: skipped")
            histograms = {}
            for facet in self.facets:
                stop = facet.stop(step, metrics)
                if stop:
                    raise DivergedError(stop)
                values.update(facet.values(metrics))
                histograms.update(facet.histograms(metrics))
            if rate is not None:
                values["tokens_per_second"] = rate
                values["tflops_per_device"] = rate * self.flops_per_token / run.mesh.size / 1e12
                if self.peak:
                    values["mfu"] = rate * self.flops_per_token / run.mesh.size / self.peak
            self.losses[step] = values["loss"]
            self._write(step, "train", values, histograms)
        self.writer.flush()
        if report:
            self.progress.update(self.pending[-1][0], values)
        self.pending.clear()
        self.window_start, self.timed_steps = run.clock.seconds(), 0
