"""The residual forms: how a decoder block's two sublayers join the residual stream, one row each (jax-free;
diffjax.kinds says what the tables share). A form is a row here plus one module (a subclass of
`diffjax.model.residual.ResidualForm`: the stream's shape, how a sublayer reads it and writes back to it, and
how the model's embedding becomes a stream and a stream the final hidden state). "plain" is the pre-norm
Transformer's x + sublayer(norm(x)); hyper-connections (several streams mixed around each sublayer) are the next.
"""

from __future__ import annotations

from diffjax import kinds

ResidualKind = kinds.PartKind  # a row: name, label, module, params and matmul_params (default 0), options

TABLE: kinds.Table[ResidualKind] = kinds.Table("residual")
register, unregister, get, names = TABLE.register, TABLE.unregister, TABLE.get, TABLE.names

register(ResidualKind(name="plain", label="residual", module="diffjax.model.residual:PlainResidual"))
