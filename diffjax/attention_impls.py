"""The attention impl names and what a model config may ask of them, without jax: ModelConfig checks
`attention_impl` here, so building a config loads no jax. Which impl runs a call, and how, is diffjax.ops'
(choice.py chooses; the ops dispatch)."""

from __future__ import annotations

from diffjax.config_values import one_of

IMPLS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "splash", "cudnn", "triton")  # ModelConfig.attention_impl


def config_problems(impl: str, dtype: str) -> list[str]:
    """What is wrong with running `impl` at a model's compute dtype (ModelConfig checks this at
    construction, before anything is traced)."""
    if impl not in IMPLS:
        return [one_of("attention_impl", impl, IMPLS)]
    if impl == "pallas_gpu" and dtype not in ("bfloat16", "float16"):
        return [f"attention_impl 'pallas_gpu' (the fused Mosaic GPU kernels) needs dtype bfloat16 or float16, got "
                f"dtype {dtype!r} (use 'cudnn', 'triton', 'xla' or 'auto' otherwise)"]
    return []
