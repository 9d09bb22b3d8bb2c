"""Losses, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from diffjax.sharding import constrain


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


def next_token_targets(tokens_BT, segment_ids_BT, loss_mask_BT=None):
    """(targets [B, T] int, weights [B, T] float32): position t predicts tokens[t + 1], counted where
    packed_target_mask allows (segment_ids_BT None: one document per row) and loss_mask_BT[t + 1] is set (the
    batch's "loss_mask": tokens the loss counts; None: all); the last position has no target (weight 0). Stated per
    position, so a batch may be permuted after this (the context-parallel layout) and the loss stays the same."""
    B, T = jnp.shape(tokens_BT)
    mask_BT = jnp.ones((B, T - 1), bool) if segment_ids_BT is None else packed_target_mask(segment_ids_BT)
    if loss_mask_BT is not None:
        mask_BT &= jnp.asarray(loss_mask_BT)[:, 1:] != 0
    weights_BT = jnp.pad(mask_BT.astype(jnp.float32), ((0, 0), (0, 1)))
    targets_BT = jnp.pad(jnp.asarray(tokens_BT)[:, 1:], ((0, 0), (0, 1)))
    return targets_BT, weights_BT


def loss_sum_and_count(logits_BTV, targets_BT, weights_BT):
    """(sum of weighted cross-entropies, sum of weights); targets and weights from next_token_targets."""
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    return jnp.sum(losses_BT * weights_BT), jnp.sum(weights_BT)


def packed_loss_sum_and_count(logits_BTV, tokens_BT, segment_ids_BT):
    """(sum of next-token cross-entropies, number of targets) within the documents of packed rows.

    Targets as in packed_target_mask. Summing (not averaging) per micro-batch lets gradient
    accumulation and eval weight every target equally.
    """
    return loss_sum_and_count(logits_BTV, *next_token_targets(tokens_BT, segment_ids_BT))


def packed_next_token_loss(logits_BTV, tokens_BT, segment_ids_BT):
    """(mean loss, number of targets); the mean is 0 when there is no target."""
    total, count = packed_loss_sum_and_count(logits_BTV, tokens_BT, segment_ids_BT)
    return total / jnp.maximum(count, 1.0), count


def chunked_packed_loss_sum_and_count(hidden_BTD, head_DV, tokens_BT, segment_ids_BT, chunk_tokens: int):
    """packed_loss_sum_and_count of logits = hidden @ head (float32 products), without ever holding the
    [B, T, V] logits: a scan over chunks of about `chunk_tokens` tokens (chunk_tokens // B positions of
    every row, so the batch axis keeps its sharding) computes each chunk's float32 logits, loss and
    gradients (Liger-Kernel's fused linear cross-entropy). Differentiable in hidden and head only.

    hidden_BTD: the model's final hidden states (TransformerLM.hidden_states); head_DV: its output
    projection in the compute dtype (TransformerLM.head). Memory: one chunk's [B, chunk, V] logits and
    gradient, plus the gradients of hidden and head, which are computed in the forward pass (the loss is
    the last function, so its cotangent is a scalar) and only scaled in the backward: no recomputation.
    """
    B, T, _ = hidden_BTD.shape
    if tokens_BT.shape != (B, T) or segment_ids_BT.shape != (B, T):
        raise ValueError(f"tokens {tokens_BT.shape} and segment_ids {segment_ids_BT.shape} must be [B, T] = {(B, T)} "
                         f"like hidden {hidden_BTD.shape}")
    return chunked_loss_sum_and_count(hidden_BTD, head_DV, *next_token_targets(tokens_BT, segment_ids_BT), chunk_tokens)


def chunked_loss_sum_and_count(hidden_BTD, head_DV, targets_BT, weights_BT, chunk_tokens: int):
    """loss_sum_and_count of logits = hidden @ head, chunked as chunked_packed_loss_sum_and_count says."""
    B, T, _ = hidden_BTD.shape
    if not (isinstance(chunk_tokens, int) and chunk_tokens > 0):
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    chunk = min(max(chunk_tokens // B, 1), T)
    num_chunks = -(-T // chunk)

    def to_chunks(x):  # [B, T, ...] -> [num_chunks, B, chunk, ...], padded with zeros (weight 0)
        x = jnp.pad(x, ((0, 0), (0, num_chunks * chunk - T)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, num_chunks, chunk, *x.shape[2:]), 1, 0)

    total = _chunked_cross_entropy_sum(to_chunks(hidden_BTD), head_DV, to_chunks(targets_BT), to_chunks(weights_BT))
    return total, jnp.sum(weights_BT)


def _chunk_logits(hidden_BCD, head_DV):
    """Exactly the model's logits for these positions (same einsum, float32 products)."""
    return constrain(jnp.einsum("bcd,dv->bcv", hidden_BCD, head_DV, preferred_element_type=jnp.float32),
                     ("batch", "length", "act_vocab"))


def _chunk_losses(logits_BCV, targets_BC):
    """(cross-entropy [B, C], logsumexp [B, C], one-hot mask of the targets [B, C, V] as a bool expression).
    The target logit is a masked sum, not a gather, so a vocab axis split over devices stays split. It and the row
    max come from one pass over the logits (a variadic reduction: XLA kept the two apart, each reading a chunk's
    float32 logits); logsumexp's value is jax.nn.logsumexp's, the same operations."""
    is_target_BCV = jnp.arange(logits_BCV.shape[-1]) == targets_BC[..., None]
    max_BC, target_logit_BC = jax.lax.reduce(
        (logits_BCV, jnp.where(is_target_BCV, logits_BCV, 0.0)), (jnp.float32(-jnp.inf), jnp.float32(0)),
        lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]), (logits_BCV.ndim - 1,))
    shift_BC = jnp.where(jnp.isfinite(max_BC), max_BC, 0.0)
    logsumexp_BC = jnp.log(jnp.sum(jnp.exp(logits_BCV - shift_BC[..., None]), axis=-1)) + shift_BC
    return logsumexp_BC - target_logit_BC, logsumexp_BC, is_target_BCV


