"""AdamW with warmup + decay, global-norm clipping, and no weight decay on 1-D parameters.

Learning rate at optimizer step s (0-based; step s applies schedule(s)), with W = warmup_steps,
N = total_steps, r = min_lr_ratio and p = clip((s - W) / (N - W), 0, 1):

    s < W:   peak * s / W                                  (linear warmup from 0)
    s >= W:  peak * (r + (1 - r) * (1 - p))                (decay="linear")
             peak * (r + (1 - r) * (1 + cos(pi p)) / 2)    (decay="cosine")

so the rate is `peak` at s = W and `r * peak` from s = N on.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

DECAYS = ("cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    peak_lr: float = 2e-3
    warmup_steps: int = 100
    total_steps: int = 1000
    decay: str = "cosine"  # "cosine" or "linear", down to min_lr_ratio * peak_lr at total_steps
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0  # global gradient norm; None: no clipping
    decay_1d_params: bool = False  # True: also decay norm scales, lambda vectors and the subln scale

    def __post_init__(self):
        if self.peak_lr <= 0:
            raise ValueError(f"peak_lr must be > 0, got {self.peak_lr}")
        if self.warmup_steps < 0 or self.total_steps <= 0:
            raise ValueError(f"need warmup_steps >= 0 and total_steps > 0, got {self.warmup_steps}, {self.total_steps}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"clip_norm must be > 0 or None, got {self.clip_norm}")


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """The learning rate per optimizer step (formula in the module docstring)."""
    peak, warmup = config.peak_lr, config.warmup_steps
    decay_steps = max(1, config.total_steps - warmup)
    if config.decay == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
    else:
        decay = optax.linear_schedule(peak, peak * config.min_lr_ratio, decay_steps)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], boundaries=[warmup])


def weight_decay_mask(params):
    """True for parameters that get weight decay: every parameter with more than one axis.

    Excludes the 1-D ones: RMSNorm scales, DIFF attention's lambda_q1/k1/q2/k2 and subln scale.
    """
    return jax.tree.map(lambda x: x.ndim > 1, params)


def make_optimizer(config: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(tx, schedule): clip by global norm, then AdamW on `schedule`; `schedule(step)` is the lr to log."""
    schedule = make_schedule(config)
    adamw = optax.adamw(
        learning_rate=schedule,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=None if config.decay_1d_params else weight_decay_mask,
    )
    if config.clip_norm is None:
        return adamw, schedule
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw), schedule
