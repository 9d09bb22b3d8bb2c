"""The `optim` section of a run config (OptimizerConfig; the schedule it describes: diffjax.train.optimizer). No jax
or optax: the run config imports it."""

from __future__ import annotations

import dataclasses
import math
import re

from diffjax.config_values import nonfinite_problems

DECAYS = ("linear", "cosine", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (a run config's `optim` section)."""

    lr: float = 3e-3
    """Peak learning rate, reached after warmup_steps."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to lr."""
    decay: str = "cosine"
    """The schedule after warm-up, from lr down to min_lr at decay_steps: "linear", "cosine" or "constant"."""
    min_lr: float = 3e-4
    """The schedule's floor (at most lr)."""
    decay_steps: int | None = None
    """Step at which the schedule reaches min_lr; None: the run's train.steps."""
    b1: float = 0.9
    """AdamW's first-moment decay."""
    b2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW), scaled by the learning rate."""
    no_decay: tuple[str, ...] | None = None
    """Regular expressions searched in a parameter's dotted path (e.g. "blocks.3.attn.lambda_q1"); a match excludes
    the parameter from weight decay. None: the model's, "norm" and what its kinds spare (differential attention's
    subln and lambda_, mHC's gate biases and scales, the MoE's expert_bias)."""
    clip_norm: float | None = 1.0
    """Clip the global gradient norm to this; None: no clipping."""
    lr_multipliers: tuple[str, ...] = ()
    """Entries "pattern=factor": the update of a parameter whose dotted path matches the regular expression (the first
    match wins) is multiplied by factor, weight decay included, e.g. "lambda_=10"."""
    lambda_warmup_steps: int = 0
    """Steps over which lambda grows linearly from 0 to its value (an upcycled model's start); 0: no warm-up."""

    def __post_init__(self):
        if problems := nonfinite_problems(self, "optim."):
            raise ValueError(problems[0])
        if self.no_decay is not None:
            object.__setattr__(self, "no_decay", tuple(self.no_decay))
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, optim.lr = {self.lr}], got {self.min_lr!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"optim.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.decay_steps is not None and not (isinstance(self.decay_steps, int) and self.decay_steps > 0):
            raise ValueError(f"optim.decay_steps must be a positive integer or None, got {self.decay_steps!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"optim.decay must be one of {DECAYS}, got {self.decay!r}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not self.eps > 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"optim.clip_norm must be > 0 or None, got {self.clip_norm!r}")
        for pattern in self.no_decay or ():
            _regex("optim.no_decay", pattern)
        object.__setattr__(self, "lr_multipliers", tuple(self.lr_multipliers))
        self.multipliers()  # checks each entry
        if not (isinstance(self.lambda_warmup_steps, int) and self.lambda_warmup_steps >= 0):
            raise ValueError(f"optim.lambda_warmup_steps must be an integer >= 0, got {self.lambda_warmup_steps!r}")

    def multipliers(self) -> list[tuple[re.Pattern, float]]:
        """lr_multipliers as (compiled pattern, factor) pairs, in order."""
        pairs = []
        for entry in self.lr_multipliers:
            pattern, equals, factor = str(entry).rpartition("=")
            try:
                value = float(factor)
            except ValueError:
                value = None
            if not equals or not pattern or value is None or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"optim.lr_multipliers entries are 'pattern=factor' with a factor >= 0, got {entry!r}")
            pairs.append((_regex("optim.lr_multipliers", pattern), value))
        return pairs


def _regex(key: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{key}: {pattern!r} is not a regular expression ({error})") from None
