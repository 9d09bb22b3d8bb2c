"""Motif 3's PolyNorm MLP (mlp_kinds row "polynorm"): its dense layers' MLP and its MoE's shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.mlp_kinds import PolyNormOptions
from diffjax.model.layers import POLYNORM_EPS, normal_param
from diffjax.model.mlp.base import MLPModule
from diffjax.sharding import constrain


def poly_norm(x32, weight_3, bias_1):
    """w0 x^3/rms(x^3) + w1 x^2/rms(x^2) + w2 x/rms(x) + b over the last axis of float32 x; weight [..., 3] and bias
    [..., 1] broadcast against x's leading axes (one PolyNorm per routed expert: rows of their own coefficients)."""
    x2 = x32 * x32
    x3 = x2 * x32

    def normed(z):
        return z * jax.lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + POLYNORM_EPS)

    return weight_3[..., 0:1] * normed(x3) + weight_3[..., 1:2] * normed(x2) + weight_3[..., 2:3] * normed(x32) + bias_1


def coefficients(weight, sigmoid_weight: bool):
    """PolyNorm's coefficients in float32: the stored weights, through a sigmoid when sigmoid_weight."""
    weight = weight.astype(jnp.float32)
    return jax.nn.sigmoid(weight) if sigmoid_weight else weight


def clamp(x, bound: float | None):
    return x if bound is None else jnp.clip(x, -bound, bound)


class PolyNormMLP(MLPModule):
    """down(PolyNorm(clamp(x gate)) * clamp(x up) * output_scale): gate_kernel, up_kernel [D, F], down_kernel [F, D]
    (Motif 3's gate_proj, up_proj, down_proj transposed), polynorm_weight [3] and polynorm_bias [1] (act_fn.weight,
    act_fn.bias). F: mlp_dim (inner: the MoE's shared expert's width); options: the config's (or the shared
    expert's). ModelConfig.activation is not read: the activation is PolyNorm."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs, inner: int | None = None,
                 options: PolyNormOptions | None = None):
        D, F, std, pdt = config.d_model, inner or config.mlp_dim, config.init_std, config.param_dtype
        self.options = options or config.mlp_options
        self.gate_kernel = normal_param(rngs, (D, F), std, pdt, ("embed", "mlp"))
        self.up_kernel = normal_param(rngs, (D, F), std, pdt, ("embed", "mlp"))
        self.down_kernel = normal_param(rngs, (F, D), std, pdt, ("mlp", "embed"))
        self.polynorm_weight = nnx.Param(jnp.full((3,), 1 / 3, pdt), logical_axes=(None,))
        self.polynorm_bias = nnx.Param(jnp.zeros((1,), pdt), logical_axes=(None,))

    def __call__(self, x_BTD):
        dtype, o = x_BTD.dtype, self.options
        gate_BTF = clamp(x_BTD @ self.gate_kernel[...].astype(dtype), o.hidden_clamp)
        up_BTF = clamp(x_BTD @ self.up_kernel[...].astype(dtype), o.hidden_clamp)
        poly_BTF = poly_norm(gate_BTF.astype(jnp.float32), coefficients(self.polynorm_weight[...], o.sigmoid_weight),
                             self.polynorm_bias[...].astype(jnp.float32))
        hidden_BTF = constrain((poly_BTF * up_BTF.astype(jnp.float32)).astype(dtype) * o.output_scale,
                               ("batch", "length", "act_mlp"))
        return constrain(hidden_BTF @ self.down_kernel[...].astype(dtype), ("batch", "length", "act_embed"))
