"""The training side of an MoE router: the statistics each MoE layer's forward hands to the trainer, and the
auxiliary-loss-free selection-bias update (DeepSeek-V3's load balancing as torchtitan implements it).

Statistics leave the forward on the layer output channel (diffjax.model.layer_outputs) as "router": a forward not
asked for them computes none (its program is unchanged). Every statistic is a sum over the call's tokens, so
micro-batches and devices simply add (reduction "sum").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

OUTPUT = "router"  # the name of routing_stats on the layer output channel


def routing_stats(logits_NE, experts_NK, num_experts: int, score_func: str) -> dict:
    """One call's routing, summed over its N tokens: "tokens" [E] int32, how many (token, choice) pairs chose each
    expert (torchtitan's tokens_per_expert: every token position counts, padding too); "entropy" float32, the sum
    over tokens of the router distribution's entropy in nats (softmax's probabilities; sigmoid scores divided by
    their sum; log E when uniform); "nonfinite" int32, the tokens with a non-finite router logit."""
    logits_NE = jax.lax.stop_gradient(logits_NE)
    if score_func == "sigmoid":
        scores_NE = jax.nn.sigmoid(logits_NE)
        probs_NE = scores_NE / jnp.sum(scores_NE, axis=-1, keepdims=True)
    else:
        probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    return {
        "tokens": jnp.bincount(experts_NK.reshape(-1), length=num_experts).astype(jnp.int32),
        "entropy": jnp.sum(jax.scipy.special.entr(probs_NE)),
        "nonfinite": jnp.sum(~jnp.all(jnp.isfinite(logits_NE), axis=-1)).astype(jnp.int32),
    }


def balanced_expert_bias(bias_LE, tokens_LE, coeff: float):
    """The selection bias after one step's update, per MoE layer (rows) from the tokens each expert got in the step
    (summed over the whole global batch and its micro-batches): torchtitan's auxiliary-loss-free load balancing
    (pytorch/torchtitan, torchtitan/components/optimizer.py, build_optimizers_with_moe_load_balancing's
    _update_expert_bias; Motif 3's config key load_balance_coeff is torchtitan's MoEArgs field):

        delta = coeff * sign(mean(tokens) - tokens);  bias += delta - mean(delta)

    DeepSeek-V3 (arXiv 2412.19437, section 2.1.2; Wang et al., arXiv 2408.15664) adds +-coeff by whether an expert
    is under- or overloaded; torchtitan also centres the step (the bias's mean does not move: only differences
    between experts change a top-k). The bias is stored in its parameter dtype; the update is computed in float32."""
    tokens_LE = tokens_LE.astype(jnp.float32)
    delta_LE = coeff * jnp.sign(jnp.mean(tokens_LE, axis=-1, keepdims=True) - tokens_LE)
    delta_LE = delta_LE - jnp.mean(delta_LE, axis=-1, keepdims=True)
    return (bias_LE.astype(jnp.float32) + delta_LE).astype(bias_LE.dtype)

