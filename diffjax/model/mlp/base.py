"""What every MLP kind's module is (diffjax.mlp_kinds is the table of kinds)."""

from __future__ import annotations

from flax import nnx


class MLPModule(nnx.Module):
    """The second sublayer of a decoder block: `__init__(config, depth=None, *, rngs)` makes its parameters (depth:
    the layer's 0-based index, None in a stack), `__call__(x_BTD) -> y_BTD` in x's dtype. Parameters carry logical
    axis names (diffjax.model.layers.normal_param) so that the sharding rules place them."""

    def __call__(self, x_BTD):
        raise NotImplementedError
