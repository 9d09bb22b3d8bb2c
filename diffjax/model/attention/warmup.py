"""The lambda warm-up of the two-map kinds (their rows' facet, or its base): with optim.lambda_warmup_steps = W > 0,
optimizer step s computes with every layer's lambda times min(1, s / W), so the first step computes with the second
map silent, as a model upcycled for a warm-up starts (diffjax.convert.upcycle), and lambda reaches its full value at
step W. The factor is the forward's input LAMBDA_SCALE (the attention multiplies lambda by it: AttentionModule.lambdas),
made for each train step and for the eval at that step, and logged as the step's metric of that name."""

from __future__ import annotations

import jax.numpy as jnp

from diffjax.model.facets import Facet

LAMBDA_SCALE = "lambda_scale"  # the forward's input and the step's metric


def lambda_scale(warmup_steps: int, step):
    """The factor on lambda at optimizer step `step` (0-based; float32): min(1, step / warmup_steps)."""
    return jnp.minimum(jnp.float32(1), jnp.asarray(step, jnp.float32) / warmup_steps)


class LambdaWarmup(Facet):
    """The warm-up (module docstring): its step input, from the run's optim.lambda_warmup_steps (none without a run or
    a warm-up)."""

    def step_inputs(self, step):
        warmup = 0 if self.run is None else self.run.optim.lambda_warmup_steps
        return {LAMBDA_SCALE: lambda_scale(warmup, step)} if warmup else {}
