"""The attention kinds: one table that config validation, parameter counts, FLOPs and the analyses read, so that
none of them names a kind (which checkpoint formats hold a kind is theirs to say: diffjax.convert.formats).
Importable without JAX.

A kind is a row here plus one module under diffjax/model/attention/ (a subclass of
`diffjax.model.attention.AttentionModule`) that states what differs: its parameters, `project`, the
op's extra arguments (lambda) and `output`. To add one (README, "Adding a kind"):

    attention_kinds.register(AttentionKind(name="my_kind", label="My attention", module="my_package.my_module:MyAttention",
                                           maps=2, value_width=1, lambda_form="per_token",
                                           attention_params=..., attention_flops=...))

then `ModelConfig(attention="my_kind")` trains, generates and is analysed like the built-in kinds. A kind with
settings of its own gives its row an `options` class (diffjax.kinds.Options: GDA's and Shared DIFF's below);
ModelConfig then holds them as `attention_options`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from diffjax import kinds

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
    analyses: tuple[str, ...] = ANALYSES
    options: type[kinds.Options] | None = None  # the kind's own settings (ModelConfig.attention_options)
    rotary_dim: Callable = lambda config: config.head_dim  # (ModelConfig) -> the q / k channels RoPE rotates
    map_heads: Callable = lambda config: config.num_heads  # (ModelConfig) -> heads of each map explicit_maps gives
    # The diffjax.ops function its module calls; None: diff_attention for 2 maps, dot_product_attention for 1.
    op: str | None = None
    training: kinds.Training = kinds.NO_TRAINING  # its training side (diffjax.kinds.Training)

    @property
    def attention_op(self) -> str:
        return self.op or ("diff_attention" if self.maps == 2 else "dot_product_attention")

    def __post_init__(self):
        if self.op not in (None, "diff_attention", "dot_product_attention"):
            raise ValueError(f"AttentionKind {self.name!r}: op must be None, 'diff_attention' or "
                             f"'dot_product_attention', got {self.op!r}")
        if self.maps not in (1, 2):
            raise ValueError(f"AttentionKind {self.name!r}: maps must be 1 or 2, got {self.maps!r}")
        if self.lambda_form not in LAMBDA_FORMS:
            raise ValueError(f"AttentionKind {self.name!r}: lambda_form must be one of {LAMBDA_FORMS}, got {self.lambda_form!r}")
        if (self.maps == 2) == (self.lambda_form == "none"):
            raise ValueError(f"AttentionKind {self.name!r}: two maps need a lambda and one map none")
        unknown = sorted(set(self.analyses) - set(ANALYSES))
        if unknown:
            raise ValueError(f"AttentionKind {self.name!r}: unknown analyses {unknown}; known: {ANALYSES}")


TABLE: kinds.Table[AttentionKind] = kinds.Table("attention")
register, unregister, get, names = TABLE.register, TABLE.unregister, TABLE.get, TABLE.names


# ------------------------------------------------------------------------------ the built-in kinds
# Parameter counts from the kernels' shapes (D d_model, H num_heads, K num_kv_heads, d head_dim; the modules
# under diffjax/model/attention/ state the shapes). FLOPs per token and layer at mean context c (causal: c =
# T / 2): each map's q k^T and P V cost 2 d c multiply-adds per query head and channel pair (README, "FLOPs").


def _v1_vectors(c) -> int:
    return 4 * c.head_dim + (2 * c.head_dim if c.subln else 0)  # lambda_q1, lambda_k1, lambda_q2, lambda_k2; subln (2d)


def _diff_params(c) -> int:
    D, H, K, d = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    return D * H * 2 * d + 2 * D * K * 2 * d + H * 2 * d * D + _v1_vectors(c)  # q, k (two maps), v (2d), o (2d)


@dataclasses.dataclass(frozen=True)
class SharedDiffOptions(kinds.Options):
    """Shared DIFF's settings (model.attention_options with attention shared_diff)."""

    rank: int | None = None
    """Rank r of each map's low-rank q / k update; None: d_model // 16 (the paper's 830M and 1.4B ranks)."""

    legacy_keys = {"shared_diff_rank": "rank"}

    def defaults(self, config) -> dict:
        return {"rank": max(1, config.d_model // 16)}

    def problems(self, config) -> list[str]:
        return kinds.positive_int_problems(self, "rank")

    def describe(self) -> str:
        return f"rank {self.rank}"


def _shared_diff_params(c) -> int:
    D, H, K, d, r = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_options.rank
    low_rank = 4 * D * r + 2 * r * (H + K) * d  # per map a (D, r) and an (r, heads, d) factor, for q and for k
    return D * (H + K) * d + low_rank + D * K * 2 * d + H * 2 * d * D + _v1_vectors(c)


def _diff_v2_params(c) -> int:
    D, H, K, d = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    return D * H * 2 * d + 2 * D * K * d + H * d * D + D * H  # q (two maps), k, v, o, lambda projection


def _standard_params(c) -> int:
    D, H, K, d = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    return 2 * D * H * d + 2 * D * K * d


@dataclasses.dataclass(frozen=True)
class GDAOptions(kinds.Options):
    """Grouped Differential Attention's settings (model.attention_options with attention gda)."""

    num_noise_heads: int | None = None
    """Noise heads, each shared by num_heads / num_noise_heads signal heads (divides num_heads, a multiple of
    num_kv_heads); None: num_kv_heads. num_noise_heads = num_heads computes V1 exactly."""

    legacy_keys = {"num_noise_heads": "num_noise_heads"}

    def defaults(self, config) -> dict:
        return {"num_noise_heads": config.num_kv_heads}

    def problems(self, config) -> list[str]:
        problems = kinds.positive_int_problems(self, "num_noise_heads")
        H, N, K = config.num_heads, self.num_noise_heads, config.num_kv_heads
        if not problems and (H % N or N % K):
            problems.append(f"num_noise_heads ({N}) must divide num_heads ({H}) and be a multiple of num_kv_heads ({K}) "
                            "(each noise head serves a whole group of signal heads, all reading one kv head)")
        return problems

    def describe(self) -> str:
        return f"{self.num_noise_heads} noise heads"


def _gda_params(c) -> int:
    D, H, N, K, d = c.d_model, c.num_heads, c.attention_options.num_noise_heads, c.num_kv_heads, c.head_dim
    return D * (H + N) * d + 2 * D * K * 2 * d + H * 2 * d * D + _v1_vectors(c)  # q signal, q noise, k, v, o


@dataclasses.dataclass(frozen=True)
class GDLAOptions(kinds.Options):
    """Grouped Differential Latent Attention (Motif 3): MLA-style low-rank q and kv, heads in groups of
    num_heads / num_noise_heads whose last head is the noise head. head_dim = qk_nope_head_dim + qk_rope_head_dim
    is the q / k width (Motif's head_dim); values are v_head_dim wide."""

    q_lora_rank: int | None = None
    """Rank of q's low-rank latent; None: d_model // 4 (Motif 3: 1024 at 4096)."""
    kv_lora_rank: int | None = None
    """Rank of the shared k / v latent; None: d_model // 8 (Motif 3: 512)."""
    qk_nope_head_dim: int | None = None
    """The q / k channels without RoPE; None: head_dim - qk_rope_head_dim."""
    qk_rope_head_dim: int | None = None
    """The q / k channels RoPE rotates; None: head_dim // 2 (MotifConfig's default)."""
    v_head_dim: int | None = None
    """Width of a value head; None: head_dim."""
    num_noise_heads: int | None = None
    """Groups of heads, each ending in its noise head; None: num_kv_heads (num_heads // 2 without GQA)."""
    output_gate: bool = True
    """The element-wise sigmoid gate on the output from q's latent (Motif 3's elementwise_attn_output_gate)."""

    def defaults(self, config) -> dict:
        nope = self.qk_nope_head_dim
        rope = self.qk_rope_head_dim or (config.head_dim - nope if nope else config.head_dim // 2)
        noise = config.num_kv_heads if config.num_query_groups >= 2 else max(1, config.num_heads // 2)
        return {"q_lora_rank": max(1, config.d_model // 4), "kv_lora_rank": max(1, config.d_model // 8),
                "qk_rope_head_dim": rope, "qk_nope_head_dim": config.head_dim - rope, "v_head_dim": config.head_dim,
                "num_noise_heads": noise}

    def problems(self, config) -> list[str]:
        problems = kinds.positive_int_problems(self, "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                               "qk_rope_head_dim", "v_head_dim", "num_noise_heads")
        if not isinstance(self.output_gate, bool):
            problems.append(f"output_gate must be true or false, got {self.output_gate!r}")
        if problems:
            return problems
        H, N = config.num_heads, self.num_noise_heads
        if self.qk_nope_head_dim + self.qk_rope_head_dim != config.head_dim:
            problems.append(f"qk_nope_head_dim ({self.qk_nope_head_dim}) + qk_rope_head_dim ({self.qk_rope_head_dim}) "
                            f"must equal head_dim ({config.head_dim}), the q / k width")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if H % N or H // N < 2:
            problems.append(f"num_noise_heads ({N}) must divide num_heads ({H}) into groups of at least 2 (signal "
                            "heads, then the group's noise head)")
        return problems

    def describe(self) -> str:
        return (f"{self.num_noise_heads} noise heads, q rank {self.q_lora_rank}, kv rank {self.kv_lora_rank}"
                f"{', output gate' if self.output_gate else ''}")


def _gdla_params(c) -> int:
    D, H, K, d, o = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_options
    rq, rkv, dv, signal = o.q_lora_rank, o.kv_lora_rank, o.v_head_dim, H - o.num_noise_heads
    q = D * rq + rq * H * d + (rq * signal * dv if o.output_gate else 0)
    kv = D * (rkv + o.qk_rope_head_dim) + rkv * K * (o.qk_nope_head_dim + dv)
    return q + kv + D * signal + signal * dv * D + _gdla_vectors(c)  # + lambda, o


def _gdla_vectors(c) -> int:
    return c.attention_options.q_lora_rank + c.attention_options.kv_lora_rank  # the two latent RMSNorm scales


def _projections(q: tuple[str, ...] = ("q_kernel",), k: tuple[str, ...] = ("k_kernel",)) -> tuple[kinds.LoraTarget, ...]:
    """The LoRA targets of a kind with q, k, v and o projections."""
    return tuple(kinds.LoraTarget(name, kernels) for name, kernels in
                 (("q", q), ("k", k), ("v", ("v_kernel",)), ("o", ("o_kernel",))))


# Every two-map kind's facet makes the lambda warm-up's input (optim.lambda_warmup_steps), V1's also writes lambda per
# layer into the step's metrics. V1's lambda vectors and subln scale are spared weight decay (decay would pull lambda
# toward lambda_init).
_WARMUP = "diffjax.model.attention.warmup:LambdaWarmup"
_V1_TRAINING = kinds.Training(no_decay=(r"subln", r"lambda_"), lora_targets=_projections(),
                              facet="diffjax.model.attention.diff:LambdaMetrics")

_V1_FLOPS = lambda c, context: 12 * c.num_heads * c.head_dim * context  # noqa: E731  2 maps of d; P V of 2d

for _kind in (
    AttentionKind(
        name="diff", label="DIFF", module="diffjax.model.attention.diff:DiffAttention", maps=2, value_width=2,
        lambda_form="per_layer", attention_params=_diff_params, attention_flops=_V1_FLOPS, vector_params=_v1_vectors,
        training=_V1_TRAINING,
    ),
    AttentionKind(
        name="standard", label="Transformer", module="diffjax.model.attention.standard:StandardAttention", maps=1,
        value_width=1, lambda_form="none", attention_params=_standard_params,
        attention_flops=lambda c, context: 4 * c.num_heads * c.head_dim * context,
        training=kinds.Training(lora_targets=_projections()),
    ),
    AttentionKind(
        name="diff_v2", label="DIFF V2", module="diffjax.model.attention.diff_v2:DiffAttentionV2", maps=2,
        value_width=1, lambda_form="per_token", attention_params=_diff_v2_params,
        attention_flops=lambda c, context: 8 * c.num_heads * c.head_dim * context,
        training=kinds.Training(no_decay=(r"lambda_",), lora_targets=_projections(),  # (lambda_kernel)
                                facet=_WARMUP),
    ),
    AttentionKind(
        name="shared_diff", label="Shared DIFF", module="diffjax.model.attention.shared_diff:SharedDiffAttention",
        maps=2, value_width=2, lambda_form="per_layer", attention_params=_shared_diff_params, attention_flops=_V1_FLOPS,
        vector_params=_v1_vectors, options=SharedDiffOptions,
        training=dataclasses.replace(_V1_TRAINING, lora_targets=_projections(q=("q_base",), k=("k_base",))),
    ),
    AttentionKind(
        # The FLOPs count the GDA's own maps, H signal and N noise (6 d c each: q k^T of d, P V of 2d); diffjax
        # computes a noise map once per signal head (one ops.diff_attention call), H / N times the noise maps' FLOPs.
        name="gda", label="GDA", module="diffjax.model.attention.gda:GroupedDiffAttention", maps=2, value_width=2,
        lambda_form="per_layer", attention_params=_gda_params,
        attention_flops=lambda c, context: 6 * (c.num_heads + c.attention_options.num_noise_heads) * c.head_dim * context,
        vector_params=_v1_vectors, options=GDAOptions, training=_V1_TRAINING,
    ),
    AttentionKind(
        # One softmax map per query head (ops.dot_product_attention over all H heads, q k^T of d, P V of dv); each
        # signal head's second map is its group's noise head, subtracted after the op.
        name="gdla", label="GDLA", module="diffjax.model.attention.gdla:GroupedDiffLatentAttention", maps=2,
        value_width=1, lambda_form="per_token", attention_params=_gdla_params,
        attention_flops=lambda c, context: 2 * c.num_heads * (c.head_dim + c.attention_options.v_head_dim) * context,
        vector_params=_gdla_vectors, options=GDLAOptions, op="dot_product_attention",
        rotary_dim=lambda c: c.attention_options.qk_rope_head_dim,
        map_heads=lambda c: c.num_heads - c.attention_options.num_noise_heads,
        training=kinds.Training(no_decay=(r"lambda_",), facet=_WARMUP, lora_targets=tuple(  # (lambda_kernel); the
            kinds.LoraTarget(name, (f"{name}_kernel",)) for name in ("q_down", "q_up", "kv_down", "kv_up", "o"))),
        # (the output gate is no LoRA target)
    ),
):
    register(_kind)
