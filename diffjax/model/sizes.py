"""How many parameters a config's model has, and how many of them one token uses, counted from its abstract params
(jax.eval_shape: nothing is allocated, so the published sizes of large models can be counted on a laptop)."""

from __future__ import annotations

import math

from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model.transformer import TransformerLM


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token): active counts a routed-expert parameter (logical axis "expert") at top_k /
    num_experts of its size, the share of the experts one token is sent to; every other parameter in full."""
    model = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    total = active = 0
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = math.prod(param.shape)
        total += size
        options = next((s.config.mlp_options for s in model.segments() if s.name == path[0]), None)
        if "expert" in (param.get_metadata().get("logical_axes") or ()):
            size = size * options.top_k // options.num_experts
        active += size
    return total, active


def describe_parameter_counts(config: ModelConfig) -> str:
    """'314.59B parameters, 12.98B active per token (314,590,... / 12,98...)'."""
    total, active = parameter_counts(config)
    return (f"{total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
            f"({total:,} / {active:,})")
