"""`train(config)`: the whole run, from data to checkpoints, metrics and a generated sample.

Rerunning with the same run directory resumes from its newest checkpoint: params, optimizer state,
step, RNG and the data iterator's position, so the continued run equals an uninterrupted one.
SIGTERM / SIGINT finish the current step, save a checkpoint of it and exit; a SIGTERM before the first step has run
(while it compiles) exits at once, with nothing new to save.
Set-up is run.py (`setup_run` -> Run); metrics, progress and users' extras are hooks (hooks.py).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import jax

from diffjax.train.config import RunConfig
from diffjax.train.hooks import Hook, MetricsLog, ProfileWindow
from diffjax.train.run import Run, TrainResult, setup_errors, setup_run
from diffjax.train.wandb_log import WandbLog, require_wandb

__all__ = ["Hook", "Interrupted", "StopSignals", "TrainResult", "train"]


class Interrupted(KeyboardInterrupt):
    """A signal that stopped the run at once: a second SIGTERM / SIGINT, or one during the final eval and sample
    (the checkpoints are all saved by then). `signal` is its name; train.py exits 128 + its number."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal = signal_name


class StopSignals:
    """Turns SIGTERM / SIGINT into a flag the loop checks after each step; a second signal, or any once
    `immediate` is set (after the last checkpoint), raises Interrupted at once.

    A SIGTERM before the first step has run calls `before_first_step(name)` at once, from a thread: the first step
    compiles (minutes for a large model), in C++, where no Python handler runs until it returns, and it would save
    nothing the run directory does not hold already. The thread is woken by the signal itself (Python's wakeup fd,
    written by its C-level handler). SIGINT keeps waiting: in a notebook it is the kernel's interrupt."""

    def __init__(self, before_first_step: Callable[[str], None] | None = None):
        self.received: str | None = None
        self.immediate = False
        self.first_step_pending = before_first_step is not None  # the loop clears it once a step has run
        self._before_first_step = before_first_step
        self._previous, self._wakeup = {}, None

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None or self.immediate:
            raise Interrupted(name)
        self.received = name

    def _watch(self, read_fd: int) -> None:
        while signums := os.read(read_fd, 64):
            if signal.SIGTERM in signums and self.first_step_pending:
                self._before_first_step(signal.SIGTERM.name)
        os.close(read_fd)

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        if self._before_first_step is not None:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)  # (the C handler never blocks on it)
            self._wakeup = (write_fd, signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(read_fd,), name="diffjax-stop-signals", daemon=True).start()
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._wakeup is not None:
            write_fd, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_fd)  # the watcher reads the end of the pipe and stops


def train(config: RunConfig, *, log: Callable[[str], None] = print, hooks: Sequence[Hook] = ()) -> TrainResult:
    """Trains `config` to train.steps (resuming its run directory), calling `hooks` after the trainer's own."""
    if config.train.wandb.enabled:
        require_wandb()  # a missing extra: one line now, not after the set-up
    run = setup_run(config, log)
    if isinstance(run, TrainResult):  # complete already: nothing to do
        return run
    steps = config.train.steps
    if run.start_step >= steps:
        run.log(f"the run in {run.run_dir} is complete (step {run.start_step} of train.steps = {steps}); recording its final eval")
    all_hooks, ended = [], None
    try:
        with setup_errors():  # (rewriting metrics.jsonl on a full disk)
            metrics_log = MetricsLog(run)
        profile = [ProfileWindow(*config.train.profile_steps)] if config.train.profile_steps else []
        tracking = [WandbLog(metrics_log)] if config.train.wandb.enabled and run.is_main_process else []
        all_hooks = [metrics_log, *profile, *tracking, *hooks]
        result = TrainResult(step=run.start_step, losses=metrics_log.losses, eval_losses={}, tokens_per_second=None,
                             sample=None)
        for hook in all_hooks:
            hook.on_start(run)
        with StopSignals(functools.partial(_stop_before_the_first_step, run)) as stop:
            while run.step < steps:
                run.state, metrics = run.train_step(run.state, run.next_batch())
                stop.first_step_pending = False  # compiled and dispatched: signals now wait for it and its save
                run.step += 1
                for hook in all_hooks:
                    hook.on_step(run, run.step, metrics)
                if config.train.eval_every and run.step % config.train.eval_every == 0 and run.step < steps:
                    _evaluate(run, all_hooks, result)
                if run.step % config.checkpoint.every == 0 or run.step == steps or stop.received:
                    for hook in all_hooks:  # MetricsLog first: every step up to here is written and checked finite
                        hook.on_checkpoint(run, run.step)
                    with run.clock.stopped():
                        run.checkpointer.save(run.step, run.state, run.data_iter.get_state(),
                                              continuable_below=_continuable_below(metrics_log, run.step))
                    run.last_saved = run.step
                if stop.received:
                    run.checkpointer.wait()
                    run.log(f"{stop.received}: saved a checkpoint of step {run.step} in {run.checkpointer.directory}; exiting")
                    result.interrupted = stop.received
                    break
            result.step = run.step
            if result.interrupted is None and run.step >= steps:
                stop.immediate = True  # the final checkpoint is saved: a signal now stops the eval and sample at once
                stop.first_step_pending = False  # (a complete run's start runs no step)
                _evaluate(run, all_hooks, result)
                if config.train.sample_tokens:
                    result.sample = run.sample_text()
        result.tokens_per_second = metrics_log.tokens_per_second
        ended = result
    finally:
        try:
            for hook in all_hooks:
                hook.on_end(run, ended)
        finally:
            run.close()
    if result.tokens_per_second:
        run.log(f"done at step {run.step}: {result.tokens_per_second:,.0f} tokens/s")
    return result


def _stop_before_the_first_step(run: Run, name: str) -> None:
    """A SIGTERM while the first step compiles: nothing new to save, so the process ends now (exit 128 + the signal),
    as an uncaught SIGTERM ends it during the set-up: the run directory is what a kill leaves, which resumes exactly.
    Called from StopSignals' thread; the main thread is in XLA."""
    run.log(f"{name}: stopped before the first step had run (nothing new to save; the checkpoints saved so far are "
            "intact)")
    run.lock.release()  # (the next start takes no note of a trainer that died)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.Signals[name].value)


def _continuable_below(metrics_log: MetricsLog, step: int) -> int:
    """The step below which every checkpoint is one training can continue from, every step up to `step` checked
    (MetricsLog writes them before a save): all of them, unless a stretch of skipped steps is going on
    (train.on_nonfinite=skip): those before the first one it spoils (guard.NonfiniteGuard.first_spoiled)."""
    first_spoiled = metrics_log.guard.first_spoiled()
    return step if first_spoiled is None else first_spoiled


def _evaluate(run: Run, hooks: Sequence[Hook], result: TrainResult) -> None:
    jax.block_until_ready(run.state)  # the steps so far are training time, the eval is not
    with run.clock.stopped():
        loss = run.evaluate()
    if loss is not None:
        result.eval_losses[run.step] = loss
        for hook in hooks:
            hook.on_eval(run, run.step, loss)
