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


def packed_loss_sum_and_count(logits_BTV, tokens_BT, segment_ids_BT):
    """(sum of next-token cross-entropies, number of counted targets) for packed rows.

    logits[:, t] predicts tokens[:, t + 1] only where both are in the same document
    (segment_ids equal and nonzero): never across a document boundary, never into padding.
    The sum and count let gradient accumulation weight every token equally.
    """
    logits = logits_BTV[:, :-1].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:])
    same_document = (segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]) & (segment_ids_BT[:, 1:] != 0)
    weights = same_document.astype(jnp.float32)
    return jnp.sum(losses * weights), jnp.sum(weights)
