"""The non-finite guard: a diverging step is found on the device and never reaches a checkpoint.

The jitted step computes `ok` (loss, gradient norm and update norm all finite) every step; with
`train.on_nonfinite=skip` it also keeps the old params and optimizer state when not ok, as large-scale
trainers do. The host reads `ok` only where it syncs anyway: when it writes metrics, which it does
before every checkpoint save. So no checkpoint of a state after a bad step is ever saved, and no
step pays an extra device-to-host sync. The checkpoint just before a bad step is not kept either: the
bad step's loss came from its params (NonfiniteGuard). The model's kinds may fail a step too (their facets'
step_ok, diffjax.model.facets: the MoE's non-finite router logits) and say why in the stop's message, and may stop
the run on their own guards (MetricsLog asks each facet's `stop`). A checkpoint saved before this start is never
set aside by it (NonfiniteGuard.first_spoiled): its first step failing may be this start's doing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def step_ok(loss: jax.Array, grad_norm: jax.Array, update_norm: jax.Array) -> jax.Array:
    """On device: True when the step's loss and its gradient and update are finite."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)


def keep_old_if_bad(ok: jax.Array, new, old):
    """On device: `new` when ok, else `old` (same pytree structure): the skipped step changes nothing."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class DivergedError(RuntimeError):
    """A step gave a non-finite loss or gradient under train.on_nonfinite=stop, or more consecutive steps than
    train.max_skipped_steps did under skip, or a kind's guard stopped the run (its facet's `stop`)."""


class NonfiniteGuard:
    """Host side, as each step's metrics are written: whether the step was finite (values["ok"]), and when the
    run must stop. A step's loss is computed from the params the previous step made, so when step k is not
    finite the state saved at step k - 1 cannot be trained on either (its forward pass or gradient is not
    finite whatever the learning rate): the stop falls back to a checkpoint before the bad stretch began."""

    def __init__(self, mode: str, max_skipped_steps: int, reasons: Callable[[dict], str] = lambda values: "",
                 first_step: int = 1):
        self.mode, self.max_skipped_steps = mode, max_skipped_steps
        self.reasons = reasons  # what the kinds say about a non-finite step ("; ..."; the facets' nonfinite_reasons)
        self.first_step = first_step  # this start's first step (a resumed run's: the step after its checkpoint)
        self.bad_since: int | None = None  # the first step of the current stretch of non-finite steps

    def first_spoiled(self) -> int | None:
        """The oldest step whose checkpoint the current stretch of non-finite steps spoils (None: no stretch): the
        one before the stretch (its params gave the stretch's first loss), but never one this start resumed from.
        When the stretch begins at this start's first step, the start itself may be the cause (a setting it changed:
        model.mtp_loss_weight, optim.lr, ...) as much as the checkpoint, which was finite when it was saved, and
        setting it aside would lose it (a rerun would set aside the next one, and so on)."""
        return None if self.bad_since is None else max(self.bad_since - 1, self.first_step)

    def check(self, step: int, values: dict, fall_back) -> bool:
        """True for a finite step, False for one skipped; raises fall_back(first_spoiled())'s DivergedError when
        the run must stop (fall_back sets aside the checkpoints the stretch spoiled and names the newest left)."""
        if values["ok"]:
            self.bad_since = None
            return True
        if self.bad_since is None:
            self.bad_since = step
        skipped = step - self.bad_since + 1
        if self.mode == "skip" and skipped <= self.max_skipped_steps:
            return False
        reasons = self.reasons(values)
        what = (f"training diverged at step {step} (loss {values['loss']}, gradient norm {values['grad_norm']}{reasons})"
                if self.mode == "stop" else
                f"{skipped} consecutive steps ({self.bad_since}-{step}) were not finite and skipped "
                f"(train.max_skipped_steps = {self.max_skipped_steps}; the last: loss {values['loss']}, "
                f"gradient norm {values['grad_norm']}{reasons})")
        resumed = self.first_step - 1
        first = (f"; step {self.first_step} was the first since this start resumed from checkpoint {resumed} (finite "
                 f"when it was saved, so kept): look first at the settings this start changed (its line `note: "
                 f"resuming with changed ...`); if none did, move checkpoints/{resumed} out of the run directory to "
                 "continue from an earlier checkpoint") if self.bad_since == self.first_step > 1 else ""
        raise DivergedError(f"{what}: {fall_back(self.first_spoiled())}{first}. Lower optim.lr"
                            + (", or set train.on_nonfinite=skip to skip such steps" if self.mode == "stop" else ""))
