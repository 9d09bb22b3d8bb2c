"""Choosing the next token from logits: greedy, or temperature with optional top-k / top-p filtering."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax; top_k / top_p unused). Otherwise logits / temperature, then top-k, then
    top-p (the smallest set of most likely tokens whose probability reaches top_p), the order of HF's
    `generate`. allowed_vocab_size: only ids below it are ever chosen, greedy or sampled (a model's vocabulary
    padded past its tokenizer's has ids no tokenizer decodes); None: every id. blocked_ids: ids below it that are
    never chosen either (a tokenizer's gaps: tiktoken's cl100k_base has no 100256). Hashable: a static argument of
    the jitted steps."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    allowed_vocab_size: int | None = None
    blocked_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {self.temperature!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k > 0):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if self.allowed_vocab_size is not None and not (isinstance(self.allowed_vocab_size, int)
                                                        and self.allowed_vocab_size > 0):
            raise ValueError(f"allowed_vocab_size must be a positive integer or None, got {self.allowed_vocab_size!r}")
        if not (isinstance(self.blocked_ids, tuple) and all(isinstance(i, int) and i >= 0 for i in self.blocked_ids)):
            raise ValueError(f"blocked_ids must be a tuple of ids >= 0, got {self.blocked_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def mask_undecodable(logits_BV, allowed_vocab_size: int | None, blocked_ids: tuple[int, ...] = ()):
    """The logits with every id from allowed_vocab_size on, and each of blocked_ids, set to -inf (nothing to
    mask: unchanged)."""
    vocab = logits_BV.shape[-1]
    limit = vocab if allowed_vocab_size is None else min(allowed_vocab_size, vocab)
    blocked = [i for i in blocked_ids if i < limit]
    if limit == vocab and not blocked:
        return logits_BV
    ids_V = jnp.arange(vocab)
    allowed_V = (ids_V < limit) & ~jnp.isin(ids_V, jnp.asarray(blocked, jnp.int32))
    return jnp.where(allowed_V, logits_BV, -jnp.inf)


def filter_logits(logits_BV, top_k: int | None = None, top_p: float | None = None):
    """float32 logits with the tokens top-k and then top-p remove set to -inf (ties at a cut are kept)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p is not None and top_p < 1:
        sorted_BV = jnp.flip(jnp.sort(logits_BV, axis=-1), axis=-1)  # descending
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_above_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # of the tokens more likely than this one
        kept_B1 = jnp.sum(mass_above_BV < top_p, axis=-1, keepdims=True)  # >= 1: the first has 0 above it
        cutoff_B1 = jnp.take_along_axis(sorted_BV, kept_B1 - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return logits_BV


def next_tokens(logits_BV, key, sampling: Sampling):
    """The next token of each row, int32 [B]."""
    # before temperature, top-k and top-p
    logits_BV = mask_undecodable(logits_BV, sampling.allowed_vocab_size, sampling.blocked_ids)
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    scaled_BV = logits_BV.astype(jnp.float32) / jnp.float32(sampling.temperature)
    filtered_BV = filter_logits(scaled_BV, sampling.top_k, sampling.top_p)
    return jax.random.categorical(key, filtered_BV, axis=-1).astype(jnp.int32)
