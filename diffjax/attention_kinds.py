"""The attention kinds: one table that config validation, parameter counts, FLOPs, the converters and the
analyses read, so that none of them names a kind. Importable without JAX.

A kind is a row here plus one module under diffjax/model/attention/ (a subclass of
`diffjax.model.attention.AttentionModule`) that states what differs: its parameters, `project`, the
op's extra arguments (lambda) and `output`. To add one (README, "Adding an attention kind"):

    attention_kinds.register(AttentionKind(name="my_kind", label="My attention", module="my_package.my_module:MyAttention",
                                           maps=2, value_width=1, lambda_form="per_token",
                                           attention_params=..., attention_flops=...))

then `ModelConfig(attention="my_kind")` trains, generates and is analysed like the built-in kinds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

ANALYSES = ("needles", "attention_scores", "outliers", "quantization")  # diffjax.analysis's functions
LAMBDA_FORMS = ("none", "per_layer", "per_token")


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    name: str  # ModelConfig.attention
    label: str  # for tables and logs: "DIFF", "Transformer", ...
    module: str | type  # "package.module:Class" (imported when a model is built) or the class itself
    maps: int  # softmax maps per output head: 2 (differential, ops.diff_attention), 1 (ops.dot_product_attention)
    value_width: int  # a head's value width in head_dims; the default head_dim is d_model / (value_width num_heads)
    # "none"; "per_layer": lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init(depth), a scalar per layer (V1);
    # "per_token": lambda[b, t, h] from the activations (V2)
    lambda_form: str
    attention_params: Callable  # (ModelConfig) -> parameters of one layer's attention
    attention_flops: Callable  # (ModelConfig, mean context) -> forward FLOPs of one layer's attention per token
    vector_params: Callable = lambda config: 0  # (ModelConfig) -> those of attention_params outside any matmul
    hf_model_type: str | None = None  # the Hugging Face model_type it reads and writes (None: no HF counterpart)
    hf_architecture: str | None = None
    unilm_module: str | None = None  # microsoft/unilm's module class it loads from and exports to
    analyses: tuple[str, ...] = ANALYSES
    own_fields: dict = dataclasses.field(default_factory=dict)  # ModelConfig field -> (ModelConfig) -> its default
    config_problems: Callable = lambda config: []  # (ModelConfig, sizes derived) -> what is invalid, one line each

    def __post_init__(self):
        if self.maps not in (1, 2):
            raise ValueError(f"AttentionKind {self.name!r}: maps must be 1 or 2, got {self.maps!r}")
        if self.lambda_form not in LAMBDA_FORMS:
            raise ValueError(f"AttentionKind {self.name!r}: lambda_form must be one of {LAMBDA_FORMS}, got {self.lambda_form!r}")
        if (self.maps == 2) == (self.lambda_form == "none"):
            raise ValueError(f"AttentionKind {self.name!r}: two maps need a lambda and one map none")
        unknown = sorted(set(self.analyses) - set(ANALYSES))
        if unknown:
            raise ValueError(f"AttentionKind {self.name!r}: unknown analyses {unknown}; known: {ANALYSES}")


_KINDS: dict[str, AttentionKind] = {}


def register(kind: AttentionKind, *, replace: bool = False) -> AttentionKind:
    """Add `kind` to the table (replace=True overwrites a kind of the same name)."""
    if kind.name in _KINDS and not replace:
        raise ValueError(f"attention kind {kind.name!r} is already registered (pass replace=True to overwrite it)")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind added with `register` (for tests that define one)."""
    _KINDS.pop(name, None)


def get(name: str) -> AttentionKind:
    if name not in _KINDS:
        raise ValueError(f"attention must be one of {names()}, got {name!r}")
    return _KINDS[name]


def names() -> tuple[str, ...]:
    return tuple(_KINDS)


def for_hf_model_type(model_type: str) -> AttentionKind | None:
    return next((kind for kind in _KINDS.values() if kind.hf_model_type == model_type), None)


def for_unilm_module(module_name: str) -> AttentionKind | None:
    return next((kind for kind in _KINDS.values() if kind.unilm_module == module_name), None)


# ------------------------------------------------------------------------------ the built-in kinds
# Parameter counts from the kernels' shapes (D d_model, H num_heads, K num_kv_heads, d head_dim; the modules
# under diffjax/model/attention/ state the shapes). FLOPs per token and layer at mean context c (causal: c =
# T / 2): each map's q k^T and P V cost 2 d c multiply-adds per query head and channel pair (README, "FLOPs").


