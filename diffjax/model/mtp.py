"""The multi-token-prediction depths (ModelConfig.mtp_depths = K; the block kind "mtp" of diffjax.block_kinds, which
counts their parameters): DeepSeek-V3's MTP modules, Motif 3's model.mtp_layers.<k> as Motif's vLLM motif_mtp.py
computes them. Depth k = 1..K predicts token t + 1 + k at position t from depth k - 1's final hidden state at t (depth
0: the model's) and the embedding of token t + k:

    h'_k = [h_{k-1}, embed_norm(embedding of token t + k)] @ input_proj     ([2D] -> [D])
    h_k  = final_norm(decoder layer(h'_k))                                   (the model's head gives its logits)

The depths are a stack of params ("blocks_mtp") that follows the model's layers: TransformerLM runs it with its one
stack runner on the final hidden states when the forward is given the depths' input tokens (NEXT_TOKENS), and each
depth emits its h_k on the layer output channel (PREDICTION), beside what its layer's kinds emit (an MoE layer's router
statistics: its facet then serves the depths' layers too). Training (DeepSeek-V3's form): the depths' loss sums
join the main loss times mtp_loss_weight / K (PredictionLoss); each depth's mean loss is logged as
mtp_loss/depth_<k>; the eval loss stays the main one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.kinds import MTP_BLOCK, Segment
from diffjax.model import layer_outputs, residual
from diffjax.model.facets import Facet
from diffjax.model.kv_cache import KVCache
from diffjax.model.layers import RMSNorm, normal_param
from diffjax.model.rope import layer_rope_tables
from diffjax.model.transformer import BTD, DecoderBlock, TransformerLM, layer_inputs
from diffjax.ops.context_parallel import context_size, to_context_order
from diffjax.sharding import constrain

NEXT_TOKENS = "mtp_next_tokens"  # the forward's input: [K, B, T] int, token t + k at position t for depth k
EMBEDDED = "mtp_embedded"  # a depth's constant: the embeddings of its next tokens, [B, T, D]
PREDICTION = "mtp_prediction"  # on the layer output channel: each depth's final hidden state h_k, [B, T, D]
DEPTH_LOSSES = "mtp_depth_losses"  # the step's outputs: each depth's loss sum and target count, [K] each
METRIC = "mtp_loss/depth_{}"  # each depth's mean loss, in the step's metrics


class PredictionBlock(DecoderBlock):
    """One depth (module docstring): a decoder layer built with ModelConfig.mtp_layer_config (a residual form with
    streams of its own expands h' into them and collapses them after) between the input projection and the final
    norm. Its params are a decoder layer's plus embed_norm, input_proj_kernel and final_norm, so LoRA, the sharding
    rules and checkpoints take it as a layer."""

    follows_the_layers = True

    def __init__(self, config, depth: int | None = None, *, rngs: nnx.Rngs):
        super().__init__(config, depth, rngs=rngs)
        self.config, D = config, config.d_model
        self.embed_norm = RMSNorm(D, config.norm_eps, config.param_dtype)
        self.input_proj_kernel = normal_param(rngs, (2 * D, D), config.init_std, config.param_dtype, (None, "embed"))
        self.final_norm = RMSNorm(D, config.norm_eps, config.param_dtype)

    @classmethod
    def stack_constants(cls, model: TransformerLM, segment: Segment, inputs, dtype) -> dict | None:
        """The depths' constants: their attention's depth constants, the forward's scalar inputs, and the embeddings
        of inputs[NEXT_TOKENS] ([depths, B, T] for the segment's depths); None without them."""
        if NEXT_TOKENS not in inputs:
            return None
        constants = {**model.following_constants(segment, dtype), **layer_inputs(inputs, segment.num_layers)}
        return {**constants, EMBEDDED: model.embed(inputs[NEXT_TOKENS], dtype)}

    def call_with_cache(self, hidden_BTD, rope_cos_sin, segment_ids, constants, cache):
        """(h_k [B, T, D], the updated KVCache or None) from h_{k-1} and constants[EMBEDDED]."""
        constants = dict(constants)
        embedded_BTD = constants.pop(EMBEDDED)
        x_BTE = jnp.concatenate([hidden_BTD, self.embed_norm(embedded_BTD)], axis=-1)
        x_BTD = jnp.einsum("bte,ed->btd", x_BTE, self.input_proj_kernel[...].astype(x_BTE.dtype))
        residual_form = residual.module_class(self.config)
        stream = residual_form.expand(self.config, constrain(x_BTD, BTD))
        stream, cache = super().call_with_cache(stream, rope_cos_sin, segment_ids, constants, cache)
        hidden_BTD = self.final_norm(residual_form.collapse(self.config, stream))
        layer_outputs.emit(PREDICTION, lambda: hidden_BTD, "stack")
        return hidden_BTD, cache


def depth_targets(tokens_BT, segment_ids_BT, loss_mask_BT, depths: int):
    """The depths' (inputs, targets, weights), each [K, B, T] (int, int, float32): depth k = 1..K reads token t + k at
    position t and predicts token t + 1 + k, counted as diffjax.losses.next_token_targets counts (the same document
    from t to t + 1 + k, loss_mask set on the target); positions without one have weight 0 (and input 0). Stated per
    position, so a batch may be permuted after this (the context-parallel layout)."""
    tokens_BT = jnp.asarray(tokens_BT)
    B, T = tokens_BT.shape

    def shifted(x_BT, by):  # x[t + by] at t, 0 past the end
        return jnp.pad(x_BT[:, by:], ((0, 0), (0, min(by, T))))

    inputs, targets, weights = [], [], []
    for k in range(1, depths + 1):
        mask_BT = jnp.broadcast_to(jnp.arange(T) + 1 + k < T, (B, T))
        if segment_ids_BT is not None:
            segment_ids_BT = jnp.asarray(segment_ids_BT)
            mask_BT &= (shifted(segment_ids_BT, 1 + k) == segment_ids_BT) & (shifted(segment_ids_BT, 1 + k) != 0)
        if loss_mask_BT is not None:
            mask_BT &= shifted(jnp.asarray(loss_mask_BT), 1 + k) != 0
        inputs.append(shifted(tokens_BT, k))
        targets.append(shifted(tokens_BT, 1 + k))
        weights.append(mask_BT.astype(jnp.float32))
    return jnp.stack(inputs), jnp.stack(targets), jnp.stack(weights)


def _batch_targets(batch, depths: int):
    """depth_targets of a train batch, in the forward's layout (the context axis': ops.context_parallel)."""
    context = context_size()
    return tuple(jax.vmap(lambda x: to_context_order(x, context))(x) for x in
                 depth_targets(batch["tokens"], batch.get("segment_ids"), batch.get("loss_mask"), depths))


class PredictionLoss(Facet):
    """The depths' training side (the "mtp" block kind's facet): their input tokens for the forward, their loss sums
    joining the main loss times mtp_loss_weight / K (sums over the micro-batch's targets, divided like the main one by
    the main target count, so accumulation equals one big batch; depth k counts k fewer targets per document), and
    each depth's mean loss as the step's metric mtp_loss/depth_<k>."""

    loss_outputs = (PREDICTION,)

    def batch_inputs(self, batch):
        return {NEXT_TOKENS: _batch_targets(batch, self.config.mtp_depths)[0]}

    def loss(self, outputs, batch, score):
        if PREDICTION not in outputs:  # (a forward that ran no depths)
            return None
        _, targets_KBT, weights_KBT = _batch_targets(batch, self.config.mtp_depths)
        sums, counts = zip(*(score(h_BTD, t_BT, w_BT) for h_BTD, t_BT, w_BT in
                             zip(outputs[PREDICTION].value, targets_KBT, weights_KBT)))
        sums_K, counts_K = jnp.stack(sums), jnp.stack(counts)
        weight = self.config.mtp_loss_weight / self.config.mtp_depths
        depth_losses = layer_outputs.Emitted({"sum": sums_K, "count": counts_K}, "sum")
        return weight * jnp.sum(sums_K), {DEPTH_LOSSES: depth_losses}

    def metrics(self, outputs, model):
        depths = outputs[DEPTH_LOSSES].value
        return {METRIC.format(k + 1): depths["sum"][k] / jnp.maximum(depths["count"][k], 1.0)
                for k in range(self.config.mtp_depths)}

    def shown(self, values):
        """The depths' losses beside the main one, depth 1 first: {"mtp": "2.9071 3.1002"}."""
        losses = [values[METRIC.format(k + 1)] for k in range(self.config.mtp_depths) if METRIC.format(k + 1) in values]
        return {"mtp": " ".join(f"{loss:.4f}" for loss in losses)} if losses else {}


# ---- the depths outside the train step: tests, analyses, speculative decoding's drafter


def depth_stack(model: TransformerLM) -> Segment:
    """The MTP depths' stack of `model` (a ValueError when it has none)."""
    for segment in model.stacks():
        if segment.block == MTP_BLOCK:
            return segment
    raise ValueError("this model has no multi-token-prediction depths (ModelConfig.mtp_depths is 0)")


def hidden_states(model: TransformerLM, hidden_BTD, inputs_KBT, positions_BT, segment_ids_BT=None) -> list[jax.Array]:
    """The depths' final hidden states, one [B, T, D] per depth k = 1..K (`model.logits` projects them): depth k reads
    depth k - 1's (depth 0: hidden_BTD, the model's) and the embeddings of inputs_KBT[k - 1] (token t + k at position
    t: depth_targets). Every depth attends with the model's positions and segment ids."""
    segment = depth_stack(model)
    constants = PredictionBlock.stack_constants(model, segment, {NEXT_TOKENS: inputs_KBT}, hidden_BTD.dtype)
    rope_cos_sin = layer_rope_tables(segment.config, positions_BT, hidden_BTD.dtype)
    outputs = model.run_stack(segment, hidden_BTD, rope_cos_sin, segment_ids_BT, None, constants, None, None,
                              layer_outputs.Request({PREDICTION}))[2]
    return list(outputs[PREDICTION].value)


def depth_with_cache(model: TransformerLM, depth: int, hidden_BTD, inputs_BT, cache: KVCache, depth_params):
    """Depth `depth` (1..K) over T tokens with its own KVCache, at the cache's positions (speculative decoding's
    drafter: diffjax.generate.speculative): (its final hidden states [B, T, D], the updated cache). depth_params: the
    depth's params (a copy of the stack's slice, as TransformerLM.unstacked_blocks makes the layers')."""
    stack = depth_stack(model)
    segment = dataclasses.replace(stack, start=stack.start + depth - 1, stop=stack.start + depth)
    constants = PredictionBlock.stack_constants(model, segment, {NEXT_TOKENS: inputs_BT[None]}, hidden_BTD.dtype)
    rope_cos_sin = layer_rope_tables(segment.config, cache.positions(inputs_BT.shape[1]), hidden_BTD.dtype)
    hidden_BTD, (k, v), _ = model.run_stack(segment, hidden_BTD, rope_cos_sin, None, cache, constants,
                                            ((cache.k,), (cache.v,)), (depth_params,), layer_outputs.NOTHING)
    return hidden_BTD, dataclasses.replace(cache, k=k[0], v=v[0], lengths_B=cache.lengths_B + inputs_BT.shape[1])
