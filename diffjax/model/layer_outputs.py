"""One per-layer output channel: the named arrays a decoder layer hands out besides its residual stream.

A layer (its block, or a kind's module inside it) `emit`s named values; a forward returns those it was asked for
(`Request.names`) stacked over the layers that emitted them, in layer order, beside the KV cache
(TransformerLM.hidden_states). A value nobody asked for is never computed (emit takes a function), so a forward
asked for nothing is the same program as one without the channel. Each value states its reduction, how the values
of several calls on parts of one batch (the trainer's micro-batches) combine (`combine`): "sum" (a sum over the
call's tokens, such as the MoE router's counts; under jit a call sees the global batch, so the devices are summed
already), "max", or "stack" (one per call).

Names the decoder block emits: "stream" (the residual stream after the layer: [B, T, D], mHC's [B, T, E, D]),
"attention_input" (the normed x the attention reads) and "attention" (what a Request's attention returned beside
its output); kinds emit their own (the MoE's "router": diffjax.model.mlp.router.routing_stats), and so do blocks
(each MTP depth's final hidden state: diffjax.model.mtp.PREDICTION). Every stack's layers emit
(TransformerLM.run_stack), the MTP depths' numbered on from the model's.

A Request may also run a function in place of each layer's attention (the analyses' explicit maps) and reduce each
layer's values as soon as the layer has made them (`per_layer`: a [B, H, T, S] map never outlives its layer); with
either, the layers run one by one in a Python loop, so they are given the layer's depth as a Python int.

The values are gathered at trace time: the stack opens a `Layer` inside each layer's (checkpointed, scanned) call
and returns what was emitted as that call's outputs, so they leave the forward like any other array.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

REDUCTIONS = ("sum", "max", "stack")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Emitted:
    """One name's values: `value`'s leaves are stacked over `layers` (the model's 0-based layer indices, in order)."""

    value: Any
    reduction: str = dataclasses.field(metadata=dict(static=True))
    layers: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class Request:
    """What a forward is asked to hand out. names: the emitted values to return. attention: (depth, the layer's
    attention module, x_BTD, rope_cos_sin, segment_ids, constants) -> (y_BTD, aux), run in place of each layer's
    own attention, aux emitted as "attention". per_layer: (depth, {name: the layer's value}) -> {name: what to return
    for the layer} (reduction "stack"), called as each layer finishes."""

    names: frozenset[str] = frozenset()
    attention: Callable | None = None
    per_layer: Callable | None = None

    def __post_init__(self):
        object.__setattr__(self, "names", frozenset(self.names))

    @property
    def layer_by_layer(self) -> bool:
        """The layers must run one by one (a Python loop), each given its depth."""
        return self.attention is not None or self.per_layer is not None


NOTHING = Request()
_CURRENT: contextvars.ContextVar[Layer | None] = contextvars.ContextVar("layer_outputs", default=None)


class Layer:
    """The layer being traced (a context manager the stack opens around one layer's call): what it emits for
    `request`; depth is a Python int when the request runs the layers one by one, else None."""

    def __init__(self, request: Request, depth: int | None):
        self.request, self.depth, self.values = request, depth, {}

    def __enter__(self) -> Layer:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _CURRENT.reset(self._token)

    def outputs(self) -> dict[str, Emitted]:
        """What the layer emitted ({name: Emitted of one layer, layers not set yet}), per_layer applied."""
        if self.request.per_layer is not None:
            kept = self.request.per_layer(self.depth, {name: value for name, (value, _) in self.values.items()})
            return {name: Emitted(value, "stack") for name, value in kept.items()}
        return {name: Emitted(value, reduction) for name, (value, reduction) in self.values.items()}


def emit(name: str, value_fn: Callable[[], Any], reduction: str) -> None:
    """Hand `value_fn()` (a pytree of arrays) out of the layer being run under `name` when the forward was asked
    for it; value_fn is not called otherwise. reduction: one of REDUCTIONS (module docstring)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"layer output {name!r}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    layer = _CURRENT.get()
    if layer is not None and name in layer.request.names:
        layer.values[name] = (value_fn(), reduction)


def attention_in_place() -> Callable | None:
    """The request's attention for the layer being run, (module, x_BTD, rope_cos_sin, segment_ids, constants) ->
    (y_BTD, None) with its aux emitted as "attention"; None: the layer runs its own."""
    layer = _CURRENT.get()
    if layer is None or layer.request.attention is None:
        return None

    def attention(module, x_BTD, rope_cos_sin, segment_ids, constants):
        y_BTD, aux = layer.request.attention(layer.depth, module, x_BTD, rope_cos_sin, segment_ids, constants)
        emit("attention", lambda: aux, "stack")
        return y_BTD, None

    return attention


def stacked(per_layer: list[dict[str, Emitted]], start: int) -> dict[str, Emitted]:
    """One dict of outputs from those of consecutive layers from `start` (a Python loop's): leaves stacked."""
    if not per_layer or not per_layer[0]:
        return {}
    return over_layers(jax.tree.map(lambda *layers: jnp.stack(layers), *per_layer), start, len(per_layer))


def over_layers(outputs: dict[str, Emitted], start: int, count: int) -> dict[str, Emitted]:
    """Outputs whose leaves are stacked over layers start..start + count - 1 (a scan's), marked so."""
    return {name: dataclasses.replace(out, layers=tuple(range(start, start + count))) for name, out in outputs.items()}


def joined(parts: list[dict[str, Emitted]]) -> dict[str, Emitted]:
    """The outputs of consecutive runs of layers (a model's segments) as one: each name's values concatenated
    over the runs that emitted it."""
    joined_outputs = {}
    for name in dict.fromkeys(name for part in parts for name in part):
        outs = [part[name] for part in parts if name in part]
        value = jax.tree.map(lambda *values: jnp.concatenate(values), *(out.value for out in outs))
        joined_outputs[name] = Emitted(value, outs[0].reduction, sum((out.layers for out in outs), ()))
    return joined_outputs


def combine(outputs: dict[str, Emitted]) -> dict[str, Emitted]:
    """Outputs of several calls stacked on a leading axis (a scan over micro-batches) combined by their
    reductions: summed, maxed, or left stacked ("stack")."""
    reduce = {"sum": lambda x: jnp.sum(x, axis=0), "max": lambda x: jnp.max(x, axis=0), "stack": lambda x: x}
    return {name: dataclasses.replace(out, value=jax.tree.map(reduce[out.reduction], out.value))
            for name, out in outputs.items()}
