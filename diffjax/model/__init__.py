from diffjax.model.attention import DiffAttention, StandardAttention
from diffjax.model.layers import Embedding, GatedMLP, RMSNorm
from diffjax.model.transformer import DecoderBlock, TransformerLM

__all__ = ["DecoderBlock", "DiffAttention", "Embedding", "GatedMLP", "RMSNorm", "StandardAttention", "TransformerLM"]
