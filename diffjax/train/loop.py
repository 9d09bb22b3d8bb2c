"""`train(config)`: the whole run, from data to checkpoints, metrics and a generated sample.

Rerunning with the same run directory resumes from its newest checkpoint: params, optimizer state,
step, RNG and the data iterator's position, so the continued run equals an uninterrupted one.
SIGTERM / SIGINT finish the current step, save a checkpoint of it and exit.
Set-up is run.py (`setup_run` -> Run); metrics, progress and users' extras are hooks (hooks.py).
"""

from __future__ import annotations

import signal
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
    `immediate` is set (after the last checkpoint), raises Interrupted at once."""

    def __init__(self):
        self.received: str | None = None
        self.immediate = False
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None or self.immediate:
            raise Interrupted(name)
        self.received = name

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


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
        with StopSignals() as stop:
            while run.step < steps:
                run.state, metrics = run.train_step(run.state, run.next_batch())
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


def _continuable_below(metrics_log: MetricsLog, step: int) -> int:
    """The step below which every checkpoint is one training can continue from, every step up to `step` checked
    (MetricsLog writes them before a save): all of them, unless a stretch of skipped steps is going on
    (train.on_nonfinite=skip); its first bad step's loss came from the params of the step before it."""
    bad_since = metrics_log.guard.bad_since
    return step if bad_since is None else bad_since - 1


def _evaluate(run: Run, hooks: Sequence[Hook], result: TrainResult) -> None:
    jax.block_until_ready(run.state)  # the steps so far are training time, the eval is not
    with run.clock.stopped():
        loss = run.evaluate()
    if loss is not None:
        result.eval_losses[run.step] = loss
        for hook in hooks:
            hook.on_eval(run, run.step, loss)
