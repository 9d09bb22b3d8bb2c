"""Pre-norm decoder blocks and the decoder-only language model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.attention import DiffAttention, StandardAttention
from diffjax.model.layers import Embedding, GatedMLP, RMSNorm, normal_param
from diffjax.model.rope import inv_frequencies, rope_tables
from diffjax.sharding import constrain

BTD = ("batch", "length", "act_embed")
# What a block keeps for its backward pass (ModelConfig.remat); everything else is recomputed.
REMAT_POLICIES = {
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the projections' outputs
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input
}


class DecoderBlock(nnx.Module):
    """h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, depth: int, *, rngs: nnx.Rngs):
        attention_cls = DiffAttention if config.attention == "diff" else StandardAttention
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.attn = attention_cls(config, depth, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.mlp = GatedMLP(config, rngs=rngs)

    def __call__(self, x_BTD, rope_cos_sin, segment_ids=None, constants=None):
        h_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), rope_cos_sin, segment_ids, constants)
        return constrain(h_BTD + self.mlp(self.mlp_norm(h_BTD)), BTD)


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
        x_BTD = constrain(self.embed(tokens_BT, dtype), BTD)
        rope_cos_sin = rope_tables(positions_BT, inv_frequencies(self.config), dtype)
        x_BTD = self._run_blocks(x_BTD, rope_cos_sin, segment_ids_BT)
        x_BTD = self.final_norm(x_BTD)
        if self.config.tie_embeddings:
            return self.embed.attend(x_BTD)
        return jnp.einsum("btd,dv->btv", x_BTD, self.lm_head[...].astype(dtype), preferred_element_type=jnp.float32)

    def _run_blocks(self, x_BTD, rope_cos_sin, segment_ids_BT):
        """The decoder blocks in order, rematerialized and / or scanned as the config says.

        A scan runs block 0's graph with each layer's params and depth constants stacked along a new
        leading axis; the params stay one entry per layer (the checkpoint layout does not depend on
        scanning), and the stacking costs one copy of the layers' params.
        """
        remat, scan = self.config.remat, self.config.scan_layers
        if remat == "none" and not scan:
            for block in self.blocks:
                x_BTD = block(x_BTD, rope_cos_sin, segment_ids_BT)
            return x_BTD
        graphdef = nnx.graphdef(self.blocks[0])
        dtype = x_BTD.dtype

        def apply_block(x_BTD, params, constants):
            return nnx.merge(graphdef, params)(x_BTD, rope_cos_sin, segment_ids_BT, constants)

        if remat != "none":
            apply_block = jax.checkpoint(apply_block, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
        params = [nnx.state(block) for block in self.blocks]
        constants = [block.attn.layer_constants(dtype) for block in self.blocks]
        if not scan:
            for layer_params, layer_constants in zip(params, constants):
                x_BTD = apply_block(x_BTD, layer_params, layer_constants)
            return x_BTD
        stack = lambda *layers: jnp.stack(layers)  # noqa: E731
        stacked = (jax.tree.map(stack, *params), jax.tree.map(stack, *constants))
        x_BTD, _ = jax.lax.scan(lambda x, layer: (apply_block(x, *layer), None), x_BTD, stacked)
        return x_BTD

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
