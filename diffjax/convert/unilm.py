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

A V2 `MultiheadFlashDiffV2` state_dict (`Diff-Transformer/Diff-Transformer-V2/`, use_diff_v2=True) holds

    q_proj.weight      (2 h d, E)     rows: pair j, member g (query head 2j + g), channel
    k_proj.weight      (Hkv d, E)     v_proj.weight (Hkv d, E)
    o_proj.weight      (E, h d)       lambda_proj.weight (h, E)

and loads into `DiffAttentionV2`: q (E, h, 2, d), k and v (E, Hkv, d), o (h, d, E), lambda (E, h). The variant
is recognised from the keys (`out_proj` and the lambda vectors: V1; `o_proj` and `lambda_proj`: V2).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Mapping

import ml_dtypes
import numpy as np
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.convert.common import build_module, to_numpy
from diffjax import attention_kinds
from diffjax.model.attention import DiffAttention, DiffAttentionV2

__all__ = ["UNILM_ATTENTION_KEYS", "UNILM_V2_ATTENTION_KEYS", "load_unilm_attention", "unilm_attention_state_dict"]

LAMBDA_KEYS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
UNILM_ATTENTION_KEYS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight", *LAMBDA_KEYS, "subln.weight")
V1_MODULE, V2_MODULE = "MultiheadFlashDiff1", "MultiheadFlashDiffV2"
MODULES = {V1_MODULE: "diff", V2_MODULE: "diff_v2"}  # unilm's module classes -> the attention kind each loads as
UNILM_V2_ATTENTION_KEYS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "lambda_proj.weight")
_OPTIONAL_KEYS = ("subln.weight",)
# Keys only one variant has: a state_dict is the variant whose own keys it holds more of.
_VARIANT_KEYS = {
    "V1": set(UNILM_ATTENTION_KEYS) - set(UNILM_V2_ATTENTION_KEYS),
    "V2": set(UNILM_V2_ATTENTION_KEYS) - set(UNILM_ATTENTION_KEYS),
}

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


def _dims(arrays: dict[str, np.ndarray], key: str, ndim: int, axis: int) -> list[int]:
    """[size of `axis`] of arrays[key] when it exists with `ndim` dimensions, else [] (one vote)."""
    a = arrays.get(key)
    return [a.shape[axis]] if a is not None and a.ndim == ndim else []


def _shape(arrays, key):
    return tuple(arrays[key].shape) if key in arrays else None


