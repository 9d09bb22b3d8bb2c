"""How many parameters a config's model has, how many of them one token uses, and the shapes of its attention calls,
from its abstract params and modules (jax.eval_shape: nothing is allocated, so the published sizes of large models
can be counted on a laptop)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import attention_kinds, mlp_kinds
from diffjax.config import ModelConfig
from diffjax.model.attention import module_class
from diffjax.model.rope import inv_frequencies, rope_tables
from diffjax.model.transformer import REMAT_SAVES, TransformerLM
from diffjax.ops.choice import AttentionCall


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token): active counts a routed-expert parameter (logical axis "expert") at the share of the
    experts one token is sent to (its MLP kind's expert_share: top_k / num_experts); every other parameter in full."""
    model = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    stacks = {segment.name: segment.config for segment in model.stacks()}
    total = active = 0
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = math.prod(param.shape)
        total += size
        if "expert" in (param.get_metadata().get("logical_axes") or ()):
            stack = stacks[path[0]]
            used, of = mlp_kinds.get(stack.mlp).expert_share(stack)
            size = size * used // of
        active += size
    return total, active


def describe_parameter_counts(config: ModelConfig) -> str:
    """'314.59B parameters, 12.98B active per token (314,590,... / 12,98...)'."""
    total, active = parameter_counts(config)
    return (f"{total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
            f"({total:,} / {active:,})")


def attention_calls(config, seq_len: int, context: int = 1) -> list[tuple[str, AttentionCall]]:
    """(what, call) for a model config's training step (under a context axis of `context`), prefill and decode step,
    shapes by abstract evaluation."""
    op = attention_kinds.get(config.attention).attention_op
    dtype = jnp.dtype(config.dtype)
    module = nnx.eval_shape(lambda: module_class(config)(config, 0, rngs=nnx.Rngs(0)))

    def shapes(T):
        x = jax.ShapeDtypeStruct((1, T, config.d_model), dtype)
        positions = jax.ShapeDtypeStruct((1, T), jnp.int32)
        rope = jax.eval_shape(lambda p: rope_tables(p, inv_frequencies(config), dtype), positions)
        return nnx.eval_shape(lambda m, x, r: m.project(x, r), module, x, rope)

    q, k, v = shapes(seq_len)
    q1, k1, v1 = shapes(1)
    S = config.max_seq_len  # the cache's slots
    cache = lambda x: (1, S) + tuple(x.shape[2:])  # noqa: E731
    # Windowed layers and global layers make different calls (the decode step folds the window into its mask).
    windows = sorted({config.window_at(depth) for depth in range(config.num_layers)}, key=lambda w: w or 0)
    calls = []
    for window in windows:
        layers = "" if len(windows) == 1 else " (global layers)" if window is None else " (windowed layers)"
        calls += [
            (f"train step (packed rows){layers}",
             AttentionCall(op, q.shape, k.shape, v.shape, dtype.name, True, "one", window, context,
                           REMAT_SAVES[config.remat])),
            (f"generation prefill{layers}", AttentionCall(op, q.shape, k.shape, v.shape, dtype.name, True, None, window)),
        ]
    return calls + [("generation decode step", AttentionCall(op, q1.shape, cache(k1), cache(v1), dtype.name, False, "pair"))]
