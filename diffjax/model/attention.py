"""Differential attention (V1, unilm semantics) and the baseline multi-head / grouped-query attention.

Kernels are stored in the canonical layout with the head structure in the shapes:
q (D, H, 2, d) and k (D, Hkv, 2, d) are unilm's interleaved q_proj / k_proj rows (head, group, channel),
v (D, Hkv, 2d), o (H, 2d, D). A unilm state_dict therefore loads by transpose and reshape alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from diffjax import ops
from diffjax.config import ModelConfig
from diffjax.model.layers import normal_param, ones_param, rms_normalize
from diffjax.model.rope import apply_rope
from diffjax.sharding import constrain

BTD = ("batch", "length", "act_embed")
# checkpoint_name()s that remat="attention" keeps (transformer.REMAT_POLICIES): q, k, v as the attention op
# takes them (after RoPE) and its output. The Pallas kernels' own residuals (lse; DIFF's fp32 second map)
# are not named, so under any remat policy the kernel's forward runs again in the backward pass.
SAVED_BY_ATTENTION_POLICY = ("attention_qkv", "attention_out")


def _softmax_maps(q_BTNd, k_BSNd, segment_ids):
    """Causal softmax(q k^T / sqrt(d)) per head, float32 [B, N, T, S]; rows with no allowed key are 0."""
    T, S, d = q_BTNd.shape[1], k_BSNd.shape[1], q_BTNd.shape[-1]
    s_BNTS = jnp.einsum("btnd,bsnd->bnts", q_BTNd, k_BSNd, preferred_element_type=jnp.float32) * jnp.float32(d**-0.5)
    mask_B1TS = ops.attention_mask(T, S, causal=True, segment_ids=segment_ids)[:, None]
    p_BNTS = jax.nn.softmax(jnp.where(mask_B1TS, s_BNTS, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.where(jnp.any(mask_B1TS, axis=-1, keepdims=True), p_BNTS, 0.0)


def attend(op, q, k, v, *op_args, segment_ids, impl, cache=None):
    """`op(q, k, v, *op_args)` causal, on an attention module's projected (and rotated) q, k, v: what every
    attention kind shares. Returns (output, cache): with a KVCache (generation), k and v are stored and the
    op attends over the cache (kv_cache.py). q, k, v and the output carry the names remat="attention" keeps.
    """
    q, k, v = (checkpoint_name(x, "attention_qkv") for x in (q, k, v))
    kwargs = dict(causal=True, segment_ids=segment_ids, impl=impl)
    if cache is not None:
        cache, k, v, kwargs = cache.update(k, v, kwargs)
    return checkpoint_name(op(q, k, v, *op_args, **kwargs), "attention_out"), cache


def depth_constants(lambda_inits, dtype) -> dict:
    """The depth-dependent constants of differential attention, as arrays (scalars for one layer, [L] for a
    stack): lambda_init in the activation dtype and the output scale (1 - lambda_init) in float32, each
    rounded once from the float64 value (the roundings PyTorch applies to Python floats, see lambda_full)."""
    lambda_inits = np.asarray(lambda_inits, np.float64)
    return {"lambda_init": jnp.asarray(lambda_inits, dtype), "out_scale": jnp.asarray(1.0 - lambda_inits, jnp.float32)}


class DiffAttention(nnx.Module):
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
        self.v_kernel = normal_param(rngs, (D, K, 2 * d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = normal_param(rngs, (H, 2 * d, D), std, pdt, ("heads", "head_dim", "embed"))
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, normal_param(rngs, (d,), config.lambda_std, pdt, ("head_dim",)))
        self.subln_scale = ones_param((2 * d,), pdt, ("head_dim",))

    def layer_constants(self, dtype) -> dict:
        if self.lambda_init is None:
            raise ValueError("this DiffAttention is a layer of a stack (built without a depth): pass its depth constants")
        return depth_constants(self.lambda_init, dtype)

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
        q_BTH2d = jnp.einsum("btD,DhGd->bthGd", x_BTD, self.q_kernel[...].astype(dtype))
        k_BSK2d = jnp.einsum("bsD,DkGd->bskGd", x_BTD, self.k_kernel[...].astype(dtype))
        v_BSKv = jnp.einsum("bsD,Dkv->bskv", x_BTD, self.v_kernel[...].astype(dtype))
        q_BTH2d = constrain(q_BTH2d, ("batch", "length", "act_heads", None, None))
        k_BSK2d = constrain(k_BSK2d, ("batch", "length", "act_kv_heads", None, None))
        v_BSKv = constrain(v_BSKv, ("batch", "length", "act_kv_heads", None))
        return apply_rope(q_BTH2d, cos, sin, self.config.rope_style), apply_rope(k_BSK2d, cos, sin, self.config.rope_style), v_BSKv

    def attention_maps(self, x_BTD, rope_cos_sin, segment_ids=None):
        """The two softmax maps (A1, A2) this layer computes on its (normalized) input x, each float32
        [B, H, T, S] (GQA's kv heads repeated per query head): the attention output, before the per-head
        RMSNorm, is (A1 - lambda_full A2) @ v. For plots and analysis; the layer never materialises them.
        """
        q_BTH2d, k_BSK2d, _ = self.project(x_BTD, rope_cos_sin)
        k_BSH2d = jnp.repeat(k_BSK2d, self.config.num_query_groups, axis=2)
        return tuple(_softmax_maps(q_BTH2d[..., m, :], k_BSH2d[..., m, :], segment_ids) for m in (0, 1))

    def __call__(self, x_BTD, rope_cos_sin, segment_ids=None, constants=None, cache=None):
        """The attention output [B, T, D]; with a KVCache (generation), (output, updated cache)."""
        constants = constants or self.layer_constants(x_BTD.dtype)
        lam = self.lambda_full(x_BTD.dtype, constants["lambda_init"])
        o_BTHv, cache = attend(ops.diff_attention, *self.project(x_BTD, rope_cos_sin), lam,
                               segment_ids=segment_ids, impl=self.config.attention_impl, cache=cache)
        out_BTD = self.output(o_BTHv, constants)
        return out_BTD if cache is None else (out_BTD, cache)

    def output(self, o_BTHv, constants):
        """Per-head RMSNorm over 2d (one scale shared by all heads), the fixed (1 - lambda_init), out projection."""
        dtype = o_BTHv.dtype
        o_BTHv = rms_normalize(o_BTHv, self.config.norm_eps) * self.subln_scale[...].astype(dtype)
        # PyTorch multiplies a bf16 tensor by a Python float in float32 without rounding the scalar to
        # bf16 first (one rounding at the end); rounding (1 - lambda_init) to bf16 would bias every output
        # (0.8 -> 0.80078 at depth 0). Exact no-op in float32.
        o_BTHv = (o_BTHv.astype(jnp.float32) * constants["out_scale"]).astype(dtype)
        o_BTHv = constrain(o_BTHv, ("batch", "length", "act_heads", None))
        return constrain(jnp.einsum("bthv,hvD->btD", o_BTHv, self.o_kernel[...].astype(dtype)), BTD)


class StandardAttention(nnx.Module):
    """Baseline causal multi-head attention with GQA (query head n uses kv head n // n_rep)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        D, N, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        std, pdt = config.init_std, config.param_dtype
        self.config = config
        self.q_kernel = normal_param(rngs, (D, N, d), std, pdt, ("embed", "heads", "head_dim"))
        self.k_kernel = normal_param(rngs, (D, K, d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.v_kernel = normal_param(rngs, (D, K, d), std, pdt, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = normal_param(rngs, (N, d, D), std, pdt, ("heads", "head_dim", "embed"))

    def layer_constants(self, dtype) -> dict:
        return {}

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

    def attention_maps(self, x_BTD, rope_cos_sin, segment_ids=None):
        """The softmax map this layer computes on its (normalized) input x, float32 [B, N, T, S] (GQA's kv
        heads repeated per query head): the attention output is map @ v. For plots and analysis."""
        q_BTNd, k_BSKd, _ = self.project(x_BTD, rope_cos_sin)
        return _softmax_maps(q_BTNd, jnp.repeat(k_BSKd, self.config.num_query_groups, axis=2), segment_ids)

    def __call__(self, x_BTD, rope_cos_sin, segment_ids=None, constants=None, cache=None):
        """The attention output [B, T, D]; with a KVCache (generation), (output, updated cache)."""
        o_BTNd, cache = attend(ops.dot_product_attention, *self.project(x_BTD, rope_cos_sin),
                               segment_ids=segment_ids, impl=self.config.attention_impl, cache=cache)
        o_BTNd = constrain(o_BTNd, ("batch", "length", "act_heads", None))
        out_BTD = constrain(jnp.einsum("btnd,ndD->btD", o_BTNd, self.o_kernel[...].astype(x_BTD.dtype)), BTD)
        return out_BTD if cache is None else (out_BTD, cache)