def _infer_sizes(arrays: dict[str, np.ndarray]) -> tuple[int, int, int, int]:
    """V1: (E, d, H, Hkv) by majority over the tensors present, so that one bad tensor gets the blame."""
    dims = functools.partial(_dims, arrays)
    e_votes = (
        dims("q_proj.weight", 2, 1) + dims("q_proj.weight", 2, 0) + dims("k_proj.weight", 2, 1)
        + dims("v_proj.weight", 2, 1) + dims("out_proj.weight", 2, 0) + dims("out_proj.weight", 2, 1)
    )
    d_votes = [v for key in LAMBDA_KEYS for v in dims(key, 1, 0)]
    d_votes += [v // 2 for v in dims("subln.weight", 1, 0) if v % 2 == 0]
    E, d = _most_common(e_votes), _most_common(d_votes)
    if E is None or d is None:
        raise ValueError(
            "unilm V1 attention state_dict: cannot infer embed_dim and head_dim: they come from the projections "
            f"and from {', '.join(LAMBDA_KEYS)} or subln.weight; keys found: {sorted(arrays)}"
        )
    if d % 2 or E % (2 * d):
        raise ValueError(
            f"unilm attention state_dict: head_dim d = {d} (from the lambda vectors, e.g. lambda_q1 with shape "
            f"{_shape(arrays, 'lambda_q1')}) must be even and 2d must divide "
            f"embed_dim E = {E} (from q_proj.weight with shape {_shape(arrays, 'q_proj.weight')})"
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
        raise ValueError(
            f"unilm attention state_dict: k_proj.weight has shape {_shape(arrays, 'k_proj.weight')} (v_proj.weight "
            f"{_shape(arrays, 'v_proj.weight')}); expected (2 * num_kv_heads * {d}, {E}) with num_kv_heads dividing num_heads = {H}"
        )
    return E, d, H, K


def _infer_v2_sizes(arrays: dict[str, np.ndarray]) -> tuple[int, int, int, int]:
    """V2: (E, d, h, Hkv); h only from lambda_proj.weight (q, o, k and v give h d and Hkv d, not h and d)."""
    dims = functools.partial(_dims, arrays)
    E = _most_common(
        dims("q_proj.weight", 2, 1) + dims("k_proj.weight", 2, 1) + dims("v_proj.weight", 2, 1)
        + dims("o_proj.weight", 2, 0) + dims("lambda_proj.weight", 2, 1)
    )
    H = _most_common(dims("lambda_proj.weight", 2, 0))
    if E is None or H is None:
        raise ValueError(
            "unilm V2 attention state_dict: cannot infer embed_dim and num_heads: num_heads is the row count of "
            f"lambda_proj.weight (shape found: {_shape(arrays, 'lambda_proj.weight')}; expected (num_heads, embed_dim))"
        )
    d_votes = [n // H for n in dims("o_proj.weight", 2, 1) if n % H == 0]
    d_votes += [n // (2 * H) for n in dims("q_proj.weight", 2, 0) if n % (2 * H) == 0]
    d = _most_common(d_votes)
    if d is None or d % 2:
        raise ValueError(
            f"unilm V2 attention state_dict: cannot infer an even head_dim d: o_proj.weight has shape "
            f"{_shape(arrays, 'o_proj.weight')} and q_proj.weight {_shape(arrays, 'q_proj.weight')}; expected "
            f"({E}, {H} * d) and (2 * {H} * d, {E}) with num_heads = {H} from lambda_proj.weight"
        )
    K = next((n // d for n in dims("k_proj.weight", 2, 0) + dims("v_proj.weight", 2, 0) if n % d == 0 and n), None)
    if K is None:
        raise ValueError(
            f"unilm V2 attention state_dict: k_proj.weight has shape {_shape(arrays, 'k_proj.weight')} (v_proj.weight "
            f"{_shape(arrays, 'v_proj.weight')}); expected (num_kv_heads * {d}, {E})"
        )
    if H % K:
        raise ValueError(
            f"unilm V2 attention state_dict: num_heads = {H} (lambda_proj.weight {_shape(arrays, 'lambda_proj.weight')}) "
            f"must be a multiple of num_kv_heads = {K} (k_proj.weight {_shape(arrays, 'k_proj.weight')}, head_dim {d}): "
            "V2 pairs query heads 2j and 2j+1 inside one GQA group"
        )
    return E, d, H, K


def _expected_shapes(variant: str, E: int, d: int, H: int, K: int) -> dict[str, tuple[int, ...]]:
    if variant == "V2":
        return {
            "q_proj.weight": (2 * H * d, E),
            "k_proj.weight": (K * d, E),
            "v_proj.weight": (K * d, E),
            "o_proj.weight": (E, H * d),
            "lambda_proj.weight": (H, E),
        }
    return {
        "q_proj.weight": (2 * H * d, E),
        "k_proj.weight": (2 * K * d, E),
        "v_proj.weight": (2 * K * d, E),
        "out_proj.weight": (E, 2 * H * d),
        **{key: (d,) for key in LAMBDA_KEYS},
        "subln.weight": (2 * d,),
    }


def _variant(keys) -> str:
    """"V2" when the state_dict holds more of V2's own keys (o_proj, lambda_proj) than of V1's, else "V1"."""
    own = {variant: len(set(keys) & variant_keys) for variant, variant_keys in _VARIANT_KEYS.items()}
    return "V2" if own["V2"] > own["V1"] else "V1"


def load_unilm_attention(
    state_dict: Mapping[str, Any],
    *,
    depth: int | None = None,
    prefix: str = "",
    rope_theta: float = 10000.0,
    lambda_init: float | None = None,
    norm_eps: float = 1e-5,
    dtype: str = "float32",
    param_dtype: str | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> DiffAttention | DiffAttentionV2:
    """One unilm differential attention module's weights: V1 as a diffjax `DiffAttention`, V2 as a
    `DiffAttentionV2` (the variant is recognised from the keys).

    state_dict: V1 keys `q_proj.weight`, `k_proj.weight`, `v_proj.weight`, `out_proj.weight`, `lambda_q1`,
      `lambda_k1`, `lambda_q2`, `lambda_k2` and optionally `subln.weight` (ones when absent); V2 keys
      `q_proj.weight`, `k_proj.weight`, `v_proj.weight`, `o_proj.weight`, `lambda_proj.weight`. Values are torch
      tensors, numpy or jax arrays (float32 / bfloat16 / float16). With `prefix` (e.g.
      "layers.3.self_attn."), only keys starting with it are read and the rest of the dict is ignored.
    depth: V1: the module's 0-based layer index (unilm's `depth`), required; it sets
      lambda_init = 0.8 - 0.6 exp(-0.3 depth) unless `lambda_init` overrides it. V2 has no depth-dependent
      constant and ignores it (lambda_init and norm_eps do not apply to V2).
    rope_theta: base of the standard table inv_freq_i = theta^(-2i/d) that diffjax's `rope_tables` builds
      (unilm takes caller-built tables and stores no theta).
    dtype: compute dtype of the returned layer. param_dtype: storage dtype of its parameters; None keeps the
      checkpoint's dtype when all its tensors share one, else float32 (lossless).
    window_size: the (left, right) that unilm's `flashdiff.FlashDiffAttention` (flash-attn's window_size) ran
      the module with; (-1, -1) is the whole context. The layer is causal, so right is ignored as flash-attn
      ignores it under causal=True, and left = W - 1 gives `attention_window` W (`unilm_window_size` inverts it).

    Sizes are inferred. V1: d from the lambda vectors, E from the projections, H = E / (2d), Hkv from
    k_proj.weight's rows. V2: h from lambda_proj.weight's rows, d from o_proj.weight, Hkv from k_proj.weight.
    A missing or unexpected key (for the variant recognised) or a mis-shaped tensor raises a ValueError that
    names the variant, the key, the shape found and the shape expected (all problems at once).
    """
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_NP_DTYPES)}, got {dtype!r}")
    if param_dtype is not None and param_dtype not in _NP_DTYPES:
        raise ValueError(f"param_dtype must be None or one of {tuple(_NP_DTYPES)}, got {param_dtype!r}")
    found = {full_key[len(prefix):]: value for full_key, value in state_dict.items() if full_key.startswith(prefix)}
    variant = _variant(found)
    if variant == "V1" and (not isinstance(depth, (int, np.integer)) or depth < 0):
        raise ValueError(f"depth must be a non-negative integer (0-based layer index) for a unilm V1 module, got {depth!r}")
    if variant == "V2" and lambda_init is not None:
        raise ValueError(f"lambda_init={lambda_init!r} does not apply to a unilm V2 module (its lambda is sigmoid(x W_lambda))")

    arrays, (E, d, H, K) = _checked_arrays(found, variant, prefix)
    if param_dtype is None:  # the checkpoint's, when its tensors share one
        names = {_dtype_name(a.dtype) for a in arrays.values()}
        param_dtype = names.pop() if len(names) == 1 and None not in names else "float32"
    common = dict(
        d_model=E, num_heads=H, num_kv_heads=K, head_dim=d, rope_style="interleaved", rope_type="default",
        rope_theta=float(rope_theta), dtype=dtype, param_dtype=param_dtype, attention_window=window_from_unilm(window_size),
    )
    if variant == "V2":
        return _v2_module(arrays, common)
    return _v1_module(arrays, common, depth=int(depth), lambda_init=lambda_init, norm_eps=norm_eps)


def _checked_arrays(found: dict[str, Any], variant: str, prefix: str) -> tuple[dict[str, np.ndarray], tuple[int, ...]]:
    """The variant's tensors as numpy and its sizes (E, d, H, Hkv); one ValueError naming every missing,
    unexpected, non-float or mis-shaped key (with `prefix`), the shape found and the shape expected."""
    known = UNILM_V2_ATTENTION_KEYS if variant == "V2" else UNILM_ATTENTION_KEYS
    arrays = {key: to_numpy(value) for key, value in found.items() if key in known}
    unexpected = [
        f"unexpected key {prefix + key!r} (shape {tuple(getattr(value, 'shape', ()))}; expected shape: none, the key is "
        f"not part of a unilm {variant} attention module, whose keys are {', '.join(prefix + k for k in known)})"
        for key, value in found.items() if key not in known
    ]
    if not arrays:
        raise ValueError(
            f"no unilm attention keys found under prefix {prefix!r}; expected V1 keys "
            f"{', '.join(prefix + k for k in UNILM_ATTENTION_KEYS)} or V2 keys {', '.join(prefix + k for k in UNILM_V2_ATTENTION_KEYS)}"
            + ("; " + "; ".join(unexpected) if unexpected else "")
        )
    problems = [f"{prefix + key!r} has dtype {arrays[key].dtype}; expected a floating dtype" for key in known
                if key in arrays and not np.issubdtype(arrays[key].dtype, np.floating) and arrays[key].dtype != ml_dtypes.bfloat16]
    E, d, H, K = (_infer_v2_sizes if variant == "V2" else _infer_sizes)(arrays)
    for key, shape in _expected_shapes(variant, E, d, H, K).items():
        if key not in arrays:
            if key not in _OPTIONAL_KEYS:
                problems.append(f"missing key {prefix + key!r} (shape found: none; expected shape {shape})")
        elif tuple(arrays[key].shape) != shape:
            problems.append(f"key {prefix + key!r} has shape {tuple(arrays[key].shape)}; expected shape {shape}")
    if problems + unexpected:
        raise ValueError(
            f"invalid unilm {variant} attention state_dict (E={E}, num_heads={H}, num_kv_heads={K}, head_dim={d}): "
            + "; ".join(problems + unexpected)
        )
    return arrays, (E, d, H, K)


def _v2_module(arrays: dict[str, np.ndarray], common: dict[str, Any]) -> DiffAttentionV2:
    """A DiffAttentionV2 holding a V2 module's tensors (plain transposes and reshapes: nothing is permuted)."""
    E, H, K, d = common["d_model"], common["num_heads"], common["num_kv_heads"], common["head_dim"]
    config = ModelConfig(num_layers=1, attention=MODULES[V2_MODULE], **common)
    params = {
        ("q_kernel",): arrays["q_proj.weight"].T.reshape(E, H, 2, d),
        ("k_kernel",): arrays["k_proj.weight"].T.reshape(E, K, d),
        ("v_kernel",): arrays["v_proj.weight"].T.reshape(E, K, d),
        ("o_kernel",): arrays["o_proj.weight"].T.reshape(H, d, E),
        ("lambda_kernel",): arrays["lambda_proj.weight"].T,
    }
    return build_module(lambda: DiffAttentionV2(config, rngs=nnx.Rngs(0)), params, _NP_DTYPES[config.param_dtype])


def _v1_module(arrays: dict[str, np.ndarray], common: dict[str, Any], *, depth: int, lambda_init: float | None,
               norm_eps: float) -> DiffAttention:
    """A DiffAttention (layer `depth` of its config) holding a V1 module's tensors; subln.weight ones when absent."""
    E, H, K, d = common["d_model"], common["num_heads"], common["num_kv_heads"], common["head_dim"]
    config = ModelConfig(
        num_layers=depth + 1, attention=MODULES[V1_MODULE], lambda_init=None if lambda_init is None else float(lambda_init),
        norm_eps=float(norm_eps), **common,
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
    return build_module(lambda: DiffAttention(config, depth, rngs=nnx.Rngs(0)), params, _NP_DTYPES[config.param_dtype])


def window_from_unilm(window_size) -> int | None:
    """attention_window of flash-attn / unilm flashdiff's causal window_size=(left, right): left + 1 keys (the
    query's own and `left` before it); left = -1 is the whole context. right is ignored (causal)."""
    is_int = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, bool)  # noqa: E731
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(map(is_int, window_size))):
        raise ValueError(f"window_size must be a pair of ints (left, right) as flash-attn takes it, got {window_size!r}")
    left, right = map(int, window_size)
    if left < -1:
        raise ValueError(f"window_size=({left}, {right}): left must be -1 (whole context) or >= 0 keys before the query")
    return None if left == -1 else left + 1


def unilm_window_size(config: ModelConfig, depth: int = 0) -> tuple[int, int]:
    """The window_size=(left, right) for unilm's flashdiff.FlashDiffAttention (flash-attn) that computes what layer
    `depth` of `config` computes: (W - 1, 0) under attention_window W, (-1, -1) for a global layer or none."""
    window = config.window_at(depth)
    return (-1, -1) if window is None else (window - 1, 0)


def unilm_attention_state_dict(
    layer: DiffAttention | DiffAttentionV2, *, prefix: str = "", subln: bool = True
) -> dict[str, np.ndarray]:
    """The inverse of `load_unilm_attention`: unilm state_dict entries (numpy, in the parameter dtype;
    bfloat16 as ml_dtypes.bfloat16). A `DiffAttentionV2` gives V2's keys (`subln` does not apply).

    subln: True (modules since 2024-10-25) writes `subln.weight`; False is for older modules whose
    per-head norm has no weight: the scale is folded into out_proj's columns instead (exact when it
    is ones, as for every layer loaded from such a module; equal up to rounding otherwise).

    Load into PyTorch with e.g. `torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)` for bf16.
    unilm recomputes lambda_init from the module's depth, so a layer built with a lambda_init override
    does not round-trip through unilm's own module.
    """
    config = layer.config
    kind = attention_kinds.get(config.attention)
    module = next((module for module, name in MODULES.items() if name == kind.name), None)
    if module is None:
        raise ValueError(f"a {kind.label} layer (attention {kind.name!r}) has no unilm counterpart "
                         f"(unilm has {V1_MODULE} and {V2_MODULE} only)")
    if config.rope_style != "interleaved":
        raise ValueError(
            f"unilm uses interleaved (GPT-J) RoPE; this layer uses rope_style={config.rope_style!r}, whose q/k "
            "channel order differs: convert through the HF path instead"
        )
    E, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim

    def get(name):
        return np.asarray(getattr(layer, name)[...])

    if module == V2_MODULE:
        out = {
            "q_proj.weight": get("q_kernel").reshape(E, 2 * H * d).T,
            "k_proj.weight": get("k_kernel").reshape(E, K * d).T,
            "v_proj.weight": get("v_kernel").reshape(E, K * d).T,
            "o_proj.weight": get("o_kernel").reshape(H * d, E).T,
            "lambda_proj.weight": get("lambda_kernel").T,
        }
        return {prefix + key: np.ascontiguousarray(value) for key, value in out.items()}
    if 2 * H * d != E:
        raise ValueError(f"unilm needs d_model == 2 * num_heads * head_dim, got {E} != 2 * {H} * {d}")
    if not config.subln:
        raise ValueError("unilm's modules always normalize each head's output; this layer has subln=false")

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
