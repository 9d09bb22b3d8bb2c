"""unilm V1 differential attention (`microsoft/unilm`, `Diff-Transformer/`) <-> diffjax `DiffAttention`.

A `MultiheadDiffAttn` / `MultiheadFlashDiff1` / `MultiheadFlashDiff2` state_dict holds

    q_proj.weight   (E, E)            = (2 H d, E)     rows: head h, group g (q1 = 0, q2 = 1), channel
    k_proj.weight   (2 Hkv d, E)                       rows: kv head m, group g, channel
    v_proj.weight   (2 Hkv d, E)                       rows: kv head m, 2d channels
    out_proj.weight (E, 2 H d)                         columns: head h, 2d channels
    lambda_q1, lambda_k1, lambda_q2, lambda_k2  (d,)
    subln.weight    (2d,)             absent in checkpoints made before 2024-10-25 (then: ones)

and diffjax's canonical kernels are plain transposes / reshapes of these (unilm `Diff-Transformer/multihead_diffattn.py`):
q (E, H, 2, d), k (E, Hkv, 2, d), v (E, Hkv, 2d), o (H, 2d, E). Nothing is permuted.

The module computes the *flash* GQA pairing (q group g of head h meets group g of kv head h // n_rep),
which is what diffjax computes. unilm's naive `MultiheadDiffAttn` pairs heads differently when
n_rep > 1 (its head pairing differs from the flash module's); its weights still load, but its outputs then differ from diffjax's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

import ml_dtypes
import numpy as np
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.convert.common import build_module, to_numpy
from diffjax.model.attention import DiffAttention

__all__ = ["UNILM_ATTENTION_KEYS", "load_unilm_attention", "unilm_attention_state_dict"]

LAMBDA_KEYS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
UNILM_ATTENTION_KEYS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight", *LAMBDA_KEYS, "subln.weight")
_OPTIONAL_KEYS = ("subln.weight",)

_NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def _dtype_name(dtype: np.dtype) -> str | None:
    for name, np_dtype in _NP_DTYPES.items():
        if dtype == np_dtype:
            return name
    return None


def _most_common(votes: list[int]) -> int | None:
    """The most frequent value (ties: the first one seen), or None without votes."""
    if not votes:
        return None
    counts = Counter(votes)
    best = max(counts.values())
    return next(v for v in votes if counts[v] == best)


def _infer_sizes(arrays: dict[str, np.ndarray]) -> tuple[int, int, int, int]:
    """(E, d, H, Hkv) by majority over the tensors present, so that one bad tensor gets the blame."""

    def dims(key, ndim, axis):
        a = arrays.get(key)
        return [a.shape[axis]] if a is not None and a.ndim == ndim else []

    e_votes = (
        dims("q_proj.weight", 2, 1) + dims("q_proj.weight", 2, 0) + dims("k_proj.weight", 2, 1)
        + dims("v_proj.weight", 2, 1) + dims("out_proj.weight", 2, 0) + dims("out_proj.weight", 2, 1)
    )
    d_votes = [v for key in LAMBDA_KEYS for v in dims(key, 1, 0)]
    d_votes += [v // 2 for v in dims("subln.weight", 1, 0) if v % 2 == 0]
    E, d = _most_common(e_votes), _most_common(d_votes)
    if E is None or d is None:
        raise ValueError("unilm attention state_dict: cannot infer embed_dim and head_dim (no usable tensors)")
    if d % 2 or E % (2 * d):
        raise ValueError(
            f"unilm attention state_dict: head_dim d = {d} (from the lambda vectors, e.g. lambda_q1 with shape "
            f"{tuple(arrays['lambda_q1'].shape) if 'lambda_q1' in arrays else None}) must be even and 2d must divide "
            f"embed_dim E = {E} (from q_proj.weight with shape "
            f"{tuple(arrays['q_proj.weight'].shape) if 'q_proj.weight' in arrays else None})"
        )
    H = E // (2 * d)

    def kv_heads(key):
        a = arrays.get(key)
        if a is None or a.ndim != 2 or a.shape[0] % (2 * d):
            return None
        m = a.shape[0] // (2 * d)
        return m if m > 0 and H % m == 0 else None

    K = kv_heads("k_proj.weight") or kv_heads("v_proj.weight")
    if K is None:
        k_shape = tuple(arrays["k_proj.weight"].shape) if "k_proj.weight" in arrays else None
        v_shape = tuple(arrays["v_proj.weight"].shape) if "v_proj.weight" in arrays else None
        raise ValueError(
            f"unilm attention state_dict: k_proj.weight has shape {k_shape} (v_proj.weight {v_shape}); expected "
            f"(2 * num_kv_heads * {d}, {E}) with num_kv_heads dividing num_heads = {H}"
        )
    return E, d, H, K


def _expected_shapes(E: int, d: int, H: int, K: int) -> dict[str, tuple[int, ...]]:
    return {
        "q_proj.weight": (2 * H * d, E),
        "k_proj.weight": (2 * K * d, E),
        "v_proj.weight": (2 * K * d, E),
        "out_proj.weight": (E, 2 * H * d),
        **{key: (d,) for key in LAMBDA_KEYS},
        "subln.weight": (2 * d,),
    }


def load_unilm_attention(
    state_dict: Mapping[str, Any],
    *,
    depth: int,
    prefix: str = "",
    rope_theta: float = 10000.0,
    lambda_init: float | None = None,
    norm_eps: float = 1e-5,
    dtype: str = "float32",
    param_dtype: str | None = None,
) -> DiffAttention:
    """One unilm V1 differential attention module's weights as a diffjax `DiffAttention`.

    state_dict: keys `q_proj.weight`, `k_proj.weight`, `v_proj.weight`, `out_proj.weight`, `lambda_q1`,
      `lambda_k1`, `lambda_q2`, `lambda_k2` and optionally `subln.weight` (ones when absent); values are torch
      tensors, numpy or jax arrays (float32 / bfloat16 / float16). With `prefix` (e.g.
      "layers.3.self_attn."), only keys starting with it are read and the rest of the dict is ignored.
    depth: the module's 0-based layer index (unilm's `depth`); it sets lambda_init = 0.8 - 0.6 exp(-0.3 depth)
      unless `lambda_init` overrides it.
    rope_theta: base of the standard table inv_freq_i = theta^(-2i/d) that diffjax's `rope_tables` builds
      (unilm takes caller-built tables and stores no theta).
    dtype: compute dtype of the returned layer. param_dtype: storage dtype of its parameters; None keeps the
      checkpoint's dtype when all its tensors share one, else float32 (lossless).

    Sizes are inferred: d from the lambda vectors, E from the projections, H = E / (2d), Hkv from
    k_proj.weight's rows. A missing or unexpected key or a mis-shaped tensor raises a ValueError that names
    the key, the shape found and the shape expected (all problems at once).
    """
    if not isinstance(depth, (int, np.integer)) or depth < 0:
        raise ValueError(f"depth must be a non-negative integer (0-based layer index), got {depth!r}")
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_NP_DTYPES)}, got {dtype!r}")
    if param_dtype is not None and param_dtype not in _NP_DTYPES:
        raise ValueError(f"param_dtype must be None or one of {tuple(_NP_DTYPES)}, got {param_dtype!r}")

    arrays: dict[str, np.ndarray] = {}
    unexpected: list[str] = []
    for full_key, value in state_dict.items():
        if not full_key.startswith(prefix):
            continue
        key = full_key[len(prefix):]
        if key not in UNILM_ATTENTION_KEYS:
            shape = tuple(getattr(value, "shape", ()))
            unexpected.append(
                f"unexpected key {full_key!r} (shape {shape}; expected shape: none, the key is not part of a unilm "
                f"attention module, whose keys are {', '.join(prefix + k for k in UNILM_ATTENTION_KEYS)})"
            )
            continue
        arrays[key] = to_numpy(value)

    problems: list[str] = []
    for key in UNILM_ATTENTION_KEYS:
        if key in arrays and not np.issubdtype(arrays[key].dtype, np.floating) and arrays[key].dtype != ml_dtypes.bfloat16:
            problems.append(f"{prefix + key!r} has dtype {arrays[key].dtype}; expected a floating dtype")
    if not arrays:
        raise ValueError(
            f"no unilm attention keys found under prefix {prefix!r}; expected {', '.join(prefix + k for k in UNILM_ATTENTION_KEYS)}"
            + ("; " + "; ".join(unexpected) if unexpected else "")
        )

    E, d, H, K = _infer_sizes(arrays)
    expected = _expected_shapes(E, d, H, K)
    for key, shape in expected.items():
        if key not in arrays:
            if key not in _OPTIONAL_KEYS:
                problems.append(f"missing key {prefix + key!r} (shape found: none; expected shape {shape})")
        elif tuple(arrays[key].shape) != shape:
            problems.append(f"key {prefix + key!r} has shape {tuple(arrays[key].shape)}; expected shape {shape}")
    problems += unexpected
    if problems:
        raise ValueError(
            f"invalid unilm attention state_dict (E={E}, num_heads={H}, num_kv_heads={K}, head_dim={d}): "
            + "; ".join(problems)
        )

    if param_dtype is None:
        names = {_dtype_name(a.dtype) for a in arrays.values()}
        param_dtype = names.pop() if len(names) == 1 and None not in names else "float32"
    config = ModelConfig(
        d_model=E,
        num_layers=int(depth) + 1,
        num_heads=H,
        num_kv_heads=K,
        head_dim=d,
        attention="diff",
        rope_style="interleaved",
        rope_type="default",
        rope_theta=float(rope_theta),
        lambda_init=None if lambda_init is None else float(lambda_init),
        norm_eps=float(norm_eps),
        dtype=dtype,
        param_dtype=param_dtype,
    )
    subln = arrays.get("subln.weight")
    if subln is None:
        subln = np.ones((2 * d,), dtype=np.float32)
    params = {
        ("q_kernel",): arrays["q_proj.weight"].T.reshape(E, H, 2, d),
        ("k_kernel",): arrays["k_proj.weight"].T.reshape(E, K, 2, d),
        ("v_kernel",): arrays["v_proj.weight"].T.reshape(E, K, 2 * d),
        ("o_kernel",): arrays["out_proj.weight"].T.reshape(H, 2 * d, E),
        **{(name,): arrays[name] for name in LAMBDA_KEYS},
        ("subln_scale",): subln,
    }
    return build_module(lambda: DiffAttention(config, int(depth), rngs=nnx.Rngs(0)), params, _NP_DTYPES[param_dtype])


def unilm_attention_state_dict(layer: DiffAttention, *, prefix: str = "", subln: bool = True) -> dict[str, np.ndarray]:
    """The inverse of `load_unilm_attention`: unilm state_dict entries (numpy, in the parameter dtype;
    bfloat16 as ml_dtypes.bfloat16).

    subln: True (modules since 2024-10-25) writes `subln.weight`; False is for older modules whose
    per-head norm has no weight: the scale is folded into out_proj's columns instead (exact when it
    is ones, as for every layer loaded from such a module; equal up to rounding otherwise).

    Load into PyTorch with e.g. `torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)` for bf16.
    unilm recomputes lambda_init from the module's depth, so a layer built with a lambda_init override
    does not round-trip through unilm's own module.
    """
    config = layer.config
    if config.rope_style != "interleaved":
        raise ValueError(
            f"unilm uses interleaved (GPT-J) RoPE; this layer uses rope_style={config.rope_style!r}, whose q/k "
            "channel order differs: convert through the HF path instead"
        )
    E, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    if 2 * H * d != E:
        raise ValueError(f"unilm needs d_model == 2 * num_heads * head_dim, got {E} != 2 * {H} * {d}")

    def get(name):
        return np.asarray(getattr(layer, name)[...])

    o_H2dE, scale = get("o_kernel"), get("subln_scale")
    if not subln and not np.all(scale == 1):
        # out_proj column h*2d + c multiplies head h's normed channel c: fold scale[c] into it.
        o_H2dE = (o_H2dE.astype(np.float32) * scale.astype(np.float32)[None, :, None]).astype(o_H2dE.dtype)
    out = {
        "q_proj.weight": get("q_kernel").reshape(E, 2 * H * d).T,
        "k_proj.weight": get("k_kernel").reshape(E, 2 * K * d).T,
        "v_proj.weight": get("v_kernel").reshape(E, 2 * K * d).T,
        "out_proj.weight": o_H2dE.reshape(2 * H * d, E).T,
        **{name: get(name) for name in LAMBDA_KEYS},
    }
    if subln:
        out["subln.weight"] = scale
    return {prefix + key: np.ascontiguousarray(value) for key, value in out.items()}
