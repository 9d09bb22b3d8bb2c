"""A pretrained Transformer -> a DIFF model that computes the same function at step 0 (upcycling), to train on.

Source: a model of attention "standard" (a Hugging Face Llama directory through load_hf, or a diffjax run). The
DIFF model keeps every other weight and each head's q, k, v and o, and adds the second map so that the
difference leaves the output unchanged until training moves it:

  DIFF V2 (attention "diff_v2"; h = the source's heads, d its head_dim), second_map "mirror":
      q2 = q1 (the second map equals the first), W_lambda = 0 (lambda = sigmoid(0) = 1/2 for every token),
      o = 2 o_source:  out = 2 o (A1 v - A1 v / 2) = o A1 v, exactly the source (powers of two: no rounding).
  DIFF V1 (attention "diff"; H = the source's heads, d its head_dim, subln=false: a per-head norm would change
      the function; values 2d wide): k1 = k2 = k, v = [v | new], o = [c o ; 0] (the new value half enters through
      zero rows of o: it starts silent and trains), lambda_q1 = lambda_q2 and lambda_k1 = lambda_k2 (random: lambda
      = lambda_init exactly, and lambda's vectors have gradients), then per second_map:
      "mirror"      q2 = q1: out = (1 - lambda_init) (1 - lambda) A1 v, c = 1 / (1 - lambda_init)^2; any lambda_init
      "zero_query"  q2 = 0 (a uniform second map, the axolotl plugin's zero init): needs lambda_init = 0, then c = 1
Every new parameter has a gradient from the first step (q2 through -lambda A2 v, lambda through A2 v, o's new rows
through the new values). A zero-query second map cannot leave V2's output unchanged (its lambda is a sigmoid).

lambda_warmup: the model is made for training with optim.lambda_warmup_steps > 0, which scales lambda by 0 at the
first step: the second map is silent there whatever it is, so either second map, any lambda_init and V2's zero query
start as the source, with o scaled for the silent second map (V1: c = 1 / (1 - lambda_init); V2: o unchanged). Outside
such a trainer (full lambda) this model is not the source until it has trained: upcycle_directory writes the warm-up
into its config.yaml.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError, build_module, refuse_overlap
from diffjax.kinds import FIRST_SEGMENT
from diffjax.model.transformer import TransformerLM

KINDS = ("diff", "diff_v2")
SECOND_MAPS = ("mirror", "zero_query")


def upcycled_config(source: ModelConfig, kind: str = "diff", *, lambda_init: float | None = None) -> ModelConfig:
    """The DIFF config an upcycled `source` gets: the same model with `kind`'s attention over the same heads."""
    if source.attention != "standard":
        raise ConversionError(f"upcycle: the source must be a Transformer (attention 'standard', e.g. a Llama), "
                              f"got attention {source.attention!r}")
    if kind not in KINDS:
        raise ConversionError(f"upcycle: kind must be one of {KINDS}, got {kind!r}")
    heads = dict(num_heads=source.num_heads, num_kv_heads=source.num_kv_heads, head_dim=source.head_dim)
    if kind == "diff_v2":
        if lambda_init is not None:
            raise ConversionError("upcycle: lambda_init applies to kind 'diff' (V2's lambda has no lambda_init)")
        return source.replace(attention=kind, **heads)
    return source.replace(attention=kind, subln=False, lambda_init=lambda_init, **heads)


