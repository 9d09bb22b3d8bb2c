"""Benchmarks through EleutherAI's lm-evaluation-harness (`pip install -e ".[eval]"`).

`diffjax.eval.DiffjaxLM` is an `lm_eval` model registered as "diffjax": loglikelihood (multiple choice),
loglikelihood_rolling (perplexity) and generate_until (greedy or sampled, KV-cached), batched, for any
checkpoint diffjax loads (a run directory, its checkpoints/ or a step directory, a conversion, a Hugging Face
DiffLlama / Llama / Motif directory), optionally on a device mesh. The command line:

    diffjax-eval --model-path PATH --tasks hellaswag,arc_easy [--include-path DIR] [--limit N]

Importing this package loads neither lm_eval nor torch: `DiffjaxLM` imports the adapter (and lm_eval) on first
use, and registering the model name "diffjax" with lm_eval happens then.
"""

from __future__ import annotations

LM_EVAL_MISSING = "lm_eval is not installed: pip install -e \".[eval]\" (or pip install lm-eval)"


def require_lm_eval():
    """The lm_eval module, or ImportError with the install command."""
    try:
        import lm_eval
    except ImportError as error:
        raise ImportError(f"{LM_EVAL_MISSING} ({error})") from None
    return lm_eval


def __getattr__(name: str):
    if name in ("DiffjaxLM", "load_for_eval"):
        require_lm_eval()
        from diffjax.eval import lm_eval_adapter

        return getattr(lm_eval_adapter, name)
    raise AttributeError(f"module 'diffjax.eval' has no attribute {name!r}")


__all__ = ["DiffjaxLM", "load_for_eval", "require_lm_eval"]
