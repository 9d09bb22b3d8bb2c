"""diffjax: the Differential Transformer in JAX / Flax NNX.

Layers, each importing only those before it (tests/test_layering.py): config and the tables of kinds -> sharding ->
ops -> model -> checkpoint -> convert -> tokenizers -> data -> train -> eval, analysis, CLIs. The package face is
lazy: `import diffjax` (and `import diffjax.config` / `diffjax.ops`, which import it first) loads only the jax
version check; `diffjax.TransformerLM`, `diffjax.generate(model, tokens, max_new_tokens)` (the module
diffjax.generate, callable), `diffjax.load_hf` ... import their module when first used.
"""

from diffjax.jax_compat import check_jax_version

check_jax_version()  # one line for a jax outside the tested range, before any kernel module loads

# name -> the module that defines it (imported on first access)
_EXPORTS = {
    "ModelConfig": "diffjax.config", "lambda_init_for_depth": "diffjax.config",
    "next_token_loss": "diffjax.losses",
    "AttentionModule": "diffjax.model", "DiffAttention": "diffjax.model", "DiffAttentionV2": "diffjax.model",
    "SharedDiffAttention": "diffjax.model", "StandardAttention": "diffjax.model", "TransformerLM": "diffjax.model",
    "diff_attention": "diffjax.ops", "dot_product_attention": "diffjax.ops",
    "load_hf": "diffjax.convert", "save_hf": "diffjax.convert",
}


def __getattr__(name: str):
    import importlib

    if name == "generate":  # the module itself (callable)
        return importlib.import_module("diffjax.generate")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'diffjax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | {"generate"})


__all__ = sorted([*_EXPORTS, "generate"])
__version__ = "0.1.0"
