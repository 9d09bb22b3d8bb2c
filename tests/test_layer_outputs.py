"""The per-layer output channel (diffjax.model.layer_outputs): a forward returns what its layers emitted and it was
asked for, stacked over the layers that emitted it, beside the cache; the streams it hands out are the layers' own
(checked against each layer run standalone), asking changes no result, and micro-batches combine by each value's
reduction."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model import TransformerLM, layer_outputs, residual
from diffjax.model.kv_cache import KVCache
from diffjax.model.layer_outputs import Emitted, Request
from diffjax.model.rope import layer_rope_tables

CONFIG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, mlp_dim=48, max_seq_len=16,
                     attention_window=4, global_layers=(1,), mlp="moe",
                     mlp_options=dict(num_experts=4, top_k=2, expert_inner=16, dense_first_layers=1))
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
ALL = Request({"stream", "attention_input", "router"})


@pytest.fixture(scope="module")
def model():
    return TransformerLM(CONFIG, rngs=nnx.Rngs(0))


def _standalone(model):
    """Each layer's normed attention input and output stream, the layers run one at a time standalone."""
    rope = layer_rope_tables(CONFIG, jnp.broadcast_to(jnp.arange(9), TOKENS.shape), jnp.float32)
    form = residual.module_class(CONFIG)
    stream, inputs, streams = form.expand(CONFIG, model.embed(TOKENS, jnp.float32)), [], []
    for depth in range(CONFIG.num_layers):
        layer = model.layer(depth)
        inputs.append(layer.attn_norm(stream))
        stream = layer(stream, rope)
        streams.append(stream)
    return jnp.stack(inputs), jnp.stack(streams)


def test_the_streams_and_attention_inputs_are_each_layer_s_own(model):
    """Against the layers run one at a time, standalone (TransformerLM.layer): each layer's output stream and the
    normed input its attention read; the MoE's router statistics only from its layer (1, the second segment),
    counting every (token, choice) pair."""
    out, (inputs, streams) = nnx.jit(lambda m: (m.hidden_states(TOKENS, outputs=ALL), _standalone(m)))(model)
    hidden_BTD, cache, out = out
    assert cache is None and set(out) == set(ALL.names)
    assert out["stream"].layers == out["attention_input"].layers == (0, 1) and out["router"].layers == (1,)
    np.testing.assert_allclose(out["attention_input"].value, inputs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["stream"].value, streams, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["router"].value["tokens"].sum(-1), [2 * 9 * 2])
    assert out["router"].reduction == "sum" and out["stream"].reduction == "stack"


@pytest.mark.slow
def test_asking_changes_no_result_and_a_scan_hands_out_the_same(model):
    forward = nnx.jit(lambda m, request: m.hidden_states(TOKENS, outputs=request), static_argnums=1)
    hidden_BTD, _, out = forward(model, ALL)
    plain_BTD, _, nothing = forward(model, layer_outputs.NOTHING)
    assert nothing == {}
    np.testing.assert_array_equal(hidden_BTD, plain_BTD)
    scanned = nnx.merge(nnx.graphdef(TransformerLM(CONFIG.replace(scan_layers=True), rngs=nnx.Rngs(0))),
                        nnx.state(model))
    scanned_BTD, _, scanned_out = forward(scanned, ALL)
    np.testing.assert_allclose(scanned_BTD, hidden_BTD, rtol=1e-5, atol=1e-6)
    for name, emitted in out.items():
        assert scanned_out[name].layers == emitted.layers
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), scanned_out[name].value,
                     emitted.value)


def test_outputs_beside_a_cache_and_errors(model):
    _, cache, out = model.hidden_states(TOKENS, cache=KVCache.empty(2, 16), outputs=Request({"stream"}))
    assert out["stream"].value.shape == (2, 2, 9, 32) and out["stream"].layers == (0, 1)
    np.testing.assert_array_equal(cache.lengths_B, [9, 9])
    with pytest.raises(ValueError, match="keeps no KVCache: pass no cache"):
        model.hidden_states(TOKENS, cache=KVCache.empty(2, 16), outputs=Request(attention=lambda *args: None))
    with pytest.raises(ValueError, match=re.escape("layer output 'x': reduction must be one of ('sum', 'max', "
                                                   "'stack'), got 'mean'")):
        layer_outputs.emit("x", lambda: 0, "mean")


def test_micro_batches_combine_by_each_reduction():
    calls = {"sum": Emitted(jnp.asarray([[1, 2], [3, 5]]), "sum", (0, 1)),
             "max": Emitted({"m": jnp.asarray([[1, 7], [3, 5]])}, "max", (2, 4)),
             "stack": Emitted(jnp.asarray([[1, 2], [3, 5]]), "stack", (0, 1))}
    combined = layer_outputs.combine(calls)
    np.testing.assert_array_equal(combined["sum"].value, [4, 7])
    np.testing.assert_array_equal(combined["max"].value["m"], [3, 7])
    np.testing.assert_array_equal(combined["stack"].value, [[1, 2], [3, 5]])
    assert combined["max"].layers == (2, 4)
