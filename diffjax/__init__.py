"""diffjax: the Differential Transformer in JAX / Flax NNX.

Layers, each importing only those before it: config -> sharding -> ops -> model -> checkpoint ->
convert -> data, tokenizers -> train. `import diffjax` loads the first four (and the losses);
`load_hf` / `save_hf` load the converter when first used. `diffjax.generate(model, tokens, max_new_tokens)`
generates with a KV cache (the module diffjax.generate, callable).
"""

from diffjax.jax_compat import check_jax_version

check_jax_version()  # one line for a jax outside the tested range, before any kernel module loads

from diffjax import generate  # noqa: E402
from diffjax.config import ModelConfig, lambda_init_for_depth
from diffjax.losses import next_token_loss
from diffjax.model import DiffAttention, DiffAttentionV2, SharedDiffAttention, StandardAttention, TransformerLM
from diffjax.ops import diff_attention, dot_product_attention

_CONVERTER_NAMES = ("load_hf", "save_hf")


def __getattr__(name: str):
    if name in _CONVERTER_NAMES:
        from diffjax import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'diffjax' has no attribute {name!r}")


__all__ = [
    "DiffAttention",
    "DiffAttentionV2",
    "ModelConfig",
    "SharedDiffAttention",
    "StandardAttention",
    "TransformerLM",
    "diff_attention",
    "dot_product_attention",
    "generate",
    "lambda_init_for_depth",
    "load_hf",
    "next_token_loss",
    "save_hf",
]
__version__ = "0.1.0"