@jax.custom_vjp
def _chunked_cross_entropy_sum(hidden_NBCD, head_DV, targets_NBC, weights_NBC):
    """sum(weights * cross-entropy) over chunks [N, B, C]; forward only (what eval runs)."""

    def add_chunk(total, chunk):
        hidden_BCD, targets_BC, weights_BC = chunk
        losses_BC, _, _ = _chunk_losses(_chunk_logits(hidden_BCD, head_DV), targets_BC)
        return total + jnp.sum(losses_BC * weights_BC), None

    total, _ = jax.lax.scan(add_chunk, jnp.float32(0), (hidden_NBCD, targets_NBC, weights_NBC))
    return total


def _chunked_cross_entropy_sum_fwd(hidden_NBCD, head_DV, targets_NBC, weights_NBC):
    """The loss and its gradients at cotangent 1: d loss / d logits = weights * (softmax - one_hot), cast
    to the compute dtype for the two matmuls (as the model's own einsum's transpose would be); the head's
    gradient sums over chunks in float32 and is rounded once."""
    dtype = hidden_NBCD.dtype

    def add_chunk(carry, chunk):
        total, dhead_DV = carry
        hidden_BCD, targets_BC, weights_BC = chunk
        logits_BCV = _chunk_logits(hidden_BCD, head_DV)
        losses_BC, logsumexp_BC, is_target_BCV = _chunk_losses(logits_BCV, targets_BC)
        softmax_BCV = jnp.exp(logits_BCV - logsumexp_BC[..., None])
        dlogits_BCV = ((softmax_BCV - is_target_BCV) * weights_BC[..., None]).astype(dtype)
        dhidden_BCD = jnp.einsum("bcv,dv->bcd", dlogits_BCV, head_DV, preferred_element_type=jnp.float32).astype(dtype)
        dhead_DV = dhead_DV + jnp.einsum("bcd,bcv->dv", hidden_BCD, dlogits_BCV, preferred_element_type=jnp.float32)
        return (total + jnp.sum(losses_BC * weights_BC), dhead_DV), dhidden_BCD

    zeros_DV = jnp.zeros(head_DV.shape, jnp.float32)
    (total, dhead_DV), dhidden_NBCD = jax.lax.scan(add_chunk, (jnp.float32(0), zeros_DV),
                                                   (hidden_NBCD, targets_NBC, weights_NBC))
    return total, (dhidden_NBCD, dhead_DV.astype(head_DV.dtype))


def _chunked_cross_entropy_sum_bwd(residuals, cotangent):
    dhidden_NBCD, dhead_DV = residuals
    # targets and weights (the packing mask) are data, not differentiated: None is a zero cotangent.
    return dhidden_NBCD * cotangent.astype(dhidden_NBCD.dtype), dhead_DV * cotangent.astype(dhead_DV.dtype), None, None


_chunked_cross_entropy_sum.defvjp(_chunked_cross_entropy_sum_fwd, _chunked_cross_entropy_sum_bwd)
