"""Training: the optimizer and the loop behind `python train.py`."""

from diffjax.train.loop import TrainConfig, TrainSummary, evaluate, train, train_step
from diffjax.train.optimizer import OptimizerConfig, make_optimizer, make_schedule, weight_decay_mask

__all__ = [
    "OptimizerConfig",
    "TrainConfig",
    "TrainSummary",
    "evaluate",
    "make_optimizer",
    "make_schedule",
    "train",
    "train_step",
    "weight_decay_mask",
]
