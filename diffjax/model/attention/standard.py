"""The baseline causal multi-head attention with GQA (query head n uses kv head n // n_rep): Llama's.

Kernels: q (D, N, d), k and v (D, Hkv, d), o (N, d, D).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.attention.base import AttentionModule
from diffjax.model.layers import normal_param
from diffjax.model.rope import apply_rope
from diffjax.sharding import constrain


class StandardAttention(AttentionModule):
    """Multi-head / grouped-query attention; depth-independent (`depth` is accepted and unused)."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        D, N, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        std, pdt = config.init_std, config.param_dtype
        self.config = config
        self.q_kernel = normal_param(rngs, (D, N, d), std, pdt, ("embed", "heads", "head_dim"))
        self.k_kernel = normal_param(rngs, (D, K, d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.v_kernel = normal_param(rngs, (D, K, d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = normal_param(rngs, (N, d, D), std, pdt, ("heads", "head_dim", "embed"))

    def project(self, x_BTD, rope_cos_sin):
        """(q [B, T, N, d], k [B, S, Hkv, d], v [B, S, Hkv, d]) with q and k rotated."""
        dtype, (cos, sin) = x_BTD.dtype, rope_cos_sin
        q_BTNd = jnp.einsum("btD,Dnd->btnd", x_BTD, self.q_kernel[...].astype(dtype))
        k_BSKd = jnp.einsum("bsD,Dkd->bskd", x_BTD, self.k_kernel[...].astype(dtype))
        v_BSKd = jnp.einsum("bsD,Dkd->bskd", x_BTD, self.v_kernel[...].astype(dtype))
        q_BTNd = constrain(q_BTNd, ("batch", "length", "act_heads", None))
        k_BSKd = constrain(k_BSKd, ("batch", "length", "act_kv_heads", None))
        v_BSKd = constrain(v_BSKd, ("batch", "length", "act_kv_heads", None))
        return apply_rope(q_BTNd, cos, sin, self.config.rope_style), apply_rope(k_BSKd, cos, sin, self.config.rope_style), v_BSKd

    def output(self, o_BTNd, constants):
        return self._out_projection(o_BTNd, o_BTNd.dtype)
