from diffjax.model.attention import (
    AttentionModule,
    DiffAttention,
    DiffAttentionV2,
    SharedDiffAttention,
    StandardAttention,
)
from diffjax.model.layers import Embedding, GatedMLP, RMSNorm
from diffjax.model.transformer import DecoderBlock, TransformerLM

__all__ = [
    "AttentionModule", "DecoderBlock", "DiffAttention", "DiffAttentionV2", "Embedding", "GatedMLP", "RMSNorm", "SharedDiffAttention",
    "StandardAttention", "TransformerLM",
]
