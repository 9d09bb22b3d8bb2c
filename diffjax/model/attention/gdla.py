"""Grouped Differential Latent Attention (GDLA; Motif 3, Motif Technologies 2026; tests/motif3_reference.py's
MotifGDLAttention is the statement it is checked against).

MLA-style low-rank projections feeding grouped differential heads:
  q:  x -> latent (q_lora_rank) -> RMSNorm -> H heads of d = qk_nope + qk_rope channels (RoPE on the last qk_rope)
  kv: x -> latent (kv_lora_rank) and one RoPE key of qk_rope channels shared by every head; RMSNorm on the latent
      -> per kv head the key's qk_nope channels and a value of v_head_dim (dv, narrower than d)
  ops.dot_product_attention over the H query heads (GQA: query head h reads kv head h // (H / Hkv)): scores d
  wide, values dv wide, one map per head. The heads form N = num_noise_heads groups of g = H / N consecutive heads
  whose last is the noise head: each of the S = H - N signal heads gives o_s - sigmoid(x W_lambda)_s o_noise(s)
  (its second map is its group's noise head's: computed once, not once per signal head), times
  sigmoid(q_latent W_gate) element-wise when output_gate, then the out projection.
Windowed layers and YaRN: AttentionModule (the layer's RoPE table, YaRN's softmax factor on global layers).

Generation (call_with_cache) caches what a token contributes before the up-projection, as the reference's MLA does:
the normed kv latent (rkv) and the rotated shared RoPE key (dr), rkv + dr values per token and layer instead of
Hkv (d + dv) (Motif 3: 576 against 5,120; benchmarks/results/cache_sizes.md), through the generic KVCache as one kv
head (the key buffer holds the RoPE key, the value buffer the latent; windowed layers keep rings). The prefill
attends the prompt's expanded heads (a long T, where expanding once per token is cheapest) and stores the latents.
A decode step uses the absorbed form (absorbed_attention): W_uk folded into the query (each head's query in latent
space), W_uv applied to each head's output. Expanding the cache instead would read the latents and write and read
Hkv (d + dv) values per slot every step (the expanded cache's traffic, the very bytes the latent saves) plus
2 S rkv Hkv (dn + dv) FLOPs; the absorbed step reads rkv + dr per slot and computes 2 H S (2 rkv + dr) FLOPs for the
scores and P V (H (d + dv) per slot expanded: 3.4x the attention FLOPs at Motif 3's sizes, for 8.9x fewer bytes),
plus 2 H rkv (dn + dv) per token independent of S. A small-batch decode step is bound by memory traffic, so the
absorbed form is the faster one; it is the same arithmetic in another order (fp32 logits within 1e-5).

Kernels, diffjax's layout -> the checkpoint's names and shapes (transpose and reshape only):
  q_down_kernel  (D, rq)             wq_a.weight [rq, D]
  q_norm_scale   (rq,)               q_norm.weight
  q_up_kernel    (rq, H, d)          wq_b.weight [H d, rq]           (per head: qk_nope channels, then qk_rope)
  gate_kernel    (rq, S, dv)         wq_b_gate.weight [S dv, rq]     (output_gate only)
  kv_down_kernel (D, rkv + dr)       wkv_a.weight [rkv + dr, D]      (the latent, then the shared RoPE key)
  kv_norm_scale  (rkv,)              kv_norm.weight
  kv_up_kernel   (rkv, Hkv, dn + dv) wkv_b.weight [Hkv (dn + dv), rkv] (per kv head: k_nope, then v)
  lambda_kernel  (D, S)              lambda_proj.weight [S, D]
  o_kernel       (S, dv, D)          wo.weight [D, S dv]
Signal head s is head (s // (g - 1)) g + s % (g - 1). The RoPE channels follow config.rope_style (the checkpoint's
are "rotate_half").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import ops
from diffjax.config import ModelConfig
from diffjax.model.attention.base import AttentionModule, ExplicitAttention, attend, masked_softmax
from diffjax.model.layers import normal_param, ones_param, rms_normalize
from diffjax.model.rope import apply_rope
from diffjax.sharding import constrain


class GroupedDiffLatentAttention(AttentionModule):
    """GDLA; depth-independent (`depth` is accepted and unused: a layer's window comes with its constants)."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        o = config.attention_options
        D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        rq, rkv, dv, S = o.q_lora_rank, o.kv_lora_rank, o.v_head_dim, H - o.num_noise_heads
        std, pdt = config.init_std, config.param_dtype
        self.config = config
        self.q_down_kernel = normal_param(rngs, (D, rq), std, pdt, ("embed", "rank"))
        self.q_norm_scale = ones_param((rq,), pdt, ("rank",))
        self.q_up_kernel = normal_param(rngs, (rq, H, d), std, pdt, ("rank", "heads", "head_dim"))
        if o.output_gate:
            self.gate_kernel = normal_param(rngs, (rq, S, dv), std, pdt, ("rank", "heads", "head_dim"))
        self.kv_down_kernel = normal_param(rngs, (D, rkv + o.qk_rope_head_dim), std, pdt, ("embed", "rank"))
        self.kv_norm_scale = ones_param((rkv,), pdt, ("rank",))
        self.kv_up_kernel = normal_param(rngs, (rkv, K, o.qk_nope_head_dim + dv), std, pdt,
                                         ("rank", "kv_heads", "head_dim"))
        self.lambda_kernel = normal_param(rngs, (D, S), std, pdt, ("embed", "heads"))
        self.o_kernel = normal_param(rngs, (S, dv, D), std, pdt, ("heads", "head_dim", "embed"))

    def q_latent(self, x_BTD):
        """The normed q latent [B, T, rq] (the queries' and the output gate's input)."""
        latent_BTr = jnp.einsum("btD,Dr->btr", x_BTD, self.q_down_kernel[...].astype(x_BTD.dtype))
        return rms_normalize(latent_BTr, self.config.norm_eps) * self.q_norm_scale[...].astype(x_BTD.dtype)

    def project(self, x_BTD, rope_cos_sin):
        """(q [B, T, H, d], k [B, S, Hkv, d], v [B, S, Hkv, dv]) with the qk_rope channels of q and k rotated."""
        latent_BTr, k_rope_BTr = self.kv_latent(x_BTD, rope_cos_sin)
        return (self.queries(x_BTD, rope_cos_sin),) + self.expanded_kv(latent_BTr, k_rope_BTr)

    def queries(self, x_BTD, rope_cos_sin):
        """q [B, T, H, d]: per head qk_nope channels, then qk_rope rotated ones."""
        dtype, (cos, sin), dn = x_BTD.dtype, rope_cos_sin, self.config.attention_options.qk_nope_head_dim
        q_BTHd = jnp.einsum("btr,rhd->bthd", self.q_latent(x_BTD), self.q_up_kernel[...].astype(dtype))
        q_BTHd = jnp.concatenate([q_BTHd[..., :dn], apply_rope(q_BTHd[..., dn:], cos, sin, self.config.rope_style)], -1)
        return constrain(q_BTHd, ("batch", "length", "act_heads", None))

    def kv_latent(self, x_BTD, rope_cos_sin):
        """What a token contributes to every head's keys and values: (the normed kv latent [B, T, rkv], the shared RoPE
        key [B, T, dr], rotated). The KV cache stores these two (rkv + dr per token and layer)."""
        dtype, (cos, sin), rkv = x_BTD.dtype, rope_cos_sin, self.config.attention_options.kv_lora_rank
        kv_BTc = jnp.einsum("btD,Dc->btc", x_BTD, self.kv_down_kernel[...].astype(dtype))
        latent_BTr = rms_normalize(kv_BTc[..., :rkv], self.config.norm_eps) * self.kv_norm_scale[...].astype(dtype)
        return latent_BTr, apply_rope(kv_BTc[:, :, None, rkv:], cos, sin, self.config.rope_style)[:, :, 0]

    def expanded_kv(self, latent_BTr, k_rope_BTr):
        """(k [B, T, Hkv, d], v [B, T, Hkv, dv]): the latent through the kv up-projection, the RoPE key beside
        every kv head's qk_nope channels."""
        dn = self.config.attention_options.qk_nope_head_dim
        kv_BTKc = jnp.einsum("btr,rkc->btkc", latent_BTr, self.kv_up_kernel[...].astype(latent_BTr.dtype))
        B, T, K, _ = kv_BTKc.shape
        k_rope_BTKr = jnp.broadcast_to(k_rope_BTr[:, :, None], (B, T, K, k_rope_BTr.shape[-1]))
        k_BTKd = jnp.concatenate([kv_BTKc[..., :dn], k_rope_BTKr], axis=-1)
        return (constrain(k_BTKd, ("batch", "length", "act_kv_heads", None)),
                constrain(kv_BTKc[..., dn:], ("batch", "length", "act_kv_heads", None)))

    def op_arguments(self, x_BTD, constants) -> tuple:
        """(lambda [B, T, S],) = sigmoid(x W_lambda) in float32, then the activation dtype."""
        logits_BTS = jnp.einsum("btD,Ds->bts", x_BTD, self.lambda_kernel[...].astype(x_BTD.dtype))
        return (constrain(jax.nn.sigmoid(logits_BTS.astype(jnp.float32)).astype(x_BTD.dtype),
                          ("batch", "length", "act_heads")),)

    def call_with_cache(self, x_BTD, rope_cos_sin, segment_ids, constants, cache):
        """As AttentionModule's, with a latent KV cache: the prefill attends expanded heads and stores each token's
        kv latent and RoPE key; a decode step attends the stored latents in the absorbed form (absorbed_attention)."""
        constants = {} if constants is None else constants
        rope = self.layer_rope(rope_cos_sin, constants)
        q_BTHd, (latent_BTr, k_rope_BTr) = self.queries(x_BTD, rope), self.kv_latent(x_BTD, rope)
        window, windowed = self.config.attention_window, self.windowed(constants)
        if cache is not None and cache.k is not None:  # decode: one kv "head", RoPE key as keys, latent as values
            cache, k_rope_BS1r, latent_BS1r, op_kwargs = cache.update(
                k_rope_BTr[:, :, None], latent_BTr[:, :, None], {"window": window}, windowed)
            visible = op_kwargs["segment_ids"][1] > 0  # [B, S], or [B, T, S] for several tokens (kv_cache.py)
            visible_BTS = visible if visible.ndim == 3 else visible[:, None, :]
            o_BTHv = self.absorbed_attention(q_BTHd, latent_BS1r[:, :, 0], k_rope_BS1r[:, :, 0], visible_BTS,
                                             self.softmax_scale(q_BTHd.shape[-1], constants))
        else:
            if cache is not None:  # prefill: store the latents, attend the prompt's expanded heads
                cache = cache.update(k_rope_BTr[:, :, None], latent_BTr[:, :, None], {}, windowed)[0]
            o_BTHv, _ = attend(ops.dot_product_attention, q_BTHd, *self.expanded_kv(latent_BTr, k_rope_BTr),
                               segment_ids=segment_ids, impl=self.config.attention_impl, window=window,
                               windowed=windowed, global_scale=self.global_scale(q_BTHd.shape[-1]))
        signal_BTSv, noise_BTSv = self.signal_and_noise(o_BTHv)
        (lam_BTS,) = self.lambdas(x_BTD, constants)
        return self.gated_output(signal_BTSv - lam_BTS[..., None] * noise_BTSv, x_BTD), cache

    def absorbed_attention(self, q_BTHd, latent_BSr, k_rope_BSr, visible_BTS, scale):
        """o [B, T, H, dv] of the queries over the cached latents without expanding them (DeepSeek-V2's absorbed MLA):
        q_nope W_uk^T is each head's query in latent space, so q . k = (q_nope W_uk^T) . latent + q_rope . k_rope, and
        the values' up-projection W_uv applies once to each head's output instead of to every slot. The same
        arithmetic as the expanded heads in another order (not bitwise the same)."""
        dtype, dn = q_BTHd.dtype, self.config.attention_options.qk_nope_head_dim
        up_rKc = self.kv_up_kernel[...].astype(dtype)
        B, T, H, _ = q_BTHd.shape
        K = up_rKc.shape[1]
        q_BTKgd = q_BTHd.reshape(B, T, K, H // K, -1)
        q_latent_BTKgr = jnp.einsum("btkgn,rkn->btkgr", q_BTKgd[..., :dn], up_rKc[..., :dn],
                                    preferred_element_type=jnp.float32).astype(dtype)
        s_BKgTS = (jnp.einsum("btkgr,bsr->bkgts", q_latent_BTKgr, latent_BSr, preferred_element_type=jnp.float32)
                   + jnp.einsum("btkgn,bsn->bkgts", q_BTKgd[..., dn:], k_rope_BSr, preferred_element_type=jnp.float32))
        p_BKgTS = masked_softmax(s_BKgTS * scale, visible_BTS[:, None, None]).astype(dtype)
        o_BTKgr = jnp.einsum("bkgts,bsr->btkgr", p_BKgTS, latent_BSr, preferred_element_type=jnp.float32).astype(dtype)
        o_BTKgv = jnp.einsum("btkgr,rkv->btkgv", o_BTKgr, up_rKc[..., dn:], preferred_element_type=jnp.float32)
        return o_BTKgv.astype(dtype).reshape(B, T, H, -1)

    def signal_and_noise(self, per_head, axis=2):
        """(signal heads, each signal head's noise head) of an array with the H heads on `axis`: [.., S, ..] twice."""
        N = self.config.attention_options.num_noise_heads
        shape = per_head.shape
        grouped = per_head.reshape(shape[:axis] + (N, shape[axis] // N) + shape[axis + 1:])
        g = grouped.shape[axis + 1]
        signal = jax.lax.slice_in_dim(grouped, 0, g - 1, axis=axis + 1)
        noise = jnp.repeat(jax.lax.slice_in_dim(grouped, g - 1, g, axis=axis + 1), g - 1, axis=axis + 1)
        flat = shape[:axis] + (-1,) + shape[axis + 1:]
        return signal.reshape(flat), noise.reshape(flat)

    def gated_output(self, o_BTSv, x_BTD):
        """The output gate (when configured) and the out projection of the differential heads' outputs."""
        dtype = o_BTSv.dtype
        if self.config.attention_options.output_gate:
            gate_BTSv = jnp.einsum("btr,rsv->btsv", self.q_latent(x_BTD), self.gate_kernel[...].astype(dtype))
            o_BTSv = o_BTSv * jax.nn.sigmoid(gate_BTSv)
        return self._out_projection(o_BTSv, dtype)

    def explicit_maps(self, x_BTD, rope_cos_sin, allowed_BTS, constants=None,
                      transform_logits=None) -> ExplicitAttention:
        """As AttentionModule's, over the S signal heads: map 0 a signal head's, map 1 its noise head's."""
        constants = {} if constants is None else constants
        q, k, v_BSKv = self.project(x_BTD, self.layer_rope(rope_cos_sin, constants))
        n_rep = self.config.num_query_groups
        s_BHTS = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, n_rep, axis=2), preferred_element_type=jnp.float32)
        s_MBSTS = jnp.stack(self.signal_and_noise(s_BHTS * self.softmax_scale(q.shape[-1], constants), axis=1))
        if transform_logits is not None:
            s_MBSTS = transform_logits(s_MBSTS)
        p_MBSTS = masked_softmax(s_MBSTS, allowed_BTS[None, :, None])
        v_MBsSv = jnp.stack(self.signal_and_noise(jnp.repeat(v_BSKv, n_rep, axis=2)))
        o_MBTSv = jnp.einsum("mbhts,mbshv->mbthv", p_MBSTS.astype(v_BSKv.dtype), v_MBsSv,
                             preferred_element_type=jnp.float32).astype(v_BSKv.dtype)
        (lam_BTS,) = self.lambdas(x_BTD, constants)
        effective_BSTS = p_MBSTS[0] - jnp.moveaxis(lam_BTS, 1, 2)[..., None].astype(jnp.float32) * p_MBSTS[1]
        out_BTD = self.gated_output(o_MBTSv[0] - lam_BTS[..., None] * o_MBTSv[1], x_BTD)
        return ExplicitAttention(s_MBSTS, p_MBSTS, effective_BSTS, out_BTD)
