"""Losses, computed in float32."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def next_token_loss(logits_BTV, tokens_BT, mask_BT=None):
    """Mean cross-entropy of predicting tokens[:, t + 1] from logits[:, t].

    mask_BT (optional) marks the *target* positions that count (for example not padding and not
    the first token of a packed document).
    """
    logits = logits_BTV[:, :-1].astype(jnp.float32)
    targets = tokens_BT[:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mask_BT is None:
        return jnp.mean(losses)
    weights = mask_BT[:, 1:].astype(jnp.float32)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def packed_target_mask(segment_ids_BT):
    """Bool [B, T - 1]: True where logits[:, t] predict a real token of the same document.

    The target of position t is tokens[:, t + 1]; it counts only when segment_ids[t] ==
    segment_ids[t + 1] != 0, so no prediction crosses a document boundary or lands in padding.
    """
    segment_ids_BT = jnp.asarray(segment_ids_BT)
    return (segment_ids_BT[:, :-1] == segment_ids_BT[:, 1:]) & (segment_ids_BT[:, 1:] != 0)


def packed_loss_sum_and_count(logits_BTV, tokens_BT, segment_ids_BT):
    """(sum of next-token cross-entropies, number of targets) within the documents of packed rows.

    Targets as in packed_target_mask. Summing (not averaging) per micro-batch lets gradient
    accumulation and eval weight every target equally.
    """
    weights_BT = packed_target_mask(segment_ids_BT).astype(jnp.float32)
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, :-1].astype(jnp.float32), tokens_BT[:, 1:])
    return jnp.sum(losses_BT * weights_BT), jnp.sum(weights_BT)


def packed_next_token_loss(logits_BTV, tokens_BT, segment_ids_BT):
    """(mean loss, number of targets); the mean is 0 when there is no target."""
    total, count = packed_loss_sum_and_count(logits_BTV, tokens_BT, segment_ids_BT)
    return total / jnp.maximum(count, 1.0), count
