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


def check_step(step: int, values: dict, mode: str, newest_checkpoint) -> bool:
    """Host side, as a step's metrics are written: whether `step` was finite (values["ok"]). A bad step
    raises DivergedError in stop mode, naming `newest_checkpoint` (a path, or None) to go back to."""
    if values["ok"]:
        return True
    if mode == "skip":
        return False
    good = (f"the newest good checkpoint, {newest_checkpoint}, is kept" if newest_checkpoint is not None
            else "no checkpoint had been saved")
    raise DivergedError(
        f"training diverged at step {step} (loss {values['loss']}, gradient norm {values['grad_norm']}): "
        f"nothing from that step on was saved; {good}. Lower optim.lr, or set train.on_nonfinite=skip "
        "to skip such steps"
    )
