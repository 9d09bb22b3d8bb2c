"""Manifold-constrained hyper-connections (mHC, arXiv:2512.24880), as Motif 3 runs them (vLLM's MotifMHCLayer;
tests/motif3_reference.py's MotifMHC is the PyTorch statement this is checked against, tests/test_mhc.py).

The stream is E parallel copies of the residual [B, T, E, D] (E = residual_options.streams), the embedding's at the
start and their mean before the final norm. Around each sublayer, from the RMS-normed flattened streams x^ [B, T, E D]:
  h_pre  = sigmoid(clamp(a_pre  x^ W_pre  + b_pre))                     [E]     the sublayer reads sum_e h_pre[e] x_e
  h_post = (1 + h_post_alpha) sigmoid(clamp(a_post x^ W_post + b_post)) [E]
  h_res  = Sinkhorn(a_res x^ W_res + b_res)                            [E, E]  doubly stochastic
  x'_i   = sum_j h_res[i, j] x_j + h_post[i] y                                  y: the sublayer's output
The gates, the mix and the write are float32 (as vLLM computes them); the projections run in the compute dtype.

Parameters, one-to-one with the checkpoint's (layers.N.mhc_attn.* for attn_residual, mhc_ffn.* for mlp_residual):
  pre_kernel [E D, E]    = proj_pre.weight.T        pre_bias [E]     = bias_pre     pre_alpha  [] = alpha_pre[0]
  post_kernel [E D, E]   = proj_post.weight.T       post_bias [E]    = bias_post    post_alpha [] = alpha_post[0]
  res_kernel [E D, E E]  = proj_res.weight.T        res_bias [E, E]  = bias_res     res_alpha  [] = alpha_res[0]
  norm.scale [E D]       = rms_norm.weight
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.layers import RMSNorm, normal_param
from diffjax.model.residual import ResidualForm


def sinkhorn(logits, iterations: int, clamp: float, eps: float):
    """exp of the clamped logits [..., E, E], then `iterations` rounds of rows (sums over the last axis) then
    columns, each sum floored at eps: nearly doubly stochastic (exactly so in its columns)."""
    m = jnp.exp(jnp.clip(logits, -clamp, clamp))
    for _ in range(iterations):
        m = m / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), eps)
        m = m / jnp.maximum(jnp.sum(m, axis=-2, keepdims=True), eps)
    return m


def _param(value, dtype, axes) -> nnx.Param:
    return nnx.Param(jnp.asarray(value, dtype), logical_axes=axes)


class MHCResidual(ResidualForm):
    """One sublayer's hyper-connection (module docstring); init as vLLM's MotifMHCLayer._init_weights."""

    stream_axes = ("batch", "length", None, "act_embed")

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        options = self.options = config.residual_options
        E, D, pdt = options.streams, config.d_model, config.param_dtype
        self.norm = RMSNorm(E * D, options.norm_eps, pdt)
        # xavier_uniform over the merged [pre | post | res] projection, as vLLM draws it
        bound = math.sqrt(6 / (E * D + 2 * E + E * E))
        self.pre_kernel, self.post_kernel, self.res_kernel = (
            _param(jax.random.uniform(rngs.params(), (E * D, width), jnp.float32, -bound, bound), pdt, ("embed", None))
            for width in (E, E, E * E))
        if options.identity_init:  # h_pre 1/E, h_post 1/2 (times the coefficient), h_res ~ the identity
            self.pre_alpha, self.post_alpha, self.res_alpha = (_param(0.0, pdt, ()) for _ in range(3))
            self.pre_bias = _param(jnp.full((E,), math.log(1 / (E - 1)) if E > 1 else 0.0), pdt, (None,))
            self.res_bias = _param(jnp.where(jnp.eye(E, dtype=bool), 0.0, -10.0), pdt, (None, None))
        else:
            self.pre_alpha, self.post_alpha, self.res_alpha = (normal_param(rngs, (), 0.1, pdt, ()) for _ in range(3))
            self.pre_bias = _param(jnp.zeros((E,)), pdt, (None,))
            self.res_bias = normal_param(rngs, (E, E), 0.1, pdt, (None, None))
        self.post_bias = _param(jnp.zeros((E,)), pdt, (None,))

    @classmethod
    def expand(cls, config: ModelConfig, x_BTD):
        B, T, D = x_BTD.shape
        return jnp.broadcast_to(x_BTD[:, :, None], (B, T, config.residual_options.streams, D))

    @classmethod
    def collapse(cls, config: ModelConfig, stream_BTED):
        return jnp.mean(stream_BTED, axis=2)

    def gates(self, stream_BTED):
        """(h_pre [B, T, E], h_post [B, T, E], h_res [B, T, E, E]), float32."""
        B, T, E, D = stream_BTED.shape
        options, dtype = self.options, stream_BTED.dtype
        normed_BTF = self.norm(stream_BTED.reshape(B, T, E * D))

        def logits(kernel, alpha, bias):
            projected = (normed_BTF @ kernel[...].astype(dtype)).astype(jnp.float32)
            return alpha[...].astype(jnp.float32) * projected + bias[...].astype(jnp.float32).reshape(-1)

        def gate(kernel, alpha, bias):
            return jax.nn.sigmoid(jnp.clip(logits(kernel, alpha, bias), -options.gate_clamp, options.gate_clamp))

        h_pre_BTE = gate(self.pre_kernel, self.pre_alpha, self.pre_bias)
        h_post_BTE = (1 + options.h_post_alpha) * gate(self.post_kernel, self.post_alpha, self.post_bias)
        res_BTEE = logits(self.res_kernel, self.res_alpha, self.res_bias).reshape(B, T, E, E)
        h_res_BTEE = sinkhorn(res_BTEE, options.sinkhorn_iters, options.sinkhorn_clamp, options.sinkhorn_eps)
        return h_pre_BTE, h_post_BTE, h_res_BTEE

    def read(self, stream_BTED):
        h_pre_BTE, h_post_BTE, h_res_BTEE = self.gates(stream_BTED)
        x_BTD = jnp.sum(stream_BTED * h_pre_BTE[..., None], axis=2).astype(stream_BTED.dtype)
        return x_BTD, (h_post_BTE, h_res_BTEE)

    def write(self, stream_BTED, y_BTD, carry):
        h_post_BTE, h_res_BTEE = carry
        mixed_BTED = jnp.einsum("btij,btjd->btid", h_res_BTEE, stream_BTED.astype(jnp.float32),
                                precision=jax.lax.Precision.HIGHEST)
        written_BTED = mixed_BTED + h_post_BTE[..., None] * y_BTD.astype(jnp.float32)[:, :, None]
        return written_BTED.astype(stream_BTED.dtype)
