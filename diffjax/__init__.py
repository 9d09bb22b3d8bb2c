"""diffjax: the Differential Transformer in JAX / Flax NNX."""

from diffjax.config import ModelConfig, lambda_init_for_depth
from diffjax.convert import load_hf, save_hf
from diffjax.losses import next_token_loss
from diffjax.model import DiffAttention, StandardAttention, TransformerLM
from diffjax.ops import diff_attention, dot_product_attention


__all__ = [
    "DiffAttention",
    "ModelConfig",
    "StandardAttention",
    "TransformerLM",
    "diff_attention",
    "dot_product_attention",
    "lambda_init_for_depth",
    "load_hf",
    "next_token_loss",
    "save_hf",
]
__version__ = "0.1.0"
