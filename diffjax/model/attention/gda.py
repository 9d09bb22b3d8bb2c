"""Grouped Differential Attention (GDA; Lim et al., arXiv:2510.06949; Motif-2-12.7B).

Differential attention V1 (lambda, lambda_init, per-head RMSNorm over 2d, (1 - lambda_init), values 2d wide)
with fewer noise maps than signal maps: H signal heads and N noise heads (N divides H), signal head s
subtracting noise head s // (H / N)'s map, both reading kv head s // (H / K):

    o_s = A(q_s, k1) V - lambda A(q_noise[s // (H / N)], k2) V,    V = [v1 | v2] of the kv head

N = H is V1. Kernels: q (D, N, G + 1, d) in groups of G = H / N, group n holding signal heads n G ... n G + G - 1
then noise head n (Motif's q_proj stripe; with N = H it is V1's q (D, H, 2, d)), and V1's k (D, Hkv, 2, d),
v (D, Hkv, 2d) and o (H, 2d, D). The op is V1's one ops.diff_attention call, its second map's queries each
noise query repeated over its signal heads: exact (the repeated maps are the same numbers), at the cost of
computing each noise map H / N times (attention_kinds counts the GDA's own H + N maps for MFU).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.attention.diff import DiffAttention
from diffjax.model.layers import normal_param


class GroupedDiffAttention(DiffAttention):
    """GDA for the layer at 0-based `depth` (None: a layer of a stack, as DiffAttention). Inherits everything from
    DiffAttention except its query parameters and `queries`."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        N = config.attention_options.num_noise_heads
        std, pdt = config.init_std, config.param_dtype
        self.config = config
        self.lambda_init = None if depth is None else config.lambda_init_at(depth)
        self.q_kernel = normal_param(rngs, (D, N, H // N + 1, d), std, pdt, ("embed", "heads", None, "head_dim"))
        self.k_kernel = normal_param(rngs, (D, K, 2, d), std, pdt, ("embed", "kv_heads", None, "head_dim"))
        self.init_values_and_lambda(config, rngs)

    def queries(self, x_BTD):
        """q [B, T, H, 2, d] before RoPE: q[:, :, s, 1] is noise head s // (H / N)'s query."""
        B, T, _ = x_BTD.shape
        H, N = self.config.num_heads, self.config.attention_options.num_noise_heads
        q_BTNgd = jnp.einsum("btD,Dngd->btngd", x_BTD, self.q_kernel[...].astype(x_BTD.dtype))
        signal_BTHd = q_BTNgd[:, :, :, :-1].reshape(B, T, H, -1)
        noise_BTHd = jnp.repeat(q_BTNgd[:, :, :, -1], H // N, axis=2)  # signal head s -> noise head s // (H / N)
        return jnp.stack([signal_BTHd, noise_BTHd], axis=3)
