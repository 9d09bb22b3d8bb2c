"""Sampling text from a TransformerLM without a KV cache (each token re-runs the window).

Good enough for a sample at the end of a small training run; a prefill + decode path with a KV
cache is a separate piece of work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _sample_ids(graphdef, params, buffer, prompt_len: int, window: int, temperature: float, key):
    """Fills buffer[prompt_len:] one token at a time; each step sees at most the last `window` tokens."""
    model = nnx.merge(graphdef, params)

    def body(position, carry):
        buffer, key = carry
        start = jnp.clip(position - window, 0, buffer.shape[0] - window)
        context = jax.lax.dynamic_slice(buffer, (start,), (window,))
        logits = model(context[None])[0, position - 1 - start]
        key, subkey = jax.random.split(key)
        if temperature == 0:
            token = jnp.argmax(logits)
        else:
            token = jax.random.categorical(subkey, logits / temperature)
        return buffer.at[position].set(token.astype(buffer.dtype)), key

    buffer, _ = jax.lax.fori_loop(prompt_len, buffer.shape[0], body, (buffer, key))
    return buffer


def sample(model, prompt_ids, num_tokens: int, *, key, temperature: float = 0.8, window: int | None = None) -> np.ndarray:
    """`num_tokens` ids sampled after `prompt_ids` (temperature 0: greedy)."""
    prompt = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
    if prompt.size == 0:
        raise ValueError("sample needs a prompt of at least one token")
    total = prompt.size + num_tokens
    window = min(window or model.config.max_seq_len, model.config.max_seq_len, total)
    graphdef, params = nnx.split(model)
    buffer = jnp.zeros((total,), jnp.int32).at[: prompt.size].set(prompt)
    out = _sample_ids(graphdef, nnx.to_pure_dict(params), buffer, int(prompt.size), int(window), float(temperature), key)
    return np.asarray(out[prompt.size :])
