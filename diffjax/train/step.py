"""The jitted train and eval steps over a pure-dict train state.

State: {"params": pure dict, "opt_state": optax state, "step": int32, "rng": uint32 key data}.
A step's batch is [accum_steps, micro_batch, seq_len] per key; micro-batches are summed in a scan
and the loss is the token-weighted mean over all of them, so accumulation equals one big batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.losses import packed_loss_sum_and_count
from diffjax.train.metrics import layer_lambdas


def init_state(model, tx: optax.GradientTransformation, seed: int) -> dict:
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {
        "params": params,
        "opt_state": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key_data(jax.random.key(seed)),
    }


def _loss_sum_and_count(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    logits_BTV = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    return packed_loss_sum_and_count(logits_BTV, batch["tokens"], batch["segment_ids"])


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, model_config: ModelConfig):
    """step(state, batch) -> (state, metrics); jit it with the state donated."""

    def train_step(state, batch):
        params = state["params"]
        grad_fn = jax.value_and_grad(lambda p, micro: _loss_sum_and_count(graphdef, p, micro), has_aux=True)

        def accumulate(carry, micro):
            grads_sum, loss_sum, count = carry
            (micro_loss, micro_count), grads = grad_fn(params, micro)
            grads_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_sum, grads)
            return (grads_sum, loss_sum + micro_loss, count + micro_count), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (grads_sum, loss_sum, count), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0), jnp.float32(0)), batch)
        denominator = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / denominator).astype(p.dtype), grads_sum, params)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        metrics = {
            "loss": loss_sum / denominator,
            "grad_norm": optax.global_norm(grads),
            "lr": schedule(state["step"]),
            "loss_tokens": count,
        }
        lambdas = layer_lambdas(new_params, model_config)
        if lambdas is not None:
            metrics["lambda"] = lambdas
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
        return new_state, metrics

    return train_step


def make_eval_step(graphdef):
    """eval_step(params, batch[B, T]) -> (loss sum, counted tokens)."""

    def eval_step(params, batch):
        return _loss_sum_and_count(graphdef, params, batch)

    return eval_step
