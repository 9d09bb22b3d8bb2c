"""Pre-norm decoder blocks and the decoder-only language model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import DIFF_V1_KINDS, ModelConfig
from diffjax.model.attention import DiffAttention, StandardAttention, depth_constants
from diffjax.model.attention_v2 import DiffAttentionV2
from diffjax.model.shared_diff import SharedDiffAttention
from diffjax.model.layers import Embedding, GatedMLP, RMSNorm, normal_param, prepend_axis
from diffjax.model.rope import inv_frequencies, rope_tables
from diffjax.sharding import constrain

BTD = ("batch", "length", "act_embed")
# What a block keeps for its backward pass (ModelConfig.remat); everything else is recomputed.
REMAT_POLICIES = {
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the projections' outputs
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input
}


class DecoderBlock(nnx.Module):
    """h = x + attn(norm(x)); out = h + mlp(norm(h)). depth None: a layer of TransformerLM's stack."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        if config.attention == "diff":
            self.attn = DiffAttention(config, depth, rngs=rngs)
        elif config.attention == "shared_diff":
            self.attn = SharedDiffAttention(config, depth, rngs=rngs)
        elif config.attention == "diff_v2":
            self.attn = DiffAttentionV2(config, rngs=rngs)
        else:
            self.attn = StandardAttention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.mlp = GatedMLP(config, rngs=rngs)

    def __call__(self, x_BTD, rope_cos_sin, segment_ids=None, constants=None):
        h_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), rope_cos_sin, segment_ids, constants)
        return constrain(h_BTD + self.mlp(self.mlp_norm(h_BTD)), BTD)


class TransformerLM(nnx.Module):
    """Decoder-only LM: `model(tokens[B, T]) -> float32 logits [B, T, vocab]`.

    positions default to 0..T-1; with packed sequences pass per-document positions and
    segment_ids so that attention never crosses documents.

    The decoder blocks are one DecoderBlock whose params are stacked over depth ([L, ...] leaves, logical
    axis "layers"), as MaxText and Levanter store them: initialized by one vmapped layer init and applied
    by a scan (or, with scan_layers false, a Python loop over the layer slices), so neither the init nor
    the scanned step grows with depth and the scan reads the stored params with no restacking.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embedding(config.vocab_size, config.d_model, config.init_std, config.param_dtype, rngs=rngs)

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def init_blocks(rngs):
            return DecoderBlock(config, rngs=rngs)

        self.blocks = init_blocks(rngs)
        prepend_axis(self.blocks, "layers")
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

    def depth_constants(self, dtype) -> dict:
        """Each layer's depth constants, [L] arrays ({} for the baseline and V2, which have none)."""
        if self.config.attention not in DIFF_V1_KINDS:
            return {}
        return depth_constants([self.config.lambda_init_at(depth) for depth in range(self.config.num_layers)], dtype)

    def layer_lambdas(self) -> jax.Array | None:
        """lambda of every layer [L] (float32), by the attention's own formula and roundings in the compute
        dtype (the values the layers use); None for the baseline and for V2, whose lambda is per token and head
        (sigmoid(x W_lambda): a function of the activations, not of the params alone)."""
        if self.config.attention not in DIFF_V1_KINDS:
            return None
        dtype = jnp.dtype(self.config.dtype)
        return self.blocks.attn.lambda_full(dtype, self.depth_constants(dtype)["lambda_init"]).astype(jnp.float32)

    def layer(self, depth: int) -> DecoderBlock:
        """Layer `depth` as a standalone DecoderBlock (a copy of its params' slice), for inspection."""
        block = nnx.eval_shape(lambda: DecoderBlock(self.config, depth, rngs=nnx.Rngs(0)))
        nnx.update(block, jax.tree.map(lambda x: x[depth], nnx.state(self.blocks)))
        return block

    def _run_blocks(self, x_BTD, rope_cos_sin, segment_ids_BT):
        """The decoder blocks in order, rematerialized as the config says, scanned or in a Python loop."""
        remat, scan = self.config.remat, self.config.scan_layers
        graphdef, params = nnx.split(self.blocks)
        constants = self.depth_constants(x_BTD.dtype)

        def apply_block(x_BTD, layer_params, layer_constants):
            return nnx.merge(graphdef, layer_params)(x_BTD, rope_cos_sin, segment_ids_BT, layer_constants)

        if remat != "none":
            apply_block = jax.checkpoint(apply_block, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
        if scan:
            x_BTD, _ = jax.lax.scan(lambda x, layer: (apply_block(x, *layer), None), x_BTD, (params, constants))
            return x_BTD
        for depth in range(self.config.num_layers):
            x_BTD = apply_block(x_BTD, *jax.tree.map(lambda x: x[depth], (params, constants)))
        return x_BTD

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
