"""Where a run starts: one pure decision from what its run directory holds and a few run settings (no jax, no Orbax).

    fresh      no checkpoint: step 0, the params initialized from train.seed
    init_from  no checkpoint and train.init_from set: step 0 from those params (the optimizer starts afresh)
    converted  the newest intact checkpoint holds params alone (a converted or exported model): step 0 from them
    resume     the newest intact checkpoint is a train state: its step, params, optimizer state, RNG, data position
    complete   that checkpoint is at train.steps or beyond and metrics.jsonl holds the run's final record: nothing to do

A LoRA run (lora.rank > 0) reads its frozen base from train.init_from at every start (its checkpoints hold the
adapters and the base params that train); it starts fresh or resumes. Refused, with what to do:
  - no intact checkpoint left, but damaged ones set aside: a silent restart at step 0 would bury the run's history;
  - LoRA onto a params-only checkpoint: a LoRA run keeps its adapters in a run directory of its own.

The checkpointer describes the directory (Checkpointer.survey, which sets damaged checkpoints aside first); the
trainer follows the plan (run.py).
"""

from __future__ import annotations

import dataclasses
import enum

from diffjax.run_dir import RunDir


class Start(enum.Enum):
    FRESH = "fresh"
    INIT_FROM = "init_from"
    CONVERTED = "converted"
    RESUME = "resume"
    COMPLETE = "complete"


@dataclasses.dataclass(frozen=True)
class RunDirState:
    """What a run directory holds, as the checkpointer found it once the damaged checkpoints were set aside."""

    run: RunDir
    newest: int | None = None  # the newest intact checkpoint's step (older ones are verified only when needed)
    params_only: bool = False  # whether that checkpoint holds params alone rather than a train state
    set_aside: tuple[str, ...] = ()  # the damaged checkpoints in damaged-checkpoints/ (this start's and earlier)
    # metrics.jsonl holds the run's final record at step `newest` (its final eval, or without held-out data its last
    # train step). Always False in a multi-process run: only process 0 writes metrics, and every process plans alike.
    final_record: bool = False


@dataclasses.dataclass(frozen=True)
class StartSettings:
    """What of the run config decides where a run starts."""

    steps: int  # train.steps
    init_from: str | None = None  # train.init_from
    lora: bool = False  # lora.rank > 0: adapters over the base train.init_from names

    @classmethod
    def of(cls, config) -> "StartSettings":
        """From a RunConfig."""
        return cls(config.train.steps, config.train.init_from or None, config.lora.enabled)


@dataclasses.dataclass(frozen=True)
class StartPlan:
    kind: Start
    step: int | None = None  # the checkpoint it reads (resume, converted) or found complete
    init_from: str | None = None  # the params it starts from (init_from)
    lora_base: str | None = None  # a LoRA run's frozen base (train.init_from), read at every start


def plan_start(directory: RunDirState, settings: StartSettings) -> StartPlan:
    """Where the run in `directory` starts (module docstring); ValueError for the refused cases."""
    run, newest = directory.run, directory.newest
    base = settings.init_from if settings.lora else None
    if newest is None:
        if directory.set_aside:
            _refuse_a_silent_restart(directory)
        if settings.init_from and not settings.lora:
            return StartPlan(Start.INIT_FROM, init_from=settings.init_from)
        return StartPlan(Start.FRESH, lora_base=base)
    if newest >= settings.steps and directory.final_record:
        return StartPlan(Start.COMPLETE, step=newest)
    if directory.params_only and settings.lora:
        raise ValueError(f"{run.path} holds a params-only checkpoint (a converted or exported model): a LoRA run "
                         "keeps its adapters in a run directory of its own; set train.init_from to this directory "
                         "and train.run_dir to a new one")
    if directory.params_only:
        return StartPlan(Start.CONVERTED, step=newest)
    return StartPlan(Start.RESUME, step=newest, lora_base=base)


def _refuse_a_silent_restart(directory: RunDirState) -> None:
    """No intact checkpoint, but damaged ones set aside: the run's history would be restarted at step 0 by
    accident. Stop, saying what is where and how to start over deliberately."""
    run = directory.run
    raise ValueError(
        f"no intact checkpoint remains in {run.checkpoints}: {', '.join(directory.set_aside)} are in "
        f"{run.damaged_checkpoints} (nothing was deleted). To start this run over from step 0, move "
        f"{run.damaged_checkpoints} out of {run.path} (metrics.jsonl is kept beside the new one); or choose another "
        "train.run_dir"
    )
