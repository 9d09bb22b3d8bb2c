"""Pre-norm decoder blocks and the decoder-only language model."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from diffjax import attention_kinds, block_kinds, kinds, ops
from diffjax.config import ModelConfig
from diffjax.kinds import Segment, layer_segments, param_stacks
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
    h = x + attn(norm(x)); out = h + mlp(norm(h)). depth None: a layer of TransformerLM's stack.

    The block kinds (diffjax.block_kinds) subclass it: a stack of these runs on the residual stream between the
    embedding and the final norm; a kind with `follows_the_layers` runs on the model's final hidden state, when the
    forward is given the inputs its `stack_constants` reads (the MTP depths: diffjax.model.mtp)."""

    follows_the_layers: ClassVar[bool] = False

    @classmethod
    def stack_constants(cls, model: "TransformerLM", segment: Segment, inputs: Mapping, dtype) -> dict | None:
        """The per-layer constants ([layers, ...] arrays) a stack that follows the layers runs with, made from the
        forward's named inputs; None: it does not run in this forward (its inputs are not given)."""
        return None

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
        for segment in self.stacks():
            setattr(self, segment.name, _init_stack(segment, rngs))
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        if not config.tie_embeddings:
            self.lm_head = normal_param(
                rngs, (config.d_model, config.vocab_size), config.init_std, config.param_dtype, ("embed", "vocab")
            )

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, cache: KVCache | None = None, *,
                 lambda_scale=None, layer_params=None, inputs: Mapping | None = None):
        """float32 logits [B, T, vocab]; with a KVCache (generation), (logits, updated cache). lambda_scale,
        layer_params and inputs: as hidden_states."""
        hidden_BTD, cache, _ = self.hidden_states(tokens_BT, positions_BT, segment_ids_BT, cache,
                                                  lambda_scale=lambda_scale, layer_params=layer_params, inputs=inputs)
        logits = self.logits(hidden_BTD)
        return logits if cache is None else (logits, cache)

    def hidden_states(self, tokens_BT, positions_BT=None, segment_ids_BT=None, cache: KVCache | None = None, *,
                      lambda_scale=None, layer_params=None, outputs: layer_outputs.Request = layer_outputs.NOTHING,
                      inputs: Mapping | None = None) -> HiddenStates:
        """HiddenStates(the final (normalized) hidden states [B, T, D] in the compute dtype: what the LM head projects
        (the trainer's chunked loss and generation's prefill start here); with a KVCache the updated cache, else None;
        the layers' outputs that `outputs` asks for (diffjax.model.layer_outputs), stacked over the layers that emit
        them).
        inputs: named inputs of the forward, what the kinds' facets make for a train step (diffjax.model.facets): a
        scalar reaches every layer as a constant of that name (DIFF's lambda warm-up: "lambda_scale", a float32 in
        [0, 1] multiplying every layer's lambda; 0 silences the second map, as an upcycled model starts); a stack that
        follows the layers (the MTP depths) runs when given the inputs it reads, and emits on the layer output
        channel. lambda_scale: inputs["lambda_scale"], shorter.
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
        inputs = dict(inputs or {})
        if lambda_scale is not None:
            inputs["lambda_scale"] = jnp.asarray(lambda_scale, jnp.float32)
        dtype = jnp.dtype(self.config.dtype)
        residual_form = residual.module_class(self.config)
        stream = residual_form.expand(self.config, constrain(self.embed(tokens_BT, dtype), BTD))
        rope_cos_sin = layer_rope_tables(self.config, positions_BT, dtype)
        stream, cache, emitted = self._run_blocks(stream, rope_cos_sin, segment_ids_BT, cache, inputs, layer_params,
                                                  outputs)
        hidden_BTD = self.final_norm(residual_form.collapse(self.config, stream))
        emitted = self._run_following_stacks(hidden_BTD, positions_BT, segment_ids_BT, inputs, outputs, emitted)
        return HiddenStates(hidden_BTD, cache, emitted)

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

    def following_constants(self, segment: Segment, dtype) -> dict:
        """The depth constants of a stack that follows the layers ([layers] arrays, as depth_constants'): its layers
        are numbered on from num_layers and built with its own config (windowed at every position when windowed)."""
        return module_class(segment.config).depth_constants(segment.config, range(segment.start, segment.stop), dtype)

    def layer_lambdas(self) -> jax.Array | None:
        """lambda of every layer [L] (float32), then of each layer of the stacks that follow them (the MTP depths), by
        the attention's own formula and roundings in the compute dtype (the values the layers use); None for the
        baseline and for V2, whose lambda is per token and head (sigmoid(x W_lambda): a function of the activations,
        not of the params alone)."""
        if attention_kinds.get(self.config.attention).lambda_form != "per_layer":
            return None
        dtype = jnp.dtype(self.config.dtype)
        lambda_init = self.depth_constants(dtype)["lambda_init"]
        lambdas = [self.stack(segment).attn.lambda_full(dtype, lambda_init[segment.start:segment.stop])
                   for segment in self.segments()]
        lambdas += [self.stack(segment).attn.lambda_full(dtype, self.following_constants(segment, dtype)["lambda_init"])
                    for segment in self.stacks()[len(lambdas):]]
        return jnp.concatenate(lambdas).astype(jnp.float32)

    def segments(self) -> tuple[Segment, ...]:
        """The runs of like layers, each one stack of params (`stack`)."""
        return layer_segments(self.config)

    def stacks(self) -> tuple[Segment, ...]:
        """Every stack of block params: the layers' segments, then the stacks that follow them (the MTP depths)."""
        return param_stacks(self.config)

    def stack(self, segment: Segment) -> DecoderBlock:
        """The segment's layers: one DecoderBlock (its block kind's class) with [layers, ...] params."""
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

    def _run_blocks(self, stream, rope_cos_sin, segment_ids_BT, cache: KVCache | None, inputs: Mapping, layer_params,
                    request: layer_outputs.Request):
        """The decoder blocks in order, rematerialized as the config says, scanned or in a Python loop (over
        `layer_params` if given, else over the stack's slices). A cache's buffers go through the layers with the
        params: stacked [L, ...] through a scan, one per layer through the loop. Returns (stream, the updated cache or
        None, the layers' outputs that `request` asks for)."""
        constants = self.depth_constants(stream.dtype)
        constants.update(layer_inputs(inputs, self.config.num_layers))
        kv = None if cache is None else (cache.k, cache.v)
        segments, kvs, emitted = self.segments(), [], []
        for segment in segments:
            layers = slice(segment.start, segment.stop)
            with ops.saved_by_remat(REMAT_SAVES[self.config.remat]):
                stream, segment_kv, segment_outputs = self.run_stack(
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

    def _run_following_stacks(self, hidden_BTD, positions_BT, segment_ids_BT, inputs: Mapping,
                              request: layer_outputs.Request, emitted: dict) -> dict:
        """The stacks that follow the layers (DecoderBlock.follows_the_layers: the MTP depths) on the final hidden
        states, each when the forward is given its inputs: `emitted` with their layers' outputs joined on."""
        parts = [emitted]
        for segment in self.stacks():
            block = block_class(segment)
            if not block.follows_the_layers:
                continue
            constants = block.stack_constants(self, segment, inputs, hidden_BTD.dtype)
            if constants is None:
                continue
            rope_cos_sin = layer_rope_tables(segment.config, positions_BT, hidden_BTD.dtype)
            with ops.saved_by_remat(REMAT_SAVES[self.config.remat]):
                parts.append(self.run_stack(segment, hidden_BTD, rope_cos_sin, segment_ids_BT, None, constants, None,
                                            None, request)[2])
        return emitted if len(parts) == 1 else layer_outputs.joined(parts)

    def run_stack(self, segment: Segment, stream, rope_cos_sin, segment_ids_BT, cache: KVCache | None, constants: dict,
                  kv, layer_params, request: layer_outputs.Request):
        """The one stack runner: a stack's layers (a segment of the layers, or of a stack that follows them) one after
        the other on `stream`, each with its slice of `constants` ([layers, ...] arrays), rematerialized as the config
        says, scanned or in a Python loop (over `layer_params` if given: one pytree per layer, else over the stack's
        slices). kv: the layers' k and v buffers of `cache`, stacked [layers, ...] (scanned) or one per layer (loop);
        None without a cache. Returns (stream, its k and v buffers (None without a cache), its layers' outputs that
        `request` asks for, stacked over them)."""
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
            window = None if cache is None else segment.config.window_at(depth)
            apply_block = block_call(window, depth if request.layer_by_layer else None)
            stream, (layer_kv, layer_emitted) = apply_block(stream, layer, jax.tree.map(lambda x: x[i], constants),
                                                            layer_kv)
            layers_kv.append(layer_kv)
            emitted.append(layer_emitted)
        # (k per layer, v per layer): no restacking; the outputs stacked like a scan's
        kv = None if cache is None else tuple(zip(*layers_kv))
        return stream, kv, layer_outputs.stacked(emitted, segment.start)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))


def layer_inputs(inputs: Mapping, num_layers: int) -> dict:
    """The forward's scalar inputs as constants of every layer, [num_layers] each (hidden_states)."""
    return {name: jnp.broadcast_to(value, (num_layers,)) for name, value in inputs.items() if jnp.ndim(value) == 0}


def block_class(segment: Segment) -> type[DecoderBlock]:
    """The class of the segment's layers: its block kind's module (diffjax.block_kinds)."""
    return kinds.module_class(block_kinds.get(segment.block), DecoderBlock)


def _init_stack(segment: Segment, rngs: nnx.Rngs) -> DecoderBlock:
    """The segment's layers initialized by one vmapped layer init: a DecoderBlock with [layers, ...] params."""

    block = block_class(segment)

    @nnx.split_rngs(splits=segment.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def init_blocks(rngs):
        return block(segment.config, rngs=rngs)

    blocks = init_blocks(rngs)
    prepend_axis(blocks, "layers")
    return blocks
