"""The training loop: a jitted NNX train step, an eval loss, and `train` with progress logging.

Batches are numpy windows sampled on the host (diffjax.data); the model and optimizer are updated
in place by `nnx.jit`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diffjax.data import random_windows, sequential_windows
from diffjax.losses import next_token_loss


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    seed: int = 0  # seeds the batch sampler (the model is initialized by the caller)
    log_every: int = 25
    eval_every: int = 250  # 0: evaluate only at the end
    eval_windows: int = 64  # non-overlapping seq_len windows from the start of the eval split
    final_loss_window: int = 20  # the summary's train loss is the mean over this many last steps

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_windows", "final_loss_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")


@dataclasses.dataclass
class TrainSummary:
    steps: int
    final_train_loss: float  # mean over the last `final_loss_window` steps
    eval_loss: float | None  # None when there is no eval data
    seconds: float  # wall time of the loop, compilation included
    tokens_per_second: float  # after the first (compiling) step
    eval_history: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def loss_fn(model, tokens_BT):
    return next_token_loss(model(tokens_BT), tokens_BT)


@nnx.jit
def train_step(model, optimizer: nnx.Optimizer, tokens_BT):
    """One AdamW step in place; returns the loss before the update and the gradient's global norm."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens_BT)
    optimizer.update(model, grads)
    return {"loss": loss, "grad_norm": optax.global_norm(grads)}


@nnx.jit
def eval_step(model, tokens_BT):
    return loss_fn(model, tokens_BT)


def evaluate(model, windows_NT: np.ndarray, batch_size: int) -> float:
    """Mean next-token loss over the windows, in batches of `batch_size` (the last one may be smaller)."""
    if len(windows_NT) == 0:
        raise ValueError("evaluate needs at least one window")
    total, count = 0.0, 0
    for start in range(0, len(windows_NT), batch_size):
        batch = windows_NT[start : start + batch_size]
        total += float(eval_step(model, jnp.asarray(batch))) * len(batch)
        count += len(batch)
    return total / count


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def train(
    model,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray | None,
    config: TrainConfig,
    *,
    log: Callable[[str], None] = print,
) -> TrainSummary:
    """Train `model` in place for `config.steps` steps on random windows of `train_tokens`."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(config.seed)
    eval_windows = None
    if eval_tokens is not None and len(eval_tokens) >= config.seq_len:
        eval_windows = sequential_windows(eval_tokens, config.seq_len, config.eval_windows)
    tokens_per_step = config.batch_size * config.seq_len

    # Device scalars, converted to floats only when logged so that the host can run ahead.
    recent_losses = collections.deque(maxlen=config.final_loss_window)
    eval_history = []
    eval_seconds = 0.0  # excluded from tokens/s and the ETA
    start = time.perf_counter()
    timed_start = None  # set after the first step, which includes compilation
    for step in range(config.steps):
        batch = random_windows(train_tokens, config.batch_size, config.seq_len, rng)
        metrics = train_step(model, optimizer, jnp.asarray(batch))
        recent_losses.append(metrics["loss"])
        done = step + 1
        if step == 0:
            float(metrics["loss"])  # wait for compilation to finish before timing
            timed_start = time.perf_counter()
        if done % config.log_every == 0 or done == config.steps or step == 0:
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {done}")
            now = time.perf_counter()
            timed_steps = done - 1
            rate = timed_steps * tokens_per_step / (now - timed_start - eval_seconds) if timed_steps else float("nan")
            eta = (config.steps - done) * tokens_per_step / rate if timed_steps else float("nan")
            log(
                f"step {done:>{len(str(config.steps))}}/{config.steps} | loss {loss:.4f} | "
                f"grad norm {float(metrics['grad_norm']):.3f} | lr {float(schedule(step)):.2e} | "
                f"{f'{rate:,.0f}' if math.isfinite(rate) else '?'} tok/s | elapsed {format_duration(now - start)} | "
                f"eta {format_duration(eta) if math.isfinite(eta) else '?'}"
            )
        if eval_windows is not None and config.eval_every and done % config.eval_every == 0 and done != config.steps:
            eval_start = time.perf_counter()
            eval_history.append((done, evaluate(model, eval_windows, config.batch_size)))
            eval_seconds += time.perf_counter() - eval_start
            log(f"step {done}: eval loss {eval_history[-1][1]:.4f}")

    last = [float(x) for x in recent_losses]  # also waits for the last step
    train_seconds = time.perf_counter() - timed_start - eval_seconds
    if eval_windows is not None:
        eval_history.append((config.steps, evaluate(model, eval_windows, config.batch_size)))
        log(f"step {config.steps}: eval loss {eval_history[-1][1]:.4f}")
    timed_steps = config.steps - 1
    return TrainSummary(
        steps=config.steps,
        final_train_loss=float(np.mean(last)),
        eval_loss=eval_history[-1][1] if eval_history else None,
        seconds=time.perf_counter() - start,
        tokens_per_second=timed_steps * tokens_per_step / train_seconds if timed_steps else float("nan"),
        eval_history=eval_history,
    )
