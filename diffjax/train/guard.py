"""The non-finite guard: a diverging step is found on the device and never reaches a checkpoint.

The jitted step computes `ok` (loss, gradient norm and update norm all finite) every step; with
`train.on_nonfinite=skip` it also keeps the old params and optimizer state when not ok, as large-scale
trainers do. The host reads `ok` only where it syncs anyway: when it writes metrics, which it does
before every checkpoint save. So no checkpoint of a state after a bad step is ever saved, and no
step pays an extra device-to-host sync.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def step_ok(loss: jax.Array, grad_norm: jax.Array, update_norm: jax.Array) -> jax.Array:
    """On device: True when the step's loss and its gradient and update are finite."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)


def keep_old_if_bad(ok: jax.Array, new, old):
    """On device: `new` when ok, else `old` (same pytree structure): the skipped step changes nothing."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class DivergedError(RuntimeError):
    """A step gave a non-finite loss or gradient under train.on_nonfinite=stop."""


class NonFiniteWatch:
    """Host side: looks at each step's `ok` as its metrics are written and remembers the newest saved
    step, so a stop can name the checkpoint to go back to."""

    def __init__(self, mode: str, checkpoint_dir, last_saved: int | None):
        self.mode, self.checkpoint_dir, self.last_saved = mode, checkpoint_dir, last_saved
        self.skipped: list[int] = []

    def saved(self, step: int) -> None:
        self.last_saved = step

    def check(self, step: int, values: dict) -> bool:
        """Whether `step` was finite; raises DivergedError for a bad step in stop mode."""
        if values["ok"]:
            return True
        if self.mode == "skip":
            self.skipped.append(step)
            return False
        good = (f"the newest good checkpoint, {self.checkpoint_dir / str(self.last_saved)}, is kept"
                if self.last_saved is not None else "no checkpoint had been saved")
        raise DivergedError(
            f"training diverged at step {step} (loss {values['loss']}, gradient norm {values['grad_norm']}): "
            f"nothing from that step on was saved; {good}. Lower optim.lr, or set train.on_nonfinite=skip "
            "to skip such steps"
        )
