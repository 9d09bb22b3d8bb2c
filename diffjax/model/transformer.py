"""Pre-norm decoder blocks and the decoder-only language model."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from diffjax import attention_kinds, ops
from diffjax.config import ModelConfig
from diffjax.kinds import MTP_STACK, Segment, layer_segments, param_stacks
from diffjax.model import layer_outputs, mlp, residual
from diffjax.model.attention import SAVED_BY_ATTENTION_POLICY, module_class
from diffjax.model.kv_cache import KVCache
from diffjax.model.layers import Embedding, RMSNorm, normal_param, prepend_axis
from diffjax.model.rope import layer_rope_tables
from diffjax.ops.context_parallel import context_size, to_context_order
from diffjax.sharding import constrain

BTD = ("batch", "length", "act_embed")
# What a block keeps for its backward pass (ModelConfig.remat); everything else is recomputed.
REMAT_POLICIES = {
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the projections' outputs
    # The attention's inputs and output and the residual stream between attention and MLP (names given in
    # attention.py and below): 5 d_model-wide values per token (+ the block input) where "minimal" keeps ~10 (the MLP's gate
    # and up outputs are 2.7 d_model each). Recomputed: norms, the MLP's gate/up matmuls, elementwise ops.
    "attention": jax.checkpoint_policies.save_only_these_names(*SAVED_BY_ATTENTION_POLICY, "attention_residual"),
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input
}
# What each policy saves of an attention op's forward for its backward (ops.saved_by_remat: "auto" counts the forward
# a backward runs again when it weighs kernels): "attention" keeps the names the ops give (SAVED_BY_ATTENTION_POLICY).
REMAT_SAVES = {"none": "all", "minimal": "none", "attention": "named", "full": "none"}


class DecoderBlock(nnx.Module):
    """An attention sublayer, then an MLP sublayer, each pre-normed and joined to the residual stream by the
    config's residual form; the three parts are the config's kinds (diffjax.kinds). With the plain form:
    h = x + attn(norm(x)); out = h + mlp(norm(h)). depth None: a layer of TransformerLM's stack."""

    def __init__(self, config: ModelConfig, depth: int | None = None, *, rngs: nnx.Rngs):
        # A standalone layer's own flag for models that mix windowed and global layers (a stack's come with its
        # depth constants).
        self.global_attention = None if depth is None or not config.mixes_windows else depth in config.global_layers
        residual_form = residual.module_class(config)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.attn = module_class(config)(config, depth, rngs=rngs)
        self.attn_residual = residual_form(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.mlp = mlp.module_class(config)(config, depth, rngs=rngs)
        self.mlp_residual = residual_form(config, rngs=rngs)

    def __call__(self, stream, rope_cos_sin, segment_ids=None, constants=None):
        """The block's output: the residual stream ([B, T, D] for the plain form)."""
        return self.call_with_cache(stream, rope_cos_sin, segment_ids, constants, None)[0]

    def call_with_cache(self, stream, rope_cos_sin, segment_ids, constants, cache):
        """(output stream, this layer's updated KVCache) (generation); cache None: (output, None)."""
        if constants is None and self.global_attention is not None:
            constants = {**self.attn.layer_constants(stream.dtype), "global_attention": self.global_attention}
        in_place = layer_outputs.attention_in_place()  # (the analyses' explicit maps)
        if in_place is not None:
            return self.forward(stream, lambda x_BTD: in_place(self.attn, x_BTD, rope_cos_sin, segment_ids, constants))
        return self.forward(stream, lambda x_BTD: self.attn.call_with_cache(x_BTD, rope_cos_sin, segment_ids, constants,
                                                                            cache))

    def forward(self, stream, attention):
        """(output stream, aux) with `attention(normed x_BTD) -> (y_BTD, aux)` as the attention sublayer's call (aux:
        the cache). Emits "attention_input" and "stream" on the layer output channel (layer_outputs)."""
        x_BTD, carry = self.attn_residual.read(stream)
        x_BTD = self.attn_norm(x_BTD)
        layer_outputs.emit("attention_input", lambda: x_BTD, "stack")
        attn_BTD, aux = attention(x_BTD)
        stream = checkpoint_name(self.attn_residual.write(stream, attn_BTD, carry), "attention_residual")
        x_BTD, carry = self.mlp_residual.read(stream)
        stream = self.mlp_residual.write(stream, self.mlp(self.mlp_norm(x_BTD)), carry)
        stream = constrain(stream, self.mlp_residual.stream_axes)
        layer_outputs.emit("stream", lambda: stream, "stack")
        return stream, aux


class PredictionBlock(DecoderBlock):
    """One multi-token-prediction depth (DeepSeek-V3's MTP module; Motif 3's model.mtp_layers.<k>, as Motif's vLLM
    motif_mtp.py computes it): h' = [h, embed_norm(embedding of the next input token)] @ input_proj, then the decoder
    block (the MTP layer's config: ModelConfig.mtp_layer_config; a residual form with streams of its own expands h'
    into them and collapses them after), then final_norm; the model's head gives its logits.
    Its params are a decoder block's plus these three, so LoRA, the sharding rules and checkpoints take it as a layer."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.config, D = config, config.d_model
        self.embed_norm = RMSNorm(D, config.norm_eps, config.param_dtype)
        self.input_proj_kernel = normal_param(rngs, (2 * D, D), config.init_std, config.param_dtype, (None, "embed"))
        self.final_norm = RMSNorm(D, config.norm_eps, config.param_dtype)

    def predict(self, hidden_BTD, embedded_BTD, rope_cos_sin, segment_ids, constants, cache=None):
        """The depth's final hidden states [B, T, D] from the previous depth's and the next tokens' embeddings; with a
        KVCache (speculative decoding's drafter: diffjax.generate.speculative), (hidden states, the updated cache)."""
        x_BTE = jnp.concatenate([hidden_BTD, self.embed_norm(embedded_BTD)], axis=-1)
        x_BTD = jnp.einsum("bte,ed->btd", x_BTE, self.input_proj_kernel[...].astype(x_BTE.dtype))
        residual_form = residual.module_class(self.config)
        stream = residual_form.expand(self.config, constrain(x_BTD, BTD))
        stream, updated = self.call_with_cache(stream, rope_cos_sin, segment_ids, constants, cache)
        hidden_BTD = self.final_norm(residual_form.collapse(self.config, stream))
        return hidden_BTD if cache is None else (hidden_BTD, updated)


class HiddenStates(NamedTuple):
    """TransformerLM.hidden_states' result."""

    hidden_BTD: jax.Array  # the final (normalized) hidden states in the compute dtype
    cache: KVCache | None  # the updated KVCache (None without one)
    outputs: dict[str, layer_outputs.Emitted]  # what the layers emitted that the call asked for ({}: nothing)


class TransformerLM(nnx.Module):
    """Decoder-only LM: `model(tokens[B, T]) -> float32 logits [B, T, vocab]`.

    positions default to 0..T-1 (in the context layout under a mesh with a context axis, which the tokens must
    then be in: diffjax.ops.context_parallel); with packed sequences pass per-document positions and
    segment_ids so that attention never crosses documents. With a KVCache (generation, diffjax.generate)
    the call returns (logits, updated cache) and the positions are the cache's: each row's tokens continue
    from the row's stored length.

    The decoder blocks are one DecoderBlock whose params are stacked over depth ([L, ...] leaves, logical
    axis "layers"), as MaxText and Levanter store them: initialized by one vmapped layer init and applied
    by a scan (or, with scan_layers false, a Python loop over the layer slices), so neither the init nor
    the scanned step grows with depth and the scan reads the stored params with no restacking. A model whose
    layers are not all built alike (an MoE's dense first layers: diffjax.kinds.layer_segments) holds one such
    stack per run of like layers, `blocks` (from layer 0) then `blocks_from_<start>`, run one after the other.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embedding(config.vocab_size, config.d_model, config.init_std, config.param_dtype, rngs=rngs)
        for segment in param_stacks(config):
            setattr(self, segment.name, _init_stack(segment, rngs))
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        if not config.tie_embeddings:
            self.lm_head = normal_param(
                rngs, (config.d_model, config.vocab_size), config.init_std, config.param_dtype, ("embed", "vocab")
            )

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, cache: KVCache | None = None, *,
                 lambda_scale=None, layer_params=None):
        """float32 logits [B, T, vocab]; with a KVCache (generation), (logits, updated cache). lambda_scale and
        layer_params: as hidden_states."""
        hidden_BTD, cache, _ = self.hidden_states(tokens_BT, positions_BT, segment_ids_BT, cache,
                                                  lambda_scale=lambda_scale, layer_params=layer_params)
        logits = self.logits(hidden_BTD)
        return logits if cache is None else (logits, cache)

    def hidden_states(self, tokens_BT, positions_BT=None, segment_ids_BT=None, cache: KVCache | None = None, *,
                      lambda_scale=None, layer_params=None,
                      outputs: layer_outputs.Request = layer_outputs.NOTHING) -> HiddenStates:
        """HiddenStates(the final (normalized) hidden states [B, T, D] in the compute dtype: what the LM head projects
        (the trainer's chunked loss and generation's prefill start here); with a KVCache the updated cache, else None;
        the layers' outputs that `outputs` asks for (diffjax.model.layer_outputs), stacked over the layers that emit
        them).
        lambda_scale: a scalar in [0, 1] multiplying every layer's lambda (optim.lambda_warmup_steps: 0 silences the
        second map, as an upcycled model starts); None: the model as it is (the same as 1).
        layer_params: the blocks' params one pytree per layer (`unstacked_blocks()`), read instead of the stack:
        the layers then run in a Python loop whatever scan_layers says, and a KVCache holds one buffer per layer."""
        tokens_BT = jnp.asarray(tokens_BT)
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, length], got {tokens_BT.shape}")
        if cache is not None and outputs.attention is not None:
            raise ValueError("an attention in place of the layers' own (layer_outputs.Request.attention) keeps no "
                             "KVCache: pass no cache")
        T = tokens_BT.shape[1]
        if cache is not None:
            if positions_BT is not None:
                raise ValueError("with a KVCache the positions are the cache's (each row's stored length): pass no positions")
            positions_BT = cache.positions(T)
        elif positions_BT is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
            # Under a context axis the tokens are in its layout (ops.context_parallel), and so their positions.
            positions_BT = jnp.broadcast_to(to_context_order(jnp.arange(T)[None], context_size()), tokens_BT.shape)
        dtype = jnp.dtype(self.config.dtype)
        residual_form = residual.module_class(self.config)
        stream = residual_form.expand(self.config, constrain(self.embed(tokens_BT, dtype), BTD))
        rope_cos_sin = layer_rope_tables(self.config, positions_BT, dtype)
        stream, cache, emitted = self._run_blocks(stream, rope_cos_sin, segment_ids_BT, cache, lambda_scale, layer_params,
                                                  outputs)
        return HiddenStates(self.final_norm(residual_form.collapse(self.config, stream)), cache, emitted)

    def logits(self, hidden_BTD):
        """float32 logits [B, T, vocab] of final hidden states."""
        if self.config.tie_embeddings:
            return self.embed.attend(hidden_BTD)
        return jnp.einsum("btd,dv->btv", hidden_BTD, self.head(hidden_BTD.dtype), preferred_element_type=jnp.float32)

    def head(self, dtype) -> jax.Array:
        """The output projection [D, vocab] in `dtype` (the embedding's transpose when tied)."""
        if self.config.tie_embeddings:
            return self.embed.embedding[...].astype(dtype).T
        return self.lm_head[...].astype(dtype)

    def depth_constants(self, dtype) -> dict:
        """Each layer's depth constants, [L] arrays ({} for kinds without any: the baseline, V2), and with global
        layers among windowed ones each layer's "global_attention" flag."""
        constants = module_class(self.config).depth_constants(self.config, range(self.config.num_layers), dtype)
        if self.config.mixes_windows:
            layers = range(self.config.num_layers)
            constants["global_attention"] = jnp.asarray([depth in self.config.global_layers for depth in layers])
        return constants

    def layer_lambdas(self) -> jax.Array | None:
        """lambda of every layer [L] (float32), by the attention's own formula and roundings in the compute
        dtype (the values the layers use); None for the baseline and for V2, whose lambda is per token and head
        (sigmoid(x W_lambda): a function of the activations, not of the params alone)."""
        if attention_kinds.get(self.config.attention).lambda_form != "per_layer":
            return None
        dtype = jnp.dtype(self.config.dtype)
        lambda_init = self.depth_constants(dtype)["lambda_init"]
        return jnp.concatenate([self.stack(segment).attn.lambda_full(dtype, lambda_init[segment.start:segment.stop])
                                for segment in self.segments()]).astype(jnp.float32)

    def segments(self) -> tuple[Segment, ...]:
        """The runs of like layers, each one stack of params (`stack`)."""
        return layer_segments(self.config)

    def stack(self, segment: Segment) -> DecoderBlock:
        """The segment's layers: one DecoderBlock with [layers, ...] params."""
        return getattr(self, segment.name)

    def layer(self, depth: int) -> DecoderBlock:
        """Layer `depth` as a standalone DecoderBlock (a copy of its params' slice), for inspection."""
        segment = next(segment for segment in self.segments() if segment.start <= depth < segment.stop)
        block = nnx.eval_shape(lambda: DecoderBlock(segment.config, depth, rngs=nnx.Rngs(0)))
        nnx.update(block, jax.tree.map(lambda x: x[depth - segment.start], nnx.state(self.stack(segment))))
        return block

    def unstacked_blocks(self) -> tuple[nnx.State, ...]:
        """The blocks' params as one pytree per layer: copies of the stacks' slices. A loop over layers that slices
        a stack copies every weight matrix before its matmul reads it (XLA materializes a slice feeding a dot),
        so generation makes these once and its decode step reads each weight once (memory: a second copy of the
        blocks' params while it runs)."""
        layers = []
        for segment in self.segments():
            params = nnx.state(self.stack(segment))
            layers += [jax.tree.map(lambda x: x[i], params) for i in range(segment.num_layers)]
        return tuple(layers)

    def _run_blocks(self, stream, rope_cos_sin, segment_ids_BT, cache: KVCache | None, lambda_scale, layer_params,
                    request: layer_outputs.Request):
        """The decoder blocks in order, rematerialized as the config says, scanned or in a Python loop (over
        `layer_params` if given, else over the stack's slices). A cache's buffers go through the layers with the
        params: stacked [L, ...] through a scan, one per layer through the loop. Returns (stream, the updated cache or
        None, the layers' outputs that `request` asks for)."""
        constants = self.depth_constants(stream.dtype)
        if lambda_scale is not None:
            constants["lambda_scale"] = jnp.broadcast_to(jnp.asarray(lambda_scale, jnp.float32), (self.config.num_layers,))
        kv = None if cache is None else (cache.k, cache.v)
        segments, kvs, emitted = self.segments(), [], []
        for segment in segments:
            layers = slice(segment.start, segment.stop)
            with ops.saved_by_remat(REMAT_SAVES[self.config.remat]):
                stream, segment_kv, segment_outputs = self._run_stack(
                    segment, stream, rope_cos_sin, segment_ids_BT, cache, jax.tree.map(lambda x: x[layers], constants),
                    None if kv is None else tuple(None if x is None else x[layers] for x in kv),
                    None if layer_params is None else layer_params[layers], request)
            kvs.append(segment_kv)
            emitted.append(segment_outputs)
        emitted = layer_outputs.joined(emitted)
        if cache is None:
            return stream, None, emitted
        if len(segments) > 1:  # one [L, ...] array (scanned) or one tuple of L buffers (loop) per k and v
            join = (lambda parts: sum(parts, ())) if isinstance(kvs[0][0], tuple) else jnp.concatenate
            kvs = [tuple(join([segment_kv[i] for segment_kv in kvs]) for i in range(2))]
        cache = dataclasses.replace(cache, k=kvs[0][0], v=kvs[0][1], lengths_B=cache.lengths_B + stream.shape[1])
        return stream, cache, emitted

    def _run_stack(self, segment, stream, rope_cos_sin, segment_ids_BT, cache, constants, kv, layer_params, request):
        """One segment's layers (_run_blocks): (stream, its k and v buffers (None without a cache), its layers'
        outputs)."""
        remat = self.config.remat
        scan = self.config.scan_layers and layer_params is None and not request.layer_by_layer
        graphdef, params = nnx.split(self.stack(segment))

        # One (checkpointed) function per window (the layer's static window, kept by its cache as a ring) and, for a
        # request that runs the layers one by one, per depth (the loop's).
        @functools.cache
        def block_call(window, depth):
            def apply_block(stream, layer_params, layer_constants, layer_kv):
                block = nnx.merge(graphdef, layer_params)
                with layer_outputs.Layer(request, depth) as emitted:
                    if cache is None:
                        stream, layer_kv = block(stream, rope_cos_sin, segment_ids_BT, layer_constants), None
                    else:
                        stream, layer_cache = block.call_with_cache(stream, rope_cos_sin, segment_ids_BT, layer_constants,
                                                                   cache.layer(*layer_kv, window=window))
                        layer_kv = (layer_cache.k, layer_cache.v)
                return stream, (layer_kv, emitted.outputs())

            if remat != "none":
                return jax.checkpoint(apply_block, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
            return apply_block

        if scan:
            apply_block = block_call(None, None)
            stream, (kv, emitted) = jax.lax.scan(lambda carried, layer: apply_block(carried, *layer), stream,
                                                 (params, constants, kv))
            return stream, kv, layer_outputs.over_layers(emitted, segment.start, segment.num_layers)
        layers_kv, emitted = [], []
        for i in range(segment.num_layers):
            layer = jax.tree.map(lambda x: x[i], params) if layer_params is None else layer_params[i]
            layer_kv = None if kv is None else tuple(None if x is None else x[i] for x in kv)
            depth = segment.start + i
            window = None if cache is None else self.config.window_at(depth)
            apply_block = block_call(window, depth if request.layer_by_layer else None)
            stream, (layer_kv, layer_emitted) = apply_block(stream, layer, jax.tree.map(lambda x: x[i], constants),
                                                            layer_kv)
            layers_kv.append(layer_kv)
            emitted.append(layer_emitted)
        # (k per layer, v per layer): no restacking; the outputs stacked like a scan's
        kv = None if cache is None else tuple(zip(*layers_kv))
        return stream, kv, layer_outputs.stacked(emitted, segment.start)

    def mtp_hidden_states(self, hidden_BTD, inputs_KBT, positions_BT, segment_ids_BT=None) -> list[jax.Array]:
        """The MTP depths' final hidden states, one [B, T, D] per depth k = 1..K (they predict token t + 1 + k:
        `logits` projects them): depth k reads depth k - 1's (depth 0: hidden_BTD, the model's) and the embeddings of
        inputs_KBT[k - 1] (token t + k at position t; diffjax.losses.mtp_targets). Every depth attends with the
        model's positions and segment ids."""
        if not self.config.mtp_depths:
            raise ValueError("this model has no multi-token-prediction depths (ModelConfig.mtp_depths is 0)")
        segment = param_stacks(self.config)[-1]
        config, dtype = segment.config, hidden_BTD.dtype
        graphdef, params = nnx.split(self.stack(segment))
        constants = module_class(config).depth_constants(config, range(segment.start, segment.stop), dtype)
        rope_cos_sin = layer_rope_tables(config, positions_BT, dtype)

        def depth_call(hidden_BTD, depth_params, depth_constants, inputs_BT):
            block = nnx.merge(graphdef, depth_params)
            return block.predict(hidden_BTD, self.embed(inputs_BT, dtype), rope_cos_sin, segment_ids_BT, depth_constants)

        if self.config.remat != "none":
            depth_call = jax.checkpoint(depth_call, policy=REMAT_POLICIES[self.config.remat])
        hiddens = []
        for k in range(segment.num_layers):
            pick = functools.partial(lambda x, k: x[k], k=k)
            hidden_BTD = depth_call(hidden_BTD, jax.tree.map(pick, params), jax.tree.map(pick, constants), inputs_KBT[k])
            hiddens.append(hidden_BTD)
        return hiddens

    def mtp_depth_with_cache(self, depth: int, hidden_BTD, inputs_BT, cache: KVCache, depth_params):
        """MTP depth `depth` (1..mtp_depths) over T tokens with its own KVCache, at the cache's positions (speculative
        decoding's drafter): (its final hidden states [B, T, D], the updated cache). depth_params: the depth's params
        (a copy of the stack's slice, as unstacked_blocks makes them)."""
        segment = param_stacks(self.config)[-1]
        config, dtype = segment.config, hidden_BTD.dtype
        constants = module_class(config).depth_constants(config, [segment.start + depth - 1], dtype)
        block = nnx.merge(nnx.graphdef(self.stack(segment)), depth_params)
        rope_cos_sin = layer_rope_tables(config, cache.positions(inputs_BT.shape[1]), dtype)
        hidden_BTD, cache = block.predict(hidden_BTD, self.embed(inputs_BT, dtype), rope_cos_sin, None,
                                          jax.tree.map(lambda x: x[0], constants),
                                          cache.layer(cache.k, cache.v, window=config.window_at(0)))
        return hidden_BTD, dataclasses.replace(cache, lengths_B=cache.lengths_B + inputs_BT.shape[1])

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))


def _init_stack(segment: Segment, rngs: nnx.Rngs) -> DecoderBlock:
    """The segment's layers initialized by one vmapped layer init: a DecoderBlock with [layers, ...] params."""

    block = PredictionBlock if segment.name == MTP_STACK else DecoderBlock

    @nnx.split_rngs(splits=segment.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def init_blocks(rngs):
        return block(segment.config, rngs=rngs)

    blocks = init_blocks(rngs)
    prepend_axis(blocks, "layers")
    return blocks
