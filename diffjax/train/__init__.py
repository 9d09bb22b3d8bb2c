"""Training: run config, optimizer, train step, Orbax checkpoints, metrics and the loop behind train.py."""

from diffjax.train.batching import BatchPlan, plan_batch
from diffjax.train.config import CheckpointConfig, RunConfig, TrainConfig, load_run_config
from diffjax.train.hooks import Hook
from diffjax.train.loop import train
from diffjax.train.run import Run, TrainResult, setup_run
from diffjax.train.optimizer import OptimizerConfig, make_optimizer, make_schedule, weight_decay_mask

__all__ = [
    "BatchPlan",
    "CheckpointConfig",
    "Hook",
    "OptimizerConfig",
    "Run",
    "RunConfig",
    "TrainConfig",
    "TrainResult",
    "load_run_config",
    "make_optimizer",
    "make_schedule",
    "plan_batch",
    "setup_run",
    "train",
    "weight_decay_mask",
]