def _v1_vectors(c) -> int:
    return 4 * c.head_dim + (2 * c.head_dim if c.subln else 0)  # lambda_q1, lambda_k1, lambda_q2, lambda_k2; subln (2d)


def _diff_params(c) -> int:
    D, H, K, d = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    return D * H * 2 * d + 2 * D * K * 2 * d + H * 2 * d * D + _v1_vectors(c)  # q, k (two maps), v (2d), o (2d)


def _shared_diff_params(c) -> int:
    D, H, K, d, r = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.shared_diff_rank
    low_rank = 4 * D * r + 2 * r * (H + K) * d  # per map a (D, r) and an (r, heads, d) factor, for q and for k
    return D * (H + K) * d + low_rank + D * K * 2 * d + H * 2 * d * D + _v1_vectors(c)


def _diff_v2_params(c) -> int:
    D, H, K, d = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    return D * H * 2 * d + 2 * D * K * d + H * d * D + D * H  # q (two maps), k, v, o, lambda projection


def _standard_params(c) -> int:
    D, H, K, d = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    return 2 * D * H * d + 2 * D * K * d


def _gda_params(c) -> int:
    D, H, N, K, d = c.d_model, c.num_heads, c.num_noise_heads, c.num_kv_heads, c.head_dim
    return D * (H + N) * d + 2 * D * K * 2 * d + H * 2 * d * D + _v1_vectors(c)  # q signal, q noise, k, v, o


def _gda_problems(c) -> list[str]:
    H, N, K = c.num_heads, c.num_noise_heads, c.num_kv_heads
    if H % N or N % K:
        return [f"num_noise_heads ({N}) must divide num_heads ({H}) and be a multiple of num_kv_heads ({K}) (each noise "
                "head serves a whole group of signal heads, all reading one kv head)"]
    return []


_V1_FLOPS = lambda c, context: 12 * c.num_heads * c.head_dim * context  # noqa: E731  2 maps of d; P V of 2d

for _kind in (
    AttentionKind(
        name="diff", label="DIFF", module="diffjax.model.attention.diff:DiffAttention", maps=2, value_width=2,
        lambda_form="per_layer", attention_params=_diff_params, attention_flops=_V1_FLOPS, vector_params=_v1_vectors,
        hf_model_type="diffllama", hf_architecture="DiffLlamaForCausalLM", unilm_module="MultiheadFlashDiff1",
    ),
    AttentionKind(
        name="standard", label="Transformer", module="diffjax.model.attention.standard:StandardAttention", maps=1,
        value_width=1, lambda_form="none", attention_params=_standard_params,
        attention_flops=lambda c, context: 4 * c.num_heads * c.head_dim * context,
        hf_model_type="llama", hf_architecture="LlamaForCausalLM",
    ),
    AttentionKind(
        name="diff_v2", label="DIFF V2", module="diffjax.model.attention.diff_v2:DiffAttentionV2", maps=2,
        value_width=1, lambda_form="per_token", attention_params=_diff_v2_params,
        attention_flops=lambda c, context: 8 * c.num_heads * c.head_dim * context, unilm_module="MultiheadFlashDiffV2",
    ),
    AttentionKind(
        name="shared_diff", label="Shared DIFF", module="diffjax.model.attention.shared_diff:SharedDiffAttention",
        maps=2, value_width=2, lambda_form="per_layer", attention_params=_shared_diff_params, attention_flops=_V1_FLOPS,
        vector_params=_v1_vectors, own_fields={"shared_diff_rank": lambda c: max(1, c.d_model // 16)},
    ),
    AttentionKind(
        # The FLOPs count the GDA's own maps, H signal and N noise (6 d c each: q k^T of d, P V of 2d); diffjax
        # computes a noise map once per signal head (one ops.diff_attention call), H / N times the noise maps' FLOPs.
        name="gda", label="GDA", module="diffjax.model.attention.gda:GroupedDiffAttention", maps=2, value_width=2,
        lambda_form="per_layer", attention_params=_gda_params,
        attention_flops=lambda c, context: 6 * (c.num_heads + c.num_noise_heads) * c.head_dim * context,
        vector_params=_v1_vectors, hf_model_type="motif", hf_architecture="MotifForCausalLM",
        own_fields={"num_noise_heads": lambda c: c.num_kv_heads}, config_problems=_gda_problems,
    ),
):
    register(_kind)
