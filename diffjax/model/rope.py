"""Rotary position embeddings: frequency schedules and the two pairing styles.

"interleaved" (GPT-J, unilm) rotates channel pairs (2i, 2i+1); "rotate_half" (NeoX, HF Llama)
rotates (i, i + d/2). Both use frequency i for pair i, so the two are the same function up to a
fixed permutation of the q/k channels (diffjax.convert applies it when importing HF weights).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from diffjax.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> np.ndarray:
    """inv_freq[i] = theta^(-2i/d), i < d/2, optionally rescaled by the llama3 schedule (float32)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if config.rope_type == "llama3":
        inv_freq = _llama3_schedule(inv_freq, config)
    return inv_freq.astype(np.float32)


def _llama3_schedule(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    context = config.rope_original_max_len
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelength > context / low, inv_freq / factor, inv_freq)
    is_medium = (wavelength >= context / high) & (wavelength <= context / low)
    return np.where(is_medium, interpolated, scaled)


def rope_tables(positions_BT, inv_freq_f, dtype):
    """cos, sin [B, T, d/2]: angles in float32, then rounded to the activation dtype (as both references do)."""
    angles_BTf = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_f)
    return jnp.cos(angles_BTf).astype(dtype), jnp.sin(angles_BTf).astype(dtype)


def apply_rope(x_BT_d, cos_BTf, sin_BTf, style: str):
    """Rotate the last axis of x [B, T, ..., d]; the rotation runs in float32 and is stored in x's dtype."""
    extra_axes = x_BT_d.ndim - 3
    shape = cos_BTf.shape[:2] + (1,) * extra_axes + cos_BTf.shape[2:]
    cos, sin = cos_BTf.astype(jnp.float32).reshape(shape), sin_BTf.astype(jnp.float32).reshape(shape)
    x = x_BT_d.astype(jnp.float32)
    if style == "interleaved":
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = jnp.stack([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], axis=-1)
        rotated = rotated.reshape(x.shape)
    elif style == "rotate_half":
        x_lo, x_hi = jnp.split(x, 2, axis=-1)
        rotated = jnp.concatenate([x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin], axis=-1)
    else:
        raise ValueError(f"rope style must be 'interleaved' or 'rotate_half', got {style!r}")
    return rotated.astype(x_BT_d.dtype)


def interleaved_from_rotate_half(d: int) -> np.ndarray:
    """Index map: channel c of the interleaved layout takes channel idx[c] of the rotate_half layout.

    Interleaved channel 2i is the first element of pair i (rotate_half channel i); 2i + 1 is the
    second (rotate_half channel i + d/2).
    """
    idx = np.empty(d, dtype=np.int64)
    idx[0::2] = np.arange(d // 2)
    idx[1::2] = np.arange(d // 2) + d // 2
    return idx
