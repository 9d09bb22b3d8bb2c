"""Training: run config, optimizer, train step, Orbax checkpoints, metrics and the loop behind train.py."""

from diffjax.train.batching import BatchPlan, plan_batch
from diffjax.train.config import CheckpointConfig, RunConfig, TrainConfig, load_run_config
from diffjax.train.loop import TrainResult, train
from diffjax.train.optimizer import OptimizerConfig, make_optimizer, make_schedule, weight_decay_mask

__all__ = [
    "BatchPlan",
    "CheckpointConfig",
    "OptimizerConfig",
    "RunConfig",
    "TrainConfig",
    "TrainResult",
    "load_run_config",
    "make_optimizer",
    "make_schedule",
    "plan_batch",
    "train",
    "weight_decay_mask",
]
