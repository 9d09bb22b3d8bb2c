from diffjax.model.attention import DiffAttention, StandardAttention
from diffjax.model.attention_v2 import DiffAttentionV2
from diffjax.model.layers import Embedding, GatedMLP, RMSNorm
from diffjax.model.shared_diff import SharedDiffAttention
from diffjax.model.transformer import DecoderBlock, TransformerLM

__all__ = [
    "DecoderBlock", "DiffAttention", "DiffAttentionV2", "Embedding", "GatedMLP", "RMSNorm", "SharedDiffAttention",
    "StandardAttention", "TransformerLM",
]
