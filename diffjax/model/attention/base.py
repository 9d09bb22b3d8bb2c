"""What every attention kind shares: the call into diffjax.ops (with the KV cache and the names remat keeps),
the explicit maps that the analyses read, and one masked softmax.

A kind's module subclasses AttentionModule and states only what differs:
  __init__(config, depth=None, *, rngs)  its parameters (depth: the layer's 0-based index, None in a stack)
  project(x, rope_cos_sin)      -> (q, k, v), rotated: q [B, T, H, M, d] and k [B, S, Hkv, G, d] for M = 2 maps
                                   (G = 2, or 1 when both maps share keys), or q [B, T, H, d], k [B, S, Hkv, d]
                                   for one map; v [B, S, Hkv, dv]
  op_arguments(x, constants)    -> () for one map; (lambda,) for two: a scalar or [B, T, H]
  output(o_BTHv, constants)     -> [B, T, D]: what follows the op (norms, scales, the out projection)
  depth_constants(config, depths, dtype) (classmethod) -> {name: [L] array}: per-layer constants that are not
                                   parameters (V1's lambda_init); {} by default
A "lambda_scale" constant (the trainer's lambda warm-up, TransformerLM.hidden_states) multiplies lambda for every
kind (lambdas()): 0 silences the second map, 1 is the kind's own formula, exactly.
The kind's row in diffjax.attention_kinds says how many maps it has (ops.diff_attention for 2,
ops.dot_product_attention for 1) and everything the rest of diffjax reads about it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from diffjax import attention_kinds, ops
from diffjax.config import ModelConfig
from diffjax.model.rope import WindowedRope, select_rope, softmax_scale_factor
from diffjax.ops.names import KERNEL_RESIDUALS_NAME, OUTPUT_NAME
from diffjax.sharding import constrain

BTD = ("batch", "length", "act_embed")
# checkpoint_name()s that remat="attention" keeps (transformer.REMAT_POLICIES): q, k, v as the attention op
# takes them (after RoPE, named here), its output and the single-map kernel's residuals (named by diffjax.ops:
# ops.names, which says why DIFF's are not kept), so that the twin's pallas_gpu backward runs no forward kernel.
SAVED_BY_ATTENTION_POLICY = ("attention_qkv", OUTPUT_NAME, KERNEL_RESIDUALS_NAME)


class ExplicitAttention(NamedTuple):
    """One layer's attention with its maps written out (float32 unless said otherwise); M = the kind's maps."""

    logits_MBHTS: jax.Array  # what each softmax sees: q k^T / sqrt(d) (after `transform_logits`)
    maps_MBHTS: jax.Array  # the softmax maps (kv heads repeated per query head)
    effective_BHTS: jax.Array  # the map applied to v: A1 - lambda A2 for two maps, A for one
    out_BTD: jax.Array  # the layer's output, as __call__ computes it, in the compute dtype


def masked_softmax(s, allowed):
    """Row softmax over the allowed keys in float32; rows with no allowed key are 0 (as the ops give)."""
    p = jax.nn.softmax(jnp.where(allowed, s, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.where(jnp.any(allowed, axis=-1, keepdims=True), p, 0.0)


def attend(op, q, k, v, *op_args, segment_ids, impl, cache=None, window=None, windowed=True, global_scale=None):
    """`op(q, k, v, *op_args)` causal. Returns (output, cache): with a KVCache (generation), k and v are stored
    and the op attends over the cache (kv_cache.py). q, k, v carry the name remat keeps (the op names its output).
    window: the layer's sliding window (None: the whole context); windowed: whether it applies, True or a traced
    bool (a layer of a scanned stack that mixes windowed and global layers: both calls compile, one runs).
    global_scale: the softmax scale of a layer attending the whole context (YaRN's factor; None: the op's d^-0.5);
    windowed layers keep the op's."""
    q, k, v = (checkpoint_name(x, "attention_qkv") for x in (q, k, v))
    kwargs = dict(causal=True, segment_ids=segment_ids, impl=impl, window=window)
    if cache is not None:
        cache, k, v, kwargs = cache.update(k, v, kwargs, windowed)

    def call(is_windowed):  # (a decode step's window is already in its mask: kwargs["window"] None)
        scale = None if is_windowed and window is not None else global_scale
        return op(q, k, v, *op_args, **{**kwargs, "window": kwargs["window"] if is_windowed else None, "scale": scale})

    if isinstance(windowed, bool):
        out = call(windowed)
    elif kwargs["window"] is None and global_scale is None:
        out = call(True)
    else:
        out = jax.lax.cond(windowed, lambda: call(True), lambda: call(False))
    return out, cache


