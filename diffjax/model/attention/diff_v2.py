"""Differential attention V2 (unilm `Diff-Transformer/Diff-Transformer-V2/multihead_flashdiffv2.py`).

h output heads of width d. The queries are 2h heads of d, paired (2j, 2j+1) inside one GQA group; k and v
have Hkv heads of d. Each pair's two softmax maps share their kv head's keys and values, and

    out_j = A(q_2j) v - lambda_j A(q_2j+1) v,   lambda[b, t, j] = sigmoid(x[b, t] . W_lambda[:, j])

with x the module's input. No per-head norm, no lambda_init, no (1 - lambda_init); then o_proj.
This is `ops.diff_attention` with shared keys (G = 1), dv = d and a per-token lambda [B, T, h].

Kernels are unilm's weights transposed and reshaped (nothing permuted): q (D, h, 2, d) = q_proj rows
(query head 2j + g = pair j, member g), k and v (D, Hkv, d), o (h, d, D), lambda (D, h).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.attention.base import AttentionModule
from diffjax.model.layers import normal_param
from diffjax.model.rope import apply_rope
from diffjax.sharding import constrain


class DiffAttentionV2(AttentionModule):
    """Multi-head differential attention V2 (module docstring). Depth-independent (`depth` is accepted and
    unused): no layer constants."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        std, pdt = config.init_std, config.param_dtype
        self.config = config
        self.q_kernel = normal_param(rngs, (D, H, 2, d), std, pdt, ("embed", "heads", None, "head_dim"))
        self.k_kernel = normal_param(rngs, (D, K, d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.v_kernel = normal_param(rngs, (D, K, d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = normal_param(rngs, (H, d, D), std, pdt, ("heads", "head_dim", "embed"))
        self.lambda_kernel = normal_param(rngs, (D, H), std, pdt, ("embed", "heads"))

    def project(self, x_BTD, rope_cos_sin):
        """(q [B, T, H, 2, d], k [B, S, Hkv, 1, d], v [B, S, Hkv, d]): rotated q and k (the two maps share keys)."""
        dtype, (cos, sin) = x_BTD.dtype, rope_cos_sin
        q_BTH2d = jnp.einsum("btD,DhGd->bthGd", x_BTD, self.q_kernel[...].astype(dtype))
        k_BSKd = jnp.einsum("bsD,Dkd->bskd", x_BTD, self.k_kernel[...].astype(dtype))
        v_BSKd = jnp.einsum("bsD,Dkd->bskd", x_BTD, self.v_kernel[...].astype(dtype))
        q_BTH2d = constrain(q_BTH2d, ("batch", "length", "act_heads", None, None))
        k_BSKd = constrain(k_BSKd, ("batch", "length", "act_kv_heads", None))
        v_BSKd = constrain(v_BSKd, ("batch", "length", "act_kv_heads", None))
        q_BTH2d = apply_rope(q_BTH2d, cos, sin, self.config.rope_style)
        k_BSK1d = apply_rope(k_BSKd, cos, sin, self.config.rope_style)[:, :, :, None]
        return q_BTH2d, k_BSK1d, v_BSKd

    def op_arguments(self, x_BTD, constants) -> tuple:
        """(lambda [B, T, H],) in the activation dtype: unilm's lambda_proj output, then the sigmoid."""
        lam_BTH = jax.nn.sigmoid(jnp.einsum("btD,Dh->bth", x_BTD, self.lambda_kernel[...].astype(x_BTD.dtype)))
        return (constrain(lam_BTH, ("batch", "length", "act_heads")),)

    def output(self, o_BTHd, constants):
        return self._out_projection(o_BTHd, o_BTHd.dtype)
