"""The model's forward pass with every layer's attention open to inspection, and optionally its attention
logits quantized.

The attention layers never materialise their score matrices (the fused kernels cannot), so this module runs
each layer's attention through the layer's own `explicit_maps` (every attention kind has one:
diffjax/model/attention/base.py) in place of its attention call, and the rest of the block as the block runs it
(the model's own forward, asked on its layer output channel to run the explicit maps in place of each layer's
attention: diffjax.model.layer_outputs): the output equals `model(tokens)` (tested in float32), and the logits,
maps and hidden states on the way are handed to an `observe` function that reduces them inside the same jitted
program as each layer finishes (so a [B, H, T, S] map never leaves the device).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import ops
from diffjax.model import layer_outputs, residual

QUANTIZATION_BITS = (8, 6, 4)  # the paper's Figure 8 (16 bits: unquantized)


class LayerView(NamedTuple):
    """What one layer computed on a batch (float32 unless said otherwise)."""

    depth: int
    logits_MBHTS: jax.Array  # what each softmax sees, q k^T / sqrt(d) (quantized when asked); M = 2 maps for DIFF
    effective_BHTS: jax.Array  # the map applied to v: A1 - lambda A2 for DIFF, A for the baseline
    counted_BTS: jax.Array  # bool: key s is visible to query t and t is a real token (not padding)
    hidden_BTD: jax.Array  # the block's output (the residual stream after the layer), in the compute dtype
    real_BT: jax.Array  # bool: not padding (segment id != 0, or everything without segment ids)


def check_bits(bits) -> None:
    if not (isinstance(bits, int) and not isinstance(bits, bool) and 2 <= bits <= 16):
        raise ValueError(f"quantization bits must be an integer in [2, 16], got {bits!r}")


def absmax_quantize(values, bits, counted=True, *, scale_axis: int = 0):
    """Dynamic absmax quantization (the paper's Figure 8): values -> round(values / scale) * scale with
    scale = max |values| / (2^(bits-1) - 1), one scale per index of `scale_axis` (per sequence), taken over
    the `counted` entries only (masked logits are not data; `counted` broadcasts against values). A slice
    with no nonzero counted value is left as is. `bits` may be traced (then it is not checked here)."""
    if not isinstance(bits, jax.Array):
        check_bits(bits)
    levels = 2.0 ** (jnp.asarray(bits, jnp.float32) - 1) - 1
    reduce_axes = tuple(axis for axis in range(values.ndim) if axis != scale_axis % values.ndim)
    absmax = jnp.max(jnp.where(counted, jnp.abs(values), 0.0), axis=reduce_axes, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / levels, 1.0)
    return jnp.round(values / scale) * scale


def _quantized_logits(s_MBHTS, counted_BTS, bits):
    """One scale per sequence, over all heads and (DIFF) both maps of the layer; bits 0: unquantized."""
    return jnp.where(bits > 0, absmax_quantize(s_MBHTS, jnp.maximum(bits, 2), counted_BTS[None, :, None], scale_axis=1), s_MBHTS)


def make_probe(model, observe: Callable[[LayerView, Any], Any] | None = None):
    """A jitted `probe(tokens_BT, positions_BT=None, segment_ids_BT=None, aux=None, *, logit_bits=None) ->
    (logits_BTV, observed)` for `model` (a TransformerLM), where observed[i] = observe(LayerView of layer i,
    aux) (a pytree of arrays; keep it small: it is what comes back from the device). logit_bits: quantize
    every layer's attention logits by `absmax_quantize` before the softmax (None: unquantized); an argument
    of the compiled program, so every bit width runs the same one."""
    graphdef, state = nnx.split(model)
    config = model.config
    observe = observe or (lambda view, aux: None)
    collapse = functools.partial(residual.module_class(config).collapse, config)

    @jax.jit
    def run(state, tokens_BT, positions_BT, segment_ids_BT, aux, logit_bits):
        model = nnx.merge(graphdef, state)
        B, T = tokens_BT.shape
        real_BT = jnp.ones((B, T), bool) if segment_ids_BT is None else segment_ids_BT != 0

        def visible(depth):  # (allowed_BTS, counted_BTS)
            mask = ops.attention_mask(T, T, causal=True, segment_ids=segment_ids_BT, window=config.window_at(depth))
            allowed_BTS = jnp.broadcast_to(mask, (B, T, T))
            return allowed_BTS, allowed_BTS & real_BT[:, :, None]

        def explicit_attention(depth, attention, x_BTD, cos_sin, segment_ids, constants):
            allowed_BTS, counted_BTS = visible(depth)
            explicit = attention.explicit_maps(x_BTD, cos_sin, allowed_BTS, constants,
                                               lambda s: _quantized_logits(s, counted_BTS, logit_bits))
            return explicit.out_BTD, explicit

        def per_layer(depth, values):
            explicit = values["attention"]
            view = LayerView(depth, explicit.logits_MBHTS, explicit.effective_BHTS, visible(depth)[1],
                             collapse(values["stream"]), real_BT)
            return {"observed": observe(view, aux)}

        request = layer_outputs.Request({"attention", "stream"}, attention=explicit_attention, per_layer=per_layer)
        hidden_BTD, _, outputs = model.hidden_states(tokens_BT, positions_BT, segment_ids_BT, outputs=request)
        observed = outputs["observed"].value  # stacked over the layers
        return model.logits(hidden_BTD), [jax.tree.map(lambda x: x[i], observed) for i in range(config.num_layers)]

    def probe(tokens_BT, positions_BT=None, segment_ids_BT=None, aux=None, *, logit_bits=None):
        if logit_bits is not None:
            check_bits(logit_bits)
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, length], got {tokens_BT.shape}")
        if tokens_BT.shape[1] > config.max_seq_len:
            raise ValueError(f"sequence length {tokens_BT.shape[1]} exceeds the model's max_seq_len {config.max_seq_len}")
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        return run(state, tokens_BT, positions_BT, segment_ids_BT, aux, jnp.int32(logit_bits or 0))

    return probe


def main(argv=None) -> int:
    """This module is a library: its command line says so and names the analyses that run on it."""
    import argparse

    from diffjax import command_line

    parser = command_line.ArgumentParser(
        prog="python -m diffjax.analysis.probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="It has no command line of its own. The analyses that run on it: python -m diffjax.analysis.<name> "
               "--help, <name> one of needles, recall, attention_scores, outliers, quantization.")
    parser.parse_args(argv)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    from diffjax.command_line import run

    run(main, "python -m diffjax.analysis.probe")