class AttentionModule(nnx.Module):
    """The shared half of every attention kind (module docstring)."""

    config: ModelConfig

    @property
    def kind(self) -> attention_kinds.AttentionKind:
        return attention_kinds.get(self.config.attention)

    @classmethod
    def depth_constants(cls, config: ModelConfig, depths, dtype) -> dict:
        return {}

    def layer_constants(self, dtype) -> dict:
        return {}

    def op_arguments(self, x_BTD, constants) -> tuple:
        return ()

    def __call__(self, x_BTD, rope_cos_sin, segment_ids=None, constants=None):
        """The attention output [B, T, D]."""
        return self.call_with_cache(x_BTD, rope_cos_sin, segment_ids, constants, None)[0]

    def call_with_cache(self, x_BTD, rope_cos_sin, segment_ids, constants, cache):
        """(output [B, T, D], updated cache): the same computation, attending over and extending a KVCache
        (generation); cache None: (output, None)."""
        constants = self.layer_constants(x_BTD.dtype) if constants is None else constants
        q, k, v = self.project(x_BTD, self.layer_rope(rope_cos_sin, constants))
        o_BTHv, cache = attend(getattr(ops, self.kind.attention_op), q, k, v, *self.lambdas(x_BTD, constants),
                               segment_ids=segment_ids, impl=self.config.attention_impl, cache=cache,
                               window=self.config.attention_window, windowed=self.windowed(constants),
                               global_scale=self.global_scale(q.shape[-1]))
        return self.output(o_BTHv, constants), cache

    def layer_rope(self, rope, constants):
        """This layer's (cos, sin) from rope.layer_rope_tables' output (of a WindowedRope, the windowed or the global
        pair)."""
        return select_rope(rope, self.windowed(constants)) if isinstance(rope, WindowedRope) else rope

    def global_scale(self, qk_dim: int) -> float | None:
        """The softmax scale of a layer attending the whole context: d^-0.5 times YaRN's factor (rope_mscale); None
        when that factor is 1 (the op's own d^-0.5)."""
        factor = softmax_scale_factor(self.config)
        return None if factor == 1.0 else qk_dim ** -0.5 * factor

    def softmax_scale(self, qk_dim: int, constants):
        """This layer's softmax scale as a float32 (traced where the layer's window flag is)."""
        plain, global_scale = jnp.float32(qk_dim ** -0.5), self.global_scale(qk_dim)
        if global_scale is None:
            return plain
        if self.config.attention_window is None:
            return jnp.float32(global_scale)
        return jnp.where(self.windowed(constants), plain, jnp.float32(global_scale))

    def lambdas(self, x_BTD, constants) -> tuple:
        """op_arguments with lambda times constants["lambda_scale"] when there is one (a float32 scalar in [0, 1]:
        the lambda warm-up's forward input, diffjax.model.attention.warmup), in lambda's dtype."""
        arguments = self.op_arguments(x_BTD, constants)
        scale = constants.get("lambda_scale")
        if scale is None or not arguments:
            return arguments
        (lam,) = arguments
        return ((jnp.asarray(lam).astype(jnp.float32) * scale).astype(jnp.asarray(lam).dtype),)

    def windowed(self, constants):
        """Whether this layer's sliding window applies: True unless the config has global layers, then the layer's
        "global_attention" constant negated (TransformerLM.depth_constants; a standalone DecoderBlock adds its own)."""
        if not self.config.mixes_windows:
            return True
        if "global_attention" not in constants:
            raise ValueError("this layer's model mixes windowed and global layers (global_layers): pass the layer's "
                             "constants with its 'global_attention' flag (TransformerLM.depth_constants)")
        is_global = constants["global_attention"]
        return not is_global if isinstance(is_global, bool) else jnp.logical_not(is_global)

    def static_window(self, constants) -> int | None:
        """This layer's window as a Python value (constants with a concrete 'global_attention' flag)."""
        windowed = self.windowed(constants)
        return self.config.attention_window if bool(windowed) else None

    def explicit_maps(self, x_BTD, rope_cos_sin, allowed_BTS, constants=None, transform_logits=None) -> ExplicitAttention:
        """This layer on x with its maps made explicit, for plots and the analyses (the layer itself never
        materialises them). allowed_BTS: bool [B, T, S], key s visible to query t. transform_logits: applied to
        the logits [M, B, H, T, S] before the softmax (the analyses' quantization). out_BTD equals __call__'s
        output up to the op's summation order (exactly, against the XLA reference, in float32)."""
        constants = self.layer_constants(x_BTD.dtype) if constants is None else constants
        n_rep, M = self.config.num_query_groups, self.kind.maps
        q, k, v_BSKv = self.project(x_BTD, self.layer_rope(rope_cos_sin, constants))
        if M == 1:
            q, k = q[..., None, :], k[..., None, :]
        k_BSHMd = jnp.broadcast_to(jnp.repeat(k, n_rep, axis=2), k.shape[:2] + (q.shape[2], M, k.shape[-1]))
        s_MBHTS = jnp.einsum("bthmd,bshmd->mbhts", q, k_BSHMd, preferred_element_type=jnp.float32)
        s_MBHTS = s_MBHTS * self.softmax_scale(q.shape[-1], constants)
        if transform_logits is not None:
            s_MBHTS = transform_logits(s_MBHTS)
        p_MBHTS = masked_softmax(s_MBHTS, allowed_BTS[None, :, None])
        v_BSHv = jnp.repeat(v_BSKv, n_rep, axis=2)
        # Each map's P V as the XLA reference computes it: P rounded to v's dtype, float32 accumulation.
        o_MBTHv = jnp.einsum("mbhts,bshv->mbthv", p_MBHTS.astype(v_BSHv.dtype), v_BSHv,
                             preferred_element_type=jnp.float32).astype(v_BSHv.dtype)
        if M == 1:
            o_BTHv, effective_BHTS = o_MBTHv[0], p_MBHTS[0]
        else:
            (lam,) = self.lambdas(x_BTD, constants)  # a scalar or [B, T, H]
            lam_o = lam if jnp.ndim(lam) == 0 else lam[..., None]
            lam_p = lam if jnp.ndim(lam) == 0 else jnp.moveaxis(lam, 1, 2)[..., None]
            o_BTHv = o_MBTHv[0] - jnp.asarray(lam_o).astype(o_MBTHv.dtype) * o_MBTHv[1]
            effective_BHTS = p_MBHTS[0] - jnp.asarray(lam_p).astype(jnp.float32) * p_MBHTS[1]
        return ExplicitAttention(s_MBHTS, p_MBHTS, effective_BHTS, self.output(o_BTHv, constants))

    def attention_maps(self, x_BTD, rope_cos_sin, segment_ids=None, constants=None):
        """The softmax map(s) this layer computes on its (normalized) input x, float32 [B, H, T, S] each (kv heads
        repeated per query head): a tuple (A1, A2) for two maps, one array for one. For plots."""
        T = x_BTD.shape[1]
        constants = self.layer_constants(x_BTD.dtype) if constants is None else constants
        mask = ops.attention_mask(T, T, causal=True, segment_ids=segment_ids, window=self.static_window(constants))
        allowed_BTS = jnp.broadcast_to(mask, (x_BTD.shape[0], T, T))
        maps = self.explicit_maps(x_BTD, rope_cos_sin, allowed_BTS, constants).maps_MBHTS
        return tuple(maps) if self.kind.maps == 2 else maps[0]

    def _out_projection(self, o_BTHv, dtype):
        o_BTHv = constrain(o_BTHv, ("batch", "length", "act_heads", None))
        return constrain(jnp.einsum("bthv,hvD->btD", o_BTHv, self.o_kernel[...].astype(dtype)), BTD)
