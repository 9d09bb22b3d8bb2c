from diffjax.model.attention import (
    AttentionModule,
    DiffAttention,
    DiffAttentionV2,
    SharedDiffAttention,
    StandardAttention,
)
from diffjax.model.layers import Embedding, RMSNorm
from diffjax.model.mlp import GatedMLP, MLPModule
from diffjax.model.residual import PlainResidual, ResidualForm
from diffjax.model.transformer import DecoderBlock, TransformerLM

__all__ = [
    "AttentionModule", "DecoderBlock", "DiffAttention", "DiffAttentionV2", "Embedding", "GatedMLP", "MLPModule",
    "PlainResidual", "RMSNorm", "ResidualForm", "SharedDiffAttention", "StandardAttention", "TransformerLM",
]
