"""Pre-norm decoder blocks and the decoder-only language model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.attention import DiffAttention, StandardAttention
from diffjax.model.layers import Embedding, GatedMLP, RMSNorm, normal_param
from diffjax.model.rope import inv_frequencies, rope_tables


class DecoderBlock(nnx.Module):
    """h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, depth: int, *, rngs: nnx.Rngs):
        attention_cls = DiffAttention if config.attention == "diff" else StandardAttention
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.attn = attention_cls(config, depth, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.mlp = GatedMLP(config, rngs=rngs)

    def __call__(self, x_BTD, rope_cos_sin, segment_ids=None):
        h_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), rope_cos_sin, segment_ids)
        return h_BTD + self.mlp(self.mlp_norm(h_BTD))


class TransformerLM(nnx.Module):
    """Decoder-only LM: `model(tokens[B, T]) -> float32 logits [B, T, vocab]`.

    positions default to 0..T-1; with packed sequences pass per-document positions and
    segment_ids so that attention never crosses documents.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embedding(config.vocab_size, config.d_model, config.init_std, config.param_dtype, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(config, depth, rngs=rngs) for depth in range(config.num_layers)])
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        if not config.tie_embeddings:
            self.lm_head = normal_param(
                rngs, (config.d_model, config.vocab_size), config.init_std, config.param_dtype, ("embed", "vocab")
            )

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
        tokens_BT = jnp.asarray(tokens_BT)
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, length], got {tokens_BT.shape}")
        T = tokens_BT.shape[1]
        if positions_BT is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
            positions_BT = jnp.broadcast_to(jnp.arange(T), tokens_BT.shape)
        dtype = jnp.dtype(self.config.dtype)
        x_BTD = self.embed(tokens_BT, dtype)
        rope_cos_sin = rope_tables(positions_BT, inv_frequencies(self.config), dtype)
        for block in self.blocks:
            x_BTD = block(x_BTD, rope_cos_sin, segment_ids_BT)
        x_BTD = self.final_norm(x_BTD)
        if self.config.tie_embeddings:
            return self.embed.attend(x_BTD)
        return jnp.einsum("btd,dv->btv", x_BTD, self.lm_head[...].astype(dtype), preferred_element_type=jnp.float32)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
