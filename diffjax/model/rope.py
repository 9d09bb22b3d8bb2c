"""Rotary position embeddings: frequency schedules and the two pairing styles.

"interleaved" (GPT-J, unilm) rotates channel pairs (2i, 2i+1); "rotate_half" (NeoX, HF Llama)
rotates (i, i + d/2). Both use frequency i for pair i, so the two are the same function up to a
fixed permutation of the q/k channels (diffjax.convert.weight_plan.interleaved_from_rotate_half, which the
converters apply to HF weights).

Schedules (ModelConfig.rope_type): "default" theta^(-2i/d); "llama3"; "yarn" (the frequencies only: YaRN's
attention factor goes on the softmax scale of the layers that attend the whole context, `softmax_scale_factor`,
never on cos / sin, as Motif 3 and vLLM's MLA models do). The rotated width is the attention kind's
`rotary_dim` (head_dim; GDLA's qk_rope_head_dim). Windowed layers may rotate with their own theta
(ModelConfig.window_rope_theta, plain frequencies): `layer_rope_tables` then gives both tables (`WindowedRope`)
and each layer takes its own (AttentionModule.layer_rope).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from diffjax import attention_kinds
from diffjax.config import ModelConfig


def rotary_dim(config: ModelConfig) -> int:
    """The channels of each q / k head that RoPE rotates (the attention kind's rotary_dim; head_dim by default)."""
    return attention_kinds.get(config.attention).rotary_dim(config)


def plain_inv_frequencies(d: int, theta: float) -> np.ndarray:
    """theta^(-2i/d), i < d/2, in float64."""
    return 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))


def inv_frequencies(config: ModelConfig) -> np.ndarray:
    """inv_freq[i] = theta^(-2i/d), i < d/2 (d: rotary_dim), optionally rescaled by the llama3 or YaRN schedule
    (float32)."""
    inv_freq = plain_inv_frequencies(rotary_dim(config), config.rope_theta)
    if config.rope_type == "llama3":
        inv_freq = _llama3_schedule(inv_freq, config)
    elif config.rope_type == "yarn":
        inv_freq = _yarn_schedule(inv_freq, config)
    return inv_freq.astype(np.float32)


def window_inv_frequencies(config: ModelConfig) -> np.ndarray:
    """The windowed layers' frequencies: plain with window_rope_theta (float32); the global ones without it."""
    if config.window_rope_theta is None:
        return inv_frequencies(config)
    return plain_inv_frequencies(rotary_dim(config), config.window_rope_theta).astype(np.float32)


def _yarn_schedule(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    """YaRN (Peng et al. 2023; vLLM's / transformers' _compute_inv_freq): keep the pairs that turn more than
    beta_fast times over the original context, divide by `factor` those that turn fewer than beta_slow times, a
    linear ramp over the pair index in between (its ends truncated to whole pairs)."""
    d, theta, factor = rotary_dim(config), config.rope_theta, config.rope_factor
    original = config.rope_original_max_len

    def correction_dim(rotations):  # the pair index that turns `rotations` times over the original context
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(config.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.rope_beta_slow)), d - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def softmax_scale_factor(config: ModelConfig) -> float:
    """What multiplies the softmax scale of the layers that attend the whole context: YaRN's
    (0.1 rope_mscale ln(rope_factor) + 1)^2 when rope_mscale is set (Motif 3 / DeepSeek's MLA), else 1."""
    if config.rope_type != "yarn" or config.rope_mscale is None:
        return 1.0
    mscale = 0.1 * config.rope_mscale * math.log(config.rope_factor) + 1.0
    return mscale * mscale


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


class WindowedRope(NamedTuple):
    """The tables of a model whose windowed layers rotate with their own theta: each layer picks its pair."""

    global_cos_sin: tuple
    windowed_cos_sin: tuple


def layer_rope_tables(config: ModelConfig, positions_BT, dtype):
    """What the layers rotate with: (cos, sin) [B, T, rotary_dim / 2], or a WindowedRope when windowed and global
    layers use different frequencies (window_rope_theta with global_layers)."""
    if config.attention_window is None or config.window_rope_theta is None:
        return rope_tables(positions_BT, inv_frequencies(config), dtype)
    windowed = rope_tables(positions_BT, window_inv_frequencies(config), dtype)
    if not config.global_layers:
        return windowed
    return WindowedRope(rope_tables(positions_BT, inv_frequencies(config), dtype), windowed)


def select_rope(rope: WindowedRope, windowed):
    """A layer's (cos, sin) of a WindowedRope; windowed: a bool or a traced one."""
    if isinstance(windowed, bool):
        return rope.windowed_cos_sin if windowed else rope.global_cos_sin
    return tuple(jnp.where(windowed, w, g) for w, g in zip(rope.windowed_cos_sin, rope.global_cos_sin))


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

