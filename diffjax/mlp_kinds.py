"""The MLP kinds: the second half of a decoder block, one row each (jax-free; diffjax.kinds says what the tables
share). A kind is a row here plus one module (a subclass of `diffjax.model.mlp.MLPModule`: `__init__(config,
depth=None, *, rngs)` makes its parameters, `__call__(x_BTD) -> y_BTD`). To add one:

    mlp_kinds.register(MLPKind(name="my_mlp", label="My MLP", module="my_package.my_module:MyMLP",
                               params=lambda config: ..., matmul_params=lambda config: ...))

then `ModelConfig(mlp="my_mlp")` trains, resumes, saves and generates like the built-in kind. What the row's
formulas count is checked against the built model (tests/test_block_kinds.py).
"""

from __future__ import annotations

from diffjax import kinds

MLPKind = kinds.PartKind  # a row: name, label, module, params, matmul_params, options

TABLE: kinds.Table[MLPKind] = kinds.Table("mlp")
register, unregister, get, names = TABLE.register, TABLE.unregister, TABLE.get, TABLE.names


def _polynorm_params(c) -> int:
    return 4 if c.activation == "polynorm" else 0  # PolyNorm's 3 weights and bias (vectors: in no matmul)


register(MLPKind(
    # down(act(x gate) * (x up)): SwiGLU with activation "silu"; Llama's, DiffLlama's and Motif's MLP
    name="gated", label="gated MLP", module="diffjax.model.mlp.gated:GatedMLP",
    params=lambda c: 3 * c.d_model * c.mlp_dim + _polynorm_params(c), matmul_params=lambda c: 3 * c.d_model * c.mlp_dim,
))
