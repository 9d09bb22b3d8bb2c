"""The block kinds: what one layer of a parameter stack is, one row each (jax-free; diffjax.kinds says what the
tables share). Every stack of a model (diffjax.kinds.param_stacks) names its row (`Segment.block`), and the model runs
each through one stack runner (diffjax.model.transformer.TransformerLM.run_stack).
  decoder  a layer of the model: an attention kind + an MLP kind + a residual form
           (diffjax.model.transformer.DecoderBlock)
  mtp      a multi-token-prediction depth (ModelConfig.mtp_depths; DeepSeek-V3's MTP module, Motif 3's mtp_layers):
           [the previous depth's final hidden state, the normed embedding of the next token] @ input_proj, a decoder
           layer built with ModelConfig.mtp_layer_config, a final norm; it reads the model's final hidden state and
           its facet adds the depths' loss (diffjax.model.mtp)

A row counts what a layer holds and computes besides its decoder layer (the parts' rows count that), so the parameter
count, the FLOPs and the memory plan of every stack are the same sums.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from diffjax import kinds


@dataclasses.dataclass(frozen=True)
class BlockKind:
    name: str  # what Segment.block says
    label: str  # for tables and logs
    module: str | type  # "package.module:Class" of its layer (a diffjax.model.transformer.DecoderBlock subclass)
    # (the model's ModelConfig) -> parameters of one layer besides its decoder layer's
    params: Callable = lambda config: 0
    # (the model's ModelConfig) -> the parameters one token's forward multiplies by in one layer besides its decoder
    # layer's (a layer with logits of its own counts the LM head once more)
    matmul_params: Callable = lambda config: 0
    # (the model's ModelConfig) -> values per token one layer keeps for the backward besides its decoder layer's
    activation_width: Callable = lambda config: 0
    training: kinds.Training = kinds.NO_TRAINING  # its training side (a loss term, step inputs: its facet)


TABLE: kinds.Table[BlockKind] = kinds.Table("block")
register, unregister, get, names = TABLE.register, TABLE.unregister, TABLE.get, TABLE.names

register(BlockKind(name=kinds.DECODER_BLOCK, label="decoder layer", module="diffjax.model.transformer:DecoderBlock"))
register(BlockKind(
    name=kinds.MTP_BLOCK, label="multi-token-prediction depth", module="diffjax.model.mtp:PredictionBlock",
    params=lambda c: 2 * c.d_model * c.d_model + 2 * c.d_model,  # input_proj [2D, D], embed_norm and final_norm
    matmul_params=lambda c: 2 * c.d_model * c.d_model + c.d_model * c.vocab_size,  # input_proj, the LM head again
    # its input: the next tokens' embeddings (D) and [previous hidden, normed embedding] (2D); its output hidden (D)
    activation_width=lambda c: 4 * c.d_model,
    training=kinds.Training(facet="diffjax.model.mtp:PredictionLoss"),
))
