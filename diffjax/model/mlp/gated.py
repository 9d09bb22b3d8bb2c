"""The gated MLP (mlp_kinds row "gated"): Llama's, DiffLlama's and Motif's."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.layers import ACTIVATIONS, normal_param, polynorm
from diffjax.model.mlp.base import MLPModule
from diffjax.sharding import constrain


class GatedMLP(MLPModule):
    """down(act(x gate) * (x up)): SwiGLU with the default silu; with "polynorm" the activation has parameters
    (polynorm_weight [3], initially 1/3 each, and polynorm_bias [1], initially 0; Motif's act_fn.weight / .bias)."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        D, F, std, pdt = config.d_model, config.mlp_dim, config.init_std, config.param_dtype
        self.activation = config.activation
        self.gate_kernel = normal_param(rngs, (D, F), std, pdt, ("embed", "mlp"))
        self.up_kernel = normal_param(rngs, (D, F), std, pdt, ("embed", "mlp"))
        self.down_kernel = normal_param(rngs, (F, D), std, pdt, ("mlp", "embed"))
        if config.activation == "polynorm":
            self.polynorm_weight = nnx.Param(jnp.full((3,), 1 / 3, pdt), logical_axes=(None,))
            self.polynorm_bias = nnx.Param(jnp.zeros((1,), pdt), logical_axes=(None,))

    def activate(self, gate_BTF):
        if self.activation == "polynorm":
            return polynorm(gate_BTF, self.polynorm_weight[...], self.polynorm_bias[...])
        return ACTIVATIONS[self.activation](gate_BTF)

    def __call__(self, x_BTD):
        dtype = x_BTD.dtype
        # Gate and up as one matmul against the kernels stacked at use ([D, 2, F]; the stacked axis is never
        # split, so a tensor-parallel F stays where it is): the backward then forms both halves' gradient in one
        # pass over the activations and runs one matmul per gradient instead of two (on an H100, 0.7 GB less
        # traffic per layer at the paper's 1.4B: benchmarks/results/step_tail_h100.md).
        kernel_DKF = jnp.stack([self.gate_kernel[...], self.up_kernel[...]], axis=1).astype(dtype)
        gate_up_BTKF = jnp.einsum("btd,dkf->btkf", x_BTD, kernel_DKF)
        gate_BTF, up_BTF = gate_up_BTKF[:, :, 0], gate_up_BTKF[:, :, 1]
        hidden_BTF = constrain(self.activate(gate_BTF) * up_BTF, ("batch", "length", "act_mlp"))
        return constrain(hidden_BTF @ self.down_kernel[...].astype(dtype), ("batch", "length", "act_embed"))