def upcycle(model: TransformerLM, kind: str = "diff", second_map: str = "mirror", *, lambda_init: float | None = None,
            seed: int = 0, lambda_warmup: bool = False) -> TransformerLM:
    """`model` (a Transformer) as a DIFF model of `kind` computing the same logits (module docstring): at full lambda,
    or with lambda_warmup at lambda x 0 (the first step of a lambda warm-up). lambda_init: V1's (None: the depth
    schedule); seed: the draws of V1's new value half and lambda vectors."""
    if second_map not in SECOND_MAPS:
        raise ConversionError(f"upcycle: second_map must be one of {SECOND_MAPS}, got {second_map!r}")
    config = upcycled_config(model.config, kind, lambda_init=lambda_init)
    params = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    attn = (FIRST_SEGMENT, "attn")  # (a model of one segment)
    q_LDHd, o_LHdD = params.pop(attn + ("q_kernel",)), params.pop(attn + ("o_kernel",))
    dtype, (L, D, H, d) = q_LDHd.dtype, q_LDHd.shape
    second_q = q_LDHd if second_map == "mirror" else np.zeros_like(q_LDHd)
    if kind == "diff_v2":
        if second_map != "mirror" and not lambda_warmup:
            raise ConversionError("upcycle: kind 'diff_v2' starts as the source with second_map 'mirror' only "
                                  "(its lambda is a sigmoid, never 0), or with lambda_warmup")
        params[attn + ("q_kernel",)] = np.stack([q_LDHd, second_q], axis=3)  # (L, D, H, 2, d): both maps' queries
        params[attn + ("o_kernel",)] = o_LHdD if lambda_warmup else o_LHdD * np.asarray(2, dtype)
        params[attn + ("lambda_kernel",)] = np.zeros((L, D, H), dtype)
    else:
        lambda_inits = np.array([config.lambda_init_at(depth) for depth in range(L)])
        if second_map == "zero_query" and np.any(lambda_inits != 0) and not lambda_warmup:
            raise ConversionError("upcycle: second_map 'zero_query' starts as the source only with lambda_init 0 "
                                  "(lambda = 0 silences its uniform second map); pass lambda_init=0.0, use 'mirror', "
                                  "or upcycle for a lambda warm-up")
        if lambda_warmup:  # out = (1 - lambda_init) A1 v at the warm-up's first step
            scale = 1 / (1 - lambda_inits)
        else:  # out = (1 - lambda_init) (1 - lambda) A1 v (mirror), (1 - 0) A1 v (zero query)
            scale = 1 / (1 - lambda_inits) ** 2 if second_map == "mirror" else np.ones(L)
        rng = np.random.default_rng(seed)
        k_LDKd, v_LDKd = params.pop(attn + ("k_kernel",)), params.pop(attn + ("v_kernel",))
        params[attn + ("q_kernel",)] = np.stack([q_LDHd, second_q], axis=3)
        params[attn + ("k_kernel",)] = np.stack([k_LDKd, k_LDKd], axis=3)
        new_values = rng.normal(0, config.init_std, v_LDKd.shape).astype(dtype)
        params[attn + ("v_kernel",)] = np.concatenate([v_LDKd, new_values], axis=-1)
        scaled_o = (o_LHdD.astype(np.float64) * scale[:, None, None, None]).astype(dtype)
        params[attn + ("o_kernel",)] = np.concatenate([scaled_o, np.zeros_like(o_LHdD)], axis=2)
        for member in ("q", "k"):
            vector = rng.normal(0, config.lambda_std, (L, d)).astype(dtype)
            params[attn + (f"lambda_{member}1",)] = params[attn + (f"lambda_{member}2",)] = vector
    return build_module(lambda: TransformerLM(config, rngs=nnx.Rngs(0)), params, config.param_dtype)


def upcycle_directory(src, dst, *, kind: str = "diff", second_map: str = "mirror", lambda_init: float | None = None,
                      seed: int = 0, lambda_warmup_steps: int = 0, overwrite: bool = False,
                      revision: str | None = None) -> Path:
    """Upcycle the Transformer in `src` (an HF Llama directory or Hub name at `revision`, or a diffjax run directory
    or checkpoint) into the diffjax run directory `dst` (a params-only checkpoint: train on with train.run_dir, or
    train.init_from).
    An HF source's files but its weights are kept in DST/hf/ (as hf-to-diffjax keeps them). lambda_warmup_steps > 0:
    upcycled for a lambda warm-up (upcycle's lambda_warmup), written as optim.lambda_warmup_steps into DST's
    config.yaml. Returns the step directory."""
    from diffjax.convert.hf import load_hf
    from diffjax.convert.conversion_dir import conversion_run_dir, keep_hf_files
    from diffjax.convert.hub import resolve
    from diffjax.params_checkpoint import load_model, save_params

    if (resolved := resolve(src, revision=revision)) != src:
        refuse_overlap(resolved, dst)  # a Hub name's snapshot (the CLI checks the name only)
    src = resolved
    from_hf = (Path(src) / "config.json").is_file()
    source = load_hf(src) if from_hf else load_model(src, what="upcycle source")
    if not (isinstance(lambda_warmup_steps, int) and lambda_warmup_steps >= 0):
        raise ConversionError(f"upcycle: lambda_warmup_steps must be an integer >= 0, got {lambda_warmup_steps!r}")
    model = upcycle(source, kind, second_map, lambda_init=lambda_init, seed=seed, lambda_warmup=lambda_warmup_steps > 0)
    with conversion_run_dir(dst, overwrite=overwrite, command="upcycle") as run:
        data = keep_hf_files(src, run) if from_hf else None
        optim = {"lambda_warmup_steps": lambda_warmup_steps} if lambda_warmup_steps else None
        return save_params(run.path, nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.config, data=data, optim=optim)
