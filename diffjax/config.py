"""Model configuration: one dataclass for the Differential Transformer, its variants and the baseline twin.

`attention` picks the attention module:
  "diff"         differential attention V1 (unilm `multihead_flashdiff_1`): `num_heads` = H differential heads
                 (half the baseline's), each with q1, q2, k1, k2 of `head_dim` d = d_model / 2H and values of 2d
  "standard"     the MHA / GQA baseline: `num_heads` ordinary heads of d = d_model / num_heads
  "diff_v2"      Differential Transformer V2 (unilm `multihead_flashdiffv2`): `num_heads` = h output heads of
                 d = d_model / h, 2h query heads paired (2j, 2j+1), k and v with num_kv_heads heads of d,
                 per-token lambda = sigmoid(x W_lambda); no per-head norm, no lambda_init
  "shared_diff"  Shared DIFF Transformer (arXiv:2501.17900): V1 whose two maps' q (and k) projections are one
                 shared base plus a low-rank update each, rank `shared_diff_rank` (diffjax/model/shared_diff.py)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ATTENTION_KINDS = ("diff", "standard", "diff_v2", "shared_diff")
DIFF_V1_KINDS = ("diff", "shared_diff")  # the V1 operator: scalar lambda per layer, lambda_init, per-head norm
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
ROPE_STYLES = ("interleaved", "rotate_half")
ROPE_TYPES = ("default", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "minimal", "attention", "full")  # what a decoder block keeps for the backward pass
# Fields that change how the model computes, not what it computes: a run may resume with others.
RUNTIME_FIELDS = ("attention_impl", "remat", "scan_layers")
MLP_MULTIPLE = 64  # default mlp_dim rounds 8/3 d_model to the nearest multiple of this


def lambda_init_for_depth(depth: int) -> float:
    """The paper's schedule, with depth counted from 0 (first layer: 0.2)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: num_heads (no GQA)
    head_dim: int | None = None  # None: d_model / (2 num_heads) for diff and shared_diff, d_model / num_heads otherwise
    mlp_dim: int | None = None  # None: 8/3 d_model rounded to a multiple of MLP_MULTIPLE
    attention: str = "diff"  # one of ATTENTION_KINDS (module docstring)
    activation: str = "silu"  # gate activation of the gated MLP (SwiGLU with silu)
    norm_eps: float = 1e-5  # block RMSNorms and the per-head subln
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    # RoPE. "interleaved" is GPT-J / unilm (the canonical layout); "rotate_half" is NeoX / HF.
    rope_theta: float = 10000.0
    rope_style: str = "interleaved"
    rope_type: str = "default"  # "default" or "llama3" (frequency schedule)
    rope_factor: float = 8.0  # llama3 only
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_len: int = 8192  # llama3 only
    # Differential attention.
    lambda_init: float | None = None  # None: 0.8 - 0.6 exp(-0.3 depth); a float: the same for every layer
    lambda_std: float = 0.1  # init std of lambda_q1, lambda_k1, lambda_q2, lambda_k2
    # Shared DIFF: rank r of the low-rank q / k updates; None: d_model // 16 (the paper's 830M and 1.4B ranks).
    shared_diff_rank: int | None = None
    # Numerics and init.
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"
    init_std: float = 0.02
    attention_impl: str = "auto"  # passed to diffjax.ops.diff_attention / dot_product_attention
    # Memory and compile time. remat: "none" keeps every activation for the backward pass; "minimal"
    # keeps the projections' outputs and recomputes attention and elementwise ops; "attention" keeps
    # q, k, v, the attention output and the residual stream after attention, and recomputes the norms
    # and the MLP (about half of "minimal"'s memory); "full" keeps only each block's input. The blocks'
    # params are stacked over depth either way; scan_layers scans one block's program over them (compile
    # time independent of depth), false runs a Python loop over the layer slices (a program per layer:
    # for debugging).
    remat: str = "none"
    scan_layers: bool = False
    # Names of the fields above that were None and derived in __post_init__ (re-derived by replace()).
    derived: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        errors = []

        def check(ok: bool, message: str):
            if not ok:
                errors.append(message)

        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        for name in ("num_kv_heads", "head_dim", "mlp_dim", "shared_diff_rank"):
            value = getattr(self, name)
            check(
                value is None or (isinstance(value, int) and value > 0),
                f"{name} must be a positive integer or None, got {value!r}",
            )
        check(self.attention in ATTENTION_KINDS, f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        check(
            self.shared_diff_rank is None or self.attention == "shared_diff",
            f"shared_diff_rank is only used by attention 'shared_diff', got {self.shared_diff_rank!r} with attention {self.attention!r}",
        )
        check(self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        check(self.rope_style in ROPE_STYLES, f"rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}")
        check(self.rope_type in ROPE_TYPES, f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        # The impl names and each kernel's constraints belong to diffjax.ops (imported here, not at the top,
        # so that the config module stays free of jax).
        from diffjax.ops import config_problems

        errors += config_problems(self.attention_impl, self.dtype)
        check(self.remat in REMAT_POLICIES, f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        check(isinstance(self.scan_layers, bool), f"scan_layers must be true or false, got {self.scan_layers!r}")
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.param_dtype in DTYPES, f"param_dtype must be one of {DTYPES}, got {self.param_dtype!r}")
        check(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps!r}")
        check(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta!r}")
        check(self.init_std > 0, f"init_std must be > 0, got {self.init_std!r}")
        check(self.lambda_std >= 0, f"lambda_std must be >= 0, got {self.lambda_std!r}")
        check(
            self.lambda_init is None or 0.0 <= self.lambda_init < 1.0,
            f"lambda_init must be None (depth schedule) or in [0, 1), got {self.lambda_init!r}",
        )
        if self.rope_type == "llama3":
            check(self.rope_factor >= 1, f"rope_factor must be >= 1 for llama3 RoPE, got {self.rope_factor!r}")
            check(
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                "llama3 RoPE needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                f"{self.rope_low_freq_factor!r} and {self.rope_high_freq_factor!r}",
            )
            check(self.rope_original_max_len > 0, "rope_original_max_len must be > 0")
        if errors:
            raise ValueError("invalid ModelConfig: " + "; ".join(errors))

        # Resolve the derived sizes so that every field is concrete after construction.
        derivable = ("num_kv_heads", "head_dim", "mlp_dim") + (("shared_diff_rank",) if self.attention == "shared_diff" else ())
        object.__setattr__(self, "derived", tuple(n for n in derivable if getattr(self, n) is None))
        two_maps_wide = self.attention in DIFF_V1_KINDS  # values 2d wide: d = d_model / 2H
        heads_per_width = 2 * self.num_heads if two_maps_wide else self.num_heads
        if self.head_dim is None:
            if self.d_model % heads_per_width:
                what = "2 * num_heads" if two_maps_wide else "num_heads"
                raise ValueError(
                    f"invalid ModelConfig: d_model ({self.d_model}) must be divisible by {what} "
                    f"({heads_per_width}) when head_dim is not given; set head_dim explicitly or change num_heads"
                )
            object.__setattr__(self, "head_dim", self.d_model // heads_per_width)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            why = (" (diff_v2 pairs query heads 2j and 2j+1 of one kv group: unilm V2 needs num_heads % num_kv_heads == 0)"
                   if self.attention == "diff_v2" else "")
            raise ValueError(
                f"invalid ModelConfig: num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads}){why}"
            )
        if self.head_dim % 2:
            raise ValueError(f"invalid ModelConfig: head_dim must be even for RoPE, got {self.head_dim}")
        if self.mlp_dim is None:
            multiple = MLP_MULTIPLE
            object.__setattr__(self, "mlp_dim", max(multiple, round(8 * self.d_model / 3 / multiple) * multiple))
        if self.attention == "shared_diff" and self.shared_diff_rank is None:
            object.__setattr__(self, "shared_diff_rank", max(1, self.d_model // 16))

    # ----------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as given: derived sizes are None again, so a saved config re-derives them."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {**values, **{name: None for name in self.derived}}

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`; sizes that were derived are derived again from the new fields."""
        return dataclasses.replace(self, **{**{name: None for name in self.derived}, **changes})

    def lambda_init_at(self, depth: int) -> float:
        return lambda_init_for_depth(depth) if self.lambda_init is None else float(self.lambda_init)

    @property
    def num_query_groups(self) -> int:
        """n_rep: query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def param_counts(self) -> dict[str, int]:
        """Parameters per part, counted from the shapes (tied embeddings count once)."""
        D, H, K, d, F = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
        if self.attention == "diff":
            # q (D,H,2,d), k (D,K,2,d), v (D,K,2d), o (H,2d,D), four lambda vectors, subln (2d,)
            attention = D * H * 2 * d + 2 * D * K * 2 * d + H * 2 * d * D + 4 * d + 2 * d
        elif self.attention == "shared_diff":
            # bases q (D,H,d), k (D,K,d); per map a (D,r) and an (r, heads, d) factor for q and for k
            # (diffjax/model/shared_diff.py); then v, o, lambda vectors and subln as for diff
            r = self.shared_diff_rank
            low_rank = 4 * D * r + 2 * r * (H + K) * d
            attention = D * (H + K) * d + low_rank + D * K * 2 * d + H * 2 * d * D + 4 * d + 2 * d
        elif self.attention == "diff_v2":
            # q (D,H,2,d), k (D,K,d), v (D,K,d), o (H,d,D), lambda projection (D,H)
            attention = D * H * 2 * d + 2 * D * K * d + H * d * D + D * H
        else:
            attention = 2 * D * H * d + 2 * D * K * d
        per_layer = attention + 3 * D * F + 2 * D
        return {
            "embedding": self.vocab_size * D,
            "layers": self.num_layers * per_layer,
            "final_norm": D,
            "lm_head": 0 if self.tie_embeddings else D * self.vocab_size,
        }

    def param_count(self, *, include_lm_head: bool = True) -> int:
        """Total parameters. `include_lm_head=False` counts one embedding matrix, as the paper does."""
        counts = self.param_counts()
        if not include_lm_head:
            counts.pop("lm_head")
        return sum(counts.values())
