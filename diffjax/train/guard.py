"""The non-finite guard: a diverging step is found on the device and never reaches a checkpoint.

The jitted step computes `ok` (loss, gradient norm and update norm all finite) every step; with
`train.on_nonfinite=skip` it also keeps the old params and optimizer state when not ok, as large-scale
trainers do. The host reads `ok` only where it syncs anyway: when it writes metrics, which it does
before every checkpoint save. So no checkpoint of a state after a bad step is ever saved, and no
step pays an extra device-to-host sync. The checkpoint just before a bad step is not kept either: the
bad step's loss came from its params (NonfiniteGuard). With MoE layers a non-finite step also fails when a router
logit was not finite, and the message names the layer; RouterCollapseGuard stops a run whose MoE layer keeps routing
every token to the same top_k experts, naming that layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def step_ok(loss: jax.Array, grad_norm: jax.Array, update_norm: jax.Array) -> jax.Array:
    """On device: True when the step's loss and its gradient and update are finite."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)


def routers_finite(router_stats: dict) -> jax.Array:
    """On device: True when no MoE layer's router saw a non-finite logit (mlp.router.routing_stats, summed)."""
    return jnp.all(router_stats["nonfinite"] == 0)


def keep_old_if_bad(ok: jax.Array, new, old):
    """On device: `new` when ok, else `old` (same pytree structure): the skipped step changes nothing."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class DivergedError(RuntimeError):
    """A step gave a non-finite loss or gradient under train.on_nonfinite=stop, or more consecutive steps than
    train.max_skipped_steps did under skip."""


class NonfiniteGuard:
    """Host side, as each step's metrics are written: whether the step was finite (values["ok"]), and when the
    run must stop. A step's loss is computed from the params the previous step made, so when step k is not
    finite the state saved at step k - 1 cannot be trained on either (its forward pass or gradient is not
    finite whatever the learning rate): the stop falls back to a checkpoint before the bad stretch began."""

    def __init__(self, mode: str, max_skipped_steps: int, moe_layers: Sequence[int] = ()):
        self.mode, self.max_skipped_steps = mode, max_skipped_steps
        self.moe_layers = list(moe_layers)  # the rows of values["router"] (metrics.moe_layers)
        self.bad_since: int | None = None  # the first step of the current stretch of non-finite steps

    def check(self, step: int, values: dict, fall_back) -> bool:
        """True for a finite step, False for one skipped; raises fall_back(first bad step)'s DivergedError when
        the run must stop (fall_back sets aside the checkpoints the stretch spoiled and names the newest left)."""
        if values["ok"]:
            self.bad_since = None
            return True
        if self.bad_since is None:
            self.bad_since = step
        skipped = step - self.bad_since + 1
        if self.mode == "skip" and skipped <= self.max_skipped_steps:
            return False
        routers = self._nonfinite_routers(values)
        what = (f"training diverged at step {step} (loss {values['loss']}, gradient norm {values['grad_norm']}{routers})"
                if self.mode == "stop" else
                f"{skipped} consecutive steps ({self.bad_since}-{step}) were not finite and skipped "
                f"(train.max_skipped_steps = {self.max_skipped_steps}; the last: loss {values['loss']}, "
                f"gradient norm {values['grad_norm']}{routers})")
        raise DivergedError(f"{what}: {fall_back(self.bad_since)}. Lower optim.lr"
                            + (", or set train.on_nonfinite=skip to skip such steps" if self.mode == "stop" else ""))

    def _nonfinite_routers(self, values: dict) -> str:
        """'; the router logits of layer 3 were not finite for 12 tokens' (each such layer), or ''."""
        nonfinite = np.asarray(values["router"]["nonfinite"]) if "router" in values else ()
        return "".join(f"; the router logits of layer {layer} were not finite for {count} tokens"
                       for layer, count in zip(self.moe_layers, nonfinite) if count)


class RouterCollapseGuard:
    """Host side, as each step's metrics are written: stops the run when an MoE layer's router has collapsed, i.e.
    sent every token of the global batch to the same top_k experts (all others idle: the layer is a dense MLP of
    top_k experts) for `steps` steps in a row (mlp_options.collapse_steps; None: never). The state is not spoiled
    (no checkpoint is set aside); the message names the layer and what it saw."""

    def __init__(self, moe_layers: Sequence[int], top_k: int, num_experts: int, steps: int | None):
        self.moe_layers, self.top_k, self.num_experts, self.steps = list(moe_layers), top_k, num_experts, steps
        self.collapsed_since: dict[int, int] = {}  # layer -> the first step of its current collapsed stretch

    def check(self, step: int, router: dict) -> None:
        """router: the step's metrics["router"] (host arrays); raises DivergedError naming a collapsed layer."""
        if self.steps is None or self.top_k >= self.num_experts:
            return
        for row, layer in enumerate(self.moe_layers):
            used = np.flatnonzero(np.asarray(router["load"][row]) > 0)
            if len(used) > self.top_k:
                self.collapsed_since.pop(layer, None)
                continue
            since = self.collapsed_since.setdefault(layer, step)
            if step - since + 1 >= self.steps:
                steps = f"step {step}" if since == step else f"steps {since}-{step}"
                raise DivergedError(
                    f"the router of layer {layer} collapsed: in {steps} every token went to experts {used.tolist()} "
                    f"(the other {self.num_experts - len(used)} got none; router entropy "
                    f"{float(router['entropy'][row]):.3g} nats, uniform {np.log(self.num_experts):.3g}). Set or raise "
                    "model.mlp_options.load_balance_coeff (with expert_bias: true), or lower optim.lr; "
                    "model.mlp_options.collapse_steps=null turns this check off")
