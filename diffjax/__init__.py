"""diffjax: the Differential Transformer in JAX / Flax NNX."""

from diffjax.config import ModelConfig, lambda_init_for_depth
from diffjax.losses import next_token_loss
from diffjax.model import DiffAttention, StandardAttention, TransformerLM
from diffjax.ops import diff_attention, dot_product_attention


def load_hf(path, dtype=None):
    """Load a local Hugging Face DiffLlama / Llama directory (see diffjax.convert.hf.load_hf)."""
    from diffjax.convert.hf import load_hf as _load_hf

    return _load_hf(path, dtype=dtype)


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
]
__version__ = "0.1.0"
