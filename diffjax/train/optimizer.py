"""AdamW with warmup then decay to a floor, a weight-decay mask by parameter name, and clipping.

Learning rate at optimizer step s (0-based; step s applies schedule(s)), with W = warmup_steps,
N = decay_steps, m = min_lr and p = clip((s - W) / (N - W), 0, 1):

    s < W:   lr * s / W                                 (linear warmup from 0)
    s >= W:  m + (lr - m) * (1 - p)                     (decay="linear")
             m + (lr - m) * (1 + cos(pi p)) / 2         (decay="cosine")
             lr                                         (decay="constant")

so the rate is `lr` at s = W and `min_lr` from s = N on.

lr_multipliers ("pattern=factor", the first pattern found in a parameter's dotted path wins) scale that parameter's
AdamW update (weight decay included): its own learning rate, factor x the schedule.

lambda_warmup_steps (differential attention) is a schedule of the model's forward, not of the optimizer: its kinds'
facet makes it (diffjax.model.attention.warmup).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import optax

from diffjax.config import BLOCK_PARTS, ModelConfig, block_rows
from diffjax.sharding import key_names
from diffjax.train.optimizer_config import DECAYS, OptimizerConfig  # noqa: F401 (read from here too)

# Parameter paths that get no weight decay when optim.no_decay is left to the model: RMSNorm scales, and what each of
# the model's kinds spares (its row's training.no_decay: differential attention's lambda vectors and subln scale,
# mHC's gate biases and scales, the MoE's expert_bias; default_no_decay).
MODEL_NO_DECAY = (r"norm",)


def make_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The learning rate per optimizer step (formula in the module docstring)."""
    lr, warmup = config.lr, config.warmup_steps
    decay_steps = max(1, (config.decay_steps or total_steps) - warmup)
    if config.decay == "cosine":
        decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=config.min_lr / lr)
    elif config.decay == "linear":
        decay = optax.linear_schedule(lr, config.min_lr, decay_steps)
    else:
        decay = optax.constant_schedule(lr)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], boundaries=[warmup])


def path_name(path) -> str:
    """'blocks.3.attn.lambda_q1' for a pytree key path."""
    return ".".join(key_names(path))


def default_no_decay(model_config: ModelConfig | None = None) -> tuple[str, ...]:
    """optim.no_decay left to the model: MODEL_NO_DECAY and the no_decay of the rows `model_config`'s layers are
    built from (None: of every registered row, for a caller that knows no model)."""
    if model_config is None:
        rows = [row for table in BLOCK_PARTS.values() for row in table.rows()]
    else:
        rows = [block.row for block in block_rows(model_config)]
    return tuple(dict.fromkeys(MODEL_NO_DECAY + tuple(p for row in rows for p in row.training.no_decay)))


def weight_decay_mask(params, no_decay=None):
    """True for parameters that get weight decay: those whose path matches none of `no_decay` (None:
    default_no_decay())."""
    no_decay = default_no_decay() if no_decay is None else no_decay
    patterns = [re.compile(pattern) for pattern in no_decay]
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(p.search(path_name(path)) for p in patterns), params
    )


def make_optimizer(config: OptimizerConfig, total_steps: int, model_config: ModelConfig | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(tx, schedule): clip by global norm, then AdamW on `schedule`; `schedule(step)` is the lr to log. The weight
    decay mask: config.no_decay, or left None the model's (default_no_decay(model_config))."""
    schedule = make_schedule(config, total_steps)
    no_decay = default_no_decay(model_config) if config.no_decay is None else config.no_decay
    adamw = optax.adamw(
        learning_rate=schedule,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=lambda params: weight_decay_mask(params, no_decay),
    )
    transforms = [] if config.clip_norm is None else [optax.clip_by_global_norm(config.clip_norm)]
    transforms.append(adamw)
    if config.lr_multipliers:
        transforms.append(scale_by_path(config.multipliers()))
    return (transforms[0] if len(transforms) == 1 else optax.chain(*transforms)), schedule


def scale_by_path(multipliers: list[tuple[re.Pattern, float]]) -> optax.GradientTransformation:
    """Updates times the factor of the first pattern found in the parameter's dotted path (1 for none); stateless."""

    def factor(path) -> float:
        name = path_name(path)
        return next((value for pattern, value in multipliers if pattern.search(name)), 1.0)

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(lambda path, u: u * jnp.asarray(factor(path), u.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def schedule_change(old: OptimizerConfig, old_steps: int, new: OptimizerConfig, new_steps: int,
                    step: int) -> str | None:
    """What resuming at optimizer step `step` (the next update, 0-based; the progress line's step + 1) with `new` /
    `new_steps` instead of the run's `old` / `old_steps` does to the learning rate, as a note: the rate at that
    step before and now, and where warm-up and decay end; None when the schedule is the same."""
    runs = ((old, old_steps), (new, new_steps))
    ends = [(config.warmup_steps, config.decay_steps or steps) for config, steps in runs]
    before, after = (float(make_schedule(config, steps)(step)) for config, steps in runs)
    if ends[0] == ends[1] and math.isclose(before, after, rel_tol=1e-6, abs_tol=1e-12):
        return None
    (old_warmup, old_end), (new_warmup, new_end) = ends
    keep = (f"; optim.decay_steps={old_end} keeps the run's schedule" if new.decay_steps is None and old_end != new_end
            and old_end < new_steps else "")
    was = lambda old, new: "" if old == new else f" (was {old})"  # noqa: E731
    return (f"note: the learning-rate schedule changes on resume: step {step + 1} trains at lr {after:.2e} (the run's "
            f"schedule: {before:.2e}); warm-up ends at step {new_warmup}{was(old_warmup, new_warmup)}, the {new.decay} "
            f"decay reaches min_lr {new.min_lr:.1e} at step {new_end}{was(old_end, new_end)}{keep}")
