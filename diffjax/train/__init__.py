"""Training: run config, optimizer, train step, Orbax checkpoints, metrics and the loop behind train.py.

The names below are imported on first use (as the package face does), so that a module of this package that needs
no jax (start.py, the plan of where a run starts) can be imported without the trainer.
"""

from diffjax.lazy_exports import lazy_exports

_EXPORTS = {
    "BatchPlan": "diffjax.train.batching", "plan_batch": "diffjax.train.batching",
    "CheckpointConfig": "diffjax.train.config", "RunConfig": "diffjax.train.config",
    "TrainConfig": "diffjax.train.config", "load_run_config": "diffjax.train.config",
    "Hook": "diffjax.train.hooks",
    "train": "diffjax.train.loop",
    "Run": "diffjax.train.run", "TrainResult": "diffjax.train.run", "setup_run": "diffjax.train.run",
    "OptimizerConfig": "diffjax.train.optimizer_config", "make_optimizer": "diffjax.train.optimizer",
    "make_schedule": "diffjax.train.optimizer", "weight_decay_mask": "diffjax.train.optimizer",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = sorted(_EXPORTS)
