"""Differential attention V1 (unilm semantics; HF DiffLlama).

Kernels are stored in the canonical layout with the head structure in the shapes:
q (D, H, 2, d) and k (D, Hkv, 2, d) are unilm's interleaved q_proj / k_proj rows (head, group, channel),
v (D, Hkv, 2d), o (H, 2d, D). A unilm state_dict therefore loads by transpose and reshape alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.attention.base import AttentionModule
from diffjax.model.attention.warmup import LambdaWarmup
from diffjax.model.layers import normal_param, ones_param, rms_normalize
from diffjax.model.rope import apply_rope
from diffjax.sharding import constrain


def depth_constants(lambda_inits, dtype) -> dict:
    """The depth-dependent constants of differential attention, as arrays (scalars for one layer, [L] for a
    stack): lambda_init in the activation dtype and the output scale (1 - lambda_init) in float32, each
    rounded once from the float64 value (the roundings PyTorch applies to Python floats, see lambda_full)."""
    lambda_inits = np.asarray(lambda_inits, np.float64)
    return {"lambda_init": jnp.asarray(lambda_inits, dtype), "out_scale": jnp.asarray(1.0 - lambda_inits, jnp.float32)}


class DiffAttention(AttentionModule):
    """Multi-head differential attention for the layer at 0-based `depth`.

    depth None: a layer of a stack (TransformerLM.blocks), whose caller passes each layer's depth constants.
    """

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        std, pdt = config.init_std, config.param_dtype
        self.config = config
        self.lambda_init = None if depth is None else config.lambda_init_at(depth)
        self.q_kernel = normal_param(rngs, (D, H, 2, d), std, pdt, ("embed", "heads", None, "head_dim"))
        self.k_kernel = normal_param(rngs, (D, K, 2, d), std, pdt, ("embed", "kv_heads", None, "head_dim"))
        self.init_values_and_lambda(config, rngs)

    def init_values_and_lambda(self, config: ModelConfig, rngs: nnx.Rngs):
        """The parameters V1's variants share, drawn after their query and key kernels: v (D, Hkv, 2d), o (H, 2d, D),
        the four lambda vectors and the subln scale (when the config has a subln)."""
        D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        std, pdt = config.init_std, config.param_dtype
        self.v_kernel = normal_param(rngs, (D, K, 2 * d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = normal_param(rngs, (H, 2 * d, D), std, pdt, ("heads", "head_dim", "embed"))
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, normal_param(rngs, (d,), config.lambda_std, pdt, ("head_dim",)))
        if config.subln:
            self.subln_scale = ones_param((2 * d,), pdt, ("head_dim",))

    @classmethod
    def depth_constants(cls, config: ModelConfig, depths, dtype) -> dict:
        return depth_constants([config.lambda_init_at(depth) for depth in depths], dtype)

    def layer_constants(self, dtype) -> dict:
        if self.lambda_init is None:
            raise ValueError("this DiffAttention is a layer of a stack (built without a depth): pass its depth constants")
        return depth_constants(self.lambda_init, dtype)

    def op_arguments(self, x_BTD, constants) -> tuple:
        return (self.lambda_full(x_BTD.dtype, constants["lambda_init"]),)

    def lambda_full(self, dtype, lambda_init=None):
        """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init; [L] for stacked params ([L, d] vectors).

        Products in the parameter dtype, sums and exp in float32, then the activation dtype
        (the order of HF DiffLlama; identical to unilm for float32 parameters). Adding lambda_init
        rounds it to the activation dtype first, as PyTorch does for a bf16 tensor plus a Python
        float on CPU (bit-identical to unilm in bf16, tests/test_unilm_attention.py).
        """
        dot1 = jnp.sum(self.lambda_q1[...] * self.lambda_k1[...], axis=-1, dtype=jnp.float32)
        dot2 = jnp.sum(self.lambda_q2[...] * self.lambda_k2[...], axis=-1, dtype=jnp.float32)
        lambda_1, lambda_2 = jnp.exp(dot1).astype(dtype), jnp.exp(dot2).astype(dtype)
        lambda_init = self.layer_constants(dtype)["lambda_init"] if lambda_init is None else lambda_init
        return lambda_1 - lambda_2 + lambda_init

    def project(self, x_BTD, rope_cos_sin):
        """(q [B, T, H, 2, d], k [B, S, Hkv, 2, d], v [B, S, Hkv, 2d]) with q and k rotated."""
        dtype, (cos, sin) = x_BTD.dtype, rope_cos_sin
        q_BTH2d = constrain(self.queries(x_BTD), ("batch", "length", "act_heads", None, None))
        k_BSK2d = jnp.einsum("bsD,DkGd->bskGd", x_BTD, self.k_kernel[...].astype(dtype))
        v_BSKv = jnp.einsum("bsD,Dkv->bskv", x_BTD, self.v_kernel[...].astype(dtype))
        k_BSK2d = constrain(k_BSK2d, ("batch", "length", "act_kv_heads", None, None))
        v_BSKv = constrain(v_BSKv, ("batch", "length", "act_kv_heads", None))
        return apply_rope(q_BTH2d, cos, sin, self.config.rope_style), apply_rope(k_BSK2d, cos, sin, self.config.rope_style), v_BSKv

    def queries(self, x_BTD):
        """Both maps' queries q [B, T, H, 2, d], before RoPE."""
        return jnp.einsum("btD,DhGd->bthGd", x_BTD, self.q_kernel[...].astype(x_BTD.dtype))

    def output(self, o_BTHv, constants):
        """Per-head RMSNorm over 2d (one scale shared by all heads; none without subln), the fixed (1 - lambda_init),
        out projection."""
        dtype = o_BTHv.dtype
        if self.config.subln:
            o_BTHv = rms_normalize(o_BTHv, self.config.subln_norm_eps) * self.subln_scale[...].astype(dtype)
        # PyTorch multiplies a bf16 tensor by a Python float in float32 without rounding the scalar to
        # bf16 first (one rounding at the end); rounding (1 - lambda_init) to bf16 would bias every output
        # (0.8 -> 0.80078 at depth 0). Exact no-op in float32.
        o_BTHv = (o_BTHv.astype(jnp.float32) * constants["out_scale"]).astype(dtype)
        return self._out_projection(o_BTHv, dtype)


class LambdaMetrics(LambdaWarmup):
    """V1's training side (its rows' facet, with Shared DIFF's and GDA's): the lambda warm-up (LambdaWarmup), and
    lambda per layer in each step's metrics ("lambda" [L + MTP depths], float32, from the step's new params:
    TransformerLM.layer_lambdas) and in metrics.jsonl (lambda/layer_i; the MTP depths' layers numbered on from the
    model's)."""

    def metrics(self, outputs, model):
        return {"lambda": model().layer_lambdas()}

    def values(self, metrics):
        return {f"lambda/layer_{i}": float(x) for i, x in enumerate(np.asarray(metrics["lambda"]))}
