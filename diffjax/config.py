"""Model configuration: one dataclass for the Differential Transformer, its variants and the baseline twin.

`attention` picks the attention kind, a row of diffjax.attention_kinds (its module under
diffjax/model/attention/ says what it computes):
  "diff"         differential attention V1 (unilm `multihead_flashdiff_1`): `num_heads` = H differential heads
                 (half the baseline's), each with q1, q2, k1, k2 of `head_dim` d = d_model / 2H and values of 2d
  "standard"     the MHA / GQA baseline: `num_heads` ordinary heads of d = d_model / num_heads
  "diff_v2"      Differential Transformer V2 (unilm `multihead_flashdiffv2`): `num_heads` = h output heads of
                 d = d_model / h, 2h query heads paired (2j, 2j+1), k and v with num_kv_heads heads of d,
                 per-token lambda = sigmoid(x W_lambda); no per-head norm, no lambda_init
  "shared_diff"  Shared DIFF Transformer (arXiv:2501.17900): V1 whose two maps' q (and k) projections are one
                 shared base plus a low-rank update each, rank `attention_options.rank`
  "gda"          Grouped Differential Attention (arXiv:2510.06949; Motif-2-12.7B): V1 with fewer noise heads than
                 signal heads, `attention_options.num_noise_heads` of them, each serving num_heads / num_noise_heads
                 signal heads
`mlp` picks the MLP kind (diffjax.mlp_kinds: "gated"; Motif 3's "polynorm" and "moe", whose
`mlp_options.dense_first_layers` builds the first layers with the "polynorm" MLP: diffjax.kinds.layer_segments) and
`residual` the residual form (diffjax.residual_kinds: "plain"). A kind's own settings are its `*_options` (diffjax.kinds: the row's options class; a mapping in YAML).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from diffjax import attention_kinds, block_kinds, kinds, mlp_kinds, residual_kinds
from diffjax.attention_impls import config_problems
from diffjax.config_values import build_config, did_you_mean, nonfinite_problems, one_of

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "polynorm")  # polynorm: Motif's (diffjax.model.layers.polynorm)
ROPE_STYLES = ("interleaved", "rotate_half")
ROPE_TYPES = ("default", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16")
# What a decoder block keeps for the backward pass, each policy less than the one before.
REMAT_POLICIES = ("none", "minimal", "attention", "full")
# Fields that change how the model computes, not what it computes: a run may resume with others.
RUNTIME_FIELDS = ("attention_impl", "remat", "scan_layers", "mtp_loss_weight")
# The parts a decoder block is built from: ModelConfig field naming the part's kind -> its table of kinds.
BLOCK_PARTS = {"attention": attention_kinds.TABLE, "mlp": mlp_kinds.TABLE, "residual": residual_kinds.TABLE}
MTP_RESIDUAL = "plain"  # the MTP layer's residual form unless mtp_layer.residual says otherwise
MLP_MULTIPLE = 64  # default mlp_dim rounds 8/3 d_model to the nearest multiple of this


def lambda_init_for_depth(depth: int, offset: int = 0) -> float:
    """The paper's schedule, with depth counted from 0 (first layer: 0.2); offset shifts the depth (Motif's -1)."""
    return 0.8 - 0.6 * math.exp(-0.3 * (depth + offset))


@dataclasses.dataclass(frozen=True)
class MTPLayer:
    """ModelConfig.mtp_layer: the fields of the MTP blocks' decoder layer that differ from the model's first layer
    (None: the model's; the residual form: plain). Motif 3's (diffjax.convert.motif3): a dense PolyNorm MLP, no mHC,
    windowed everywhere."""

    mlp: str | None = None
    """Its MLP kind."""
    mlp_options: Any = None
    """Its MLP kind's options (a mapping in YAML)."""
    mlp_dim: int | None = None
    """Its MLP's hidden width."""
    residual: str | None = None
    """Its residual form; None: "plain" (Motif 3's and DeepSeek-V3's MTP layer), whatever the model's. A form with
    streams of its own (mHC) expands the depth's input into them and collapses them before the depth's final norm."""
    attention_window: int | None = None
    """Its sliding window (keys per query)."""
    window_rope_theta: float | None = None
    """Its RoPE theta when windowed."""

    def changes(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model (a run config's `model` section): sizes, the kinds of its block parts and their options, RoPE,
    lambda, sliding windows, numerics, and how it runs (attention_impl, remat, scan_layers)."""

    vocab_size: int = 256
    """Token ids the embedding and LM head cover; a run config may say "auto" (the tokenizer's vocabulary size)."""
    d_model: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Decoder blocks."""
    num_heads: int = 4
    """Attention heads: differential heads for diff, shared_diff and gda (half the baseline's), output heads for
    diff_v2, ordinary heads for standard."""
    num_kv_heads: int | None = None
    """Key / value heads (grouped-query attention when fewer than num_heads); None: num_heads."""
    head_dim: int | None = None
    """Width d of one query / key head; None: d_model / (value_width num_heads), value_width 2 for diff, shared_diff
    and gda, else 1."""
    mlp_dim: int | None = None
    """Hidden width of the MLP; None: 8/3 d_model rounded to a multiple of 64."""
    attention: str = "diff"
    """The attention kind, a row of diffjax.attention_kinds (this module's docstring says what each computes)."""
    attention_options: Any = None
    """The attention kind's own settings (a mapping in YAML, its Options class in Python); None: its defaults."""
    mlp: str = "gated"
    """The MLP kind, a row of diffjax.mlp_kinds."""
    mlp_options: Any = None
    """The MLP kind's own settings (a mapping in YAML, its Options class in Python); None: its defaults."""
    residual: str = "plain"
    """The residual form, a row of diffjax.residual_kinds."""
    residual_options: Any = None
    """The residual form's own settings (a mapping in YAML, its Options class in Python); None: its defaults."""
    activation: str = "silu"
    """The gated MLP's activation (SwiGLU with silu; "polynorm": Motif's PolyNorm, 3 weights and a bias)."""
    norm_eps: float = 1e-5
    """Epsilon of the block RMSNorms (and of the per-head subln unless subln_eps is given)."""
    subln_eps: float | None = None
    """Epsilon of the per-head subln of V1-style kinds; None: norm_eps (Motif: attn_rms_norm_eps)."""
    subln: bool = True
    """V1-style kinds' per-head RMSNorm; false drops it and its scale (a Transformer upcycled to V1 starts so, computing
    what it computed: diffjax.convert.upcycle); the paper, unilm, DiffLlama and Motif all normalize."""
    tie_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    max_seq_len: int = 2048
    """Longest sequence the model is built for (RoPE tables, generation's KV cache)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_style: str = "interleaved"
    """RoPE pair layout: "interleaved" (GPT-J, unilm: the canonical layout) or "rotate_half" (NeoX, Hugging Face)."""
    rope_type: str = "default"
    """RoPE frequency schedule: "default", "llama3" or "yarn" (diffjax.model.rope)."""
    rope_factor: float = 8.0
    """llama3 and yarn: the context extension factor."""
    rope_low_freq_factor: float = 1.0
    """llama3 only: its low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 only: its high_freq_factor."""
    rope_original_max_len: int = 8192
    """llama3 and yarn: the context length the frequencies were trained for."""
    rope_beta_fast: float = 32.0
    """yarn only: pairs turning more often than this over the original context keep their frequency."""
    rope_beta_slow: float = 1.0
    """yarn only: pairs turning less often than this are divided by rope_factor."""
    rope_mscale: float | None = None
    """yarn only: the whole-context layers multiply their softmax scale by (0.1 rope_mscale ln(rope_factor) + 1)^2
    (cos / sin are never scaled); None: unchanged. Motif 3 sets 1.0 when max_position_embeddings >
    original_seq_len."""
    window_rope_theta: float | None = None
    """The windowed layers' RoPE theta (plain frequencies, no YaRN, no softmax factor; Motif 3's swa_rope_theta,
    Gemma 3's local base); None: as the global layers. Needs an attention_window."""
    lambda_init: float | None = None
    """Differential attention's lambda_init; None: the paper's depth schedule 0.8 - 0.6 exp(-0.3 (depth +
    lambda_init_depth_offset)); a float: every layer's."""
    lambda_init_depth_offset: int = 0
    """Where the depth schedule counts from: 0 as the paper, unilm and HF DiffLlama; -1 as Motif's code (its first
    layer's lambda_init is -0.0099; its checkpoints were trained so)."""
    lambda_std: float = 0.1
    """Init standard deviation of lambda_q1, lambda_k1, lambda_q2, lambda_k2."""
    attention_window: int | None = None
    """Sliding window, every kind: each query sees its W latest keys, itself included (flash-attn's window_size=(W - 1,
    0), HF Mistral's sliding_window=W); None: the whole causal context."""
    global_layers: tuple[int, ...] = ()
    """0-based layers that attend the whole context despite attention_window (Gemma and Phi-4-mini-flash interleave
    them, e.g. [5, 11, 17])."""
    dtype: str = "float32"
    """Compute dtype of the activations."""
    param_dtype: str = "float32"
    """Storage dtype of the parameters."""
    init_std: float = 0.02
    """Standard deviation of the normal init of the projections and embeddings."""
    attention_impl: str = "auto"
    """The attention kernel, passed to diffjax.ops.diff_attention / dot_product_attention ("auto": picked per call
    from the device and shapes, diffjax.ops.choose)."""
    remat: str = "none"
    """What a block keeps for the backward pass: "none" everything; "minimal" the projections' outputs; "attention"
    q, k, v, the attention output and the residual stream after attention (about half of minimal's memory); "full"
    only the block's input."""
    scan_layers: bool = False
    """Scan one block's program over the depth-stacked params (compile time independent of depth); false: a Python
    loop over the layer slices (for debugging)."""
    mtp_depths: int = 0
    """Multi-token-prediction depths (DeepSeek-V3's MTP modules; Motif 3's num_nextn_predict_layers): depth k's block
    predicts token t + 1 + k from depth k - 1's hidden state (depth 0: the model's final one) and the embedding of
    token t + k (diffjax.model.mtp.PredictionBlock); trained with mtp_loss_weight; 0: none."""
    mtp_layer: Any = None
    """The MTP blocks' decoder layer where it differs from the model's first layer (an MTPLayer; a mapping in YAML);
    None: as that layer. It is windowed at every position when it has an attention_window."""
    mtp_loss_weight: float = 0.2
    """Training only: the MTP depths' mean loss joins the main loss times this (DeepSeek-V3's lambda: 0.3, then 0.1;
    Motif 3's pretraining used 0.2, by a secondary source). The logged and evaluated loss stays the main one."""
    # Names of the fields above that were None and derived in __post_init__ (re-derived by replace()); a kind's
    # option as "attention_options.num_noise_heads".
    derived: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.global_layers, list):
            object.__setattr__(self, "global_layers", tuple(self.global_layers))
        rows = {part: _row(table, getattr(self, part)) for part, table in BLOCK_PARTS.items()}
        errors = [row for row in rows.values() if isinstance(row, str)] + nonfinite_problems(self)
        errors += self._size_errors() + self._window_errors() + self._numerics_errors() + self._mtp_errors()
        if errors:
            raise ValueError("invalid ModelConfig: " + "; ".join(errors))
        derived = self._derive_sizes(rows["attention"])
        for part, row in rows.items():
            try:
                options, derived_options = kinds.resolve_options(row, getattr(self, f"{part}_options"), self,
                                                                 f"{part}_options")
            except ValueError as error:
                raise ValueError(f"invalid ModelConfig: {error}") from None
            object.__setattr__(self, f"{part}_options", options)
            derived += tuple(f"{part}_options.{name}" for name in derived_options)
        object.__setattr__(self, "derived", derived)
        if self.mtp_depths:
            self._resolve_mtp_layer()

    def _mtp_errors(self) -> list[str]:
        errors = []
        if not _is_int(self.mtp_depths) or self.mtp_depths < 0:
            errors.append(f"mtp_depths must be an integer >= 0, got {self.mtp_depths!r}")
        if isinstance(self.mtp_loss_weight, bool) or not isinstance(self.mtp_loss_weight, (int, float)) \
                or self.mtp_loss_weight < 0:
            errors.append(f"mtp_loss_weight must be a number >= 0, got {self.mtp_loss_weight!r}")
        if isinstance(self.mtp_layer, Mapping):
            try:
                object.__setattr__(self, "mtp_layer", build_config(MTPLayer, dict(self.mtp_layer), prefix="mtp_layer"))
            except ValueError as error:
                errors.append(str(error))
        elif self.mtp_layer is not None and not isinstance(self.mtp_layer, MTPLayer):
            errors.append(f"mtp_layer must be None or a mapping of MTPLayer fields, got {self.mtp_layer!r}")
        return errors

    def _resolve_mtp_layer(self) -> None:
        """Builds the MTP layer's config once (its errors are this config's) and keeps its resolved MLP options. A part
        whose kind trains with a facet (one for all the layers of its kind: diffjax.model.facets) must have the
        options of the model's layers of that kind."""
        try:
            layer = self.mtp_layer_config()
        except ValueError as error:
            problem = str(error).removeprefix("invalid ModelConfig: ")
            raise ValueError(f"invalid ModelConfig: mtp_layer: {problem}") from None
        for part, table in BLOCK_PARTS.items():
            kind, options = getattr(layer, part), getattr(layer, f"{part}_options")
            others = {getattr(segment.config, f"{part}_options") for segment in kinds.layer_segments(self)
                      if getattr(segment.config, part) == kind}
            if table.get(kind).training.facet is not None and others - {options}:
                raise ValueError(f"invalid ModelConfig: mtp_layer: {part} {kind!r} with {part}_options other than the "
                                 f"model's {kind} layers' ({_describe(others.pop())}): one training side serves every "
                                 f"layer of a kind; leave mtp_layer.{part}_options unset (the model's)")
        if self.mtp_layer is not None and self.mtp_layer.mlp_options is not None:
            object.__setattr__(self, "mtp_layer", dataclasses.replace(self.mtp_layer, mlp_options=layer.mlp_options))

    def mtp_layer_config(self) -> "ModelConfig":
        """The config the MTP blocks' decoder layer is built from: the first layer's with a plain residual and
        mtp_layer's changes (a part changed to the model's own kind keeps the model's options unless they are given:
        mtp_layer.mlp=moe is the model's mixture of experts), every position windowed when there is a window (no
        global_layers), and no MTP depths of its own."""
        changes = {"residual": MTP_RESIDUAL, **(self.mtp_layer.changes() if self.mtp_layer is not None else {})}
        if changes.get("mlp") == self.mlp and "mlp_options" not in changes:  # the model's kind: its options
            changes["mlp_options"] = self._given_options("mlp")
        without_depths = self.replace(mtp_depths=0, mtp_layer=None)  # (its segments' configs check no MTP layer)
        return kinds.layer_segments(without_depths)[0].config.replace(global_layers=(), **changes)

    def _size_errors(self) -> list[str]:
        errors = []
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                errors.append(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_kv_heads", "head_dim", "mlp_dim"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                errors.append(f"{name} must be a positive integer or None, got {value!r}")
        return errors

    def _window_errors(self) -> list[str]:
        window, layers = self.attention_window, self.global_layers
        errors = []
        if window is not None and (not _is_int(window) or window <= 0):
            errors.append(f"attention_window must be None (whole context) or a positive integer (keys per query), got "
                          f"{window!r}")
        if not isinstance(layers, tuple):
            return errors + [f"global_layers must be a list of layer indices, got {layers!r}"]
        bad = [i for i in layers if not _is_int(i) or not 0 <= i < self.num_layers]
        if bad:
            errors.append(f"global_layers must hold 0-based layer indices below num_layers ({self.num_layers}), "
                          f"got {bad}")
        if len(set(layers)) != len(layers):
            errors.append(f"global_layers has repeats: {list(layers)}")
        if layers and window is None:
            errors.append(f"global_layers {list(layers)} needs an attention_window (without one every layer is global)")
        theta = self.window_rope_theta
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0):
            errors.append(f"window_rope_theta must be None (as the global layers) or > 0, got {theta!r}")
        elif theta is not None and window is None:
            errors.append(f"window_rope_theta {theta!r} needs an attention_window (it is the windowed layers' theta)")
        return errors

    def _numerics_errors(self) -> list[str]:
        checks = [
            (self.activation in ACTIVATIONS, one_of("activation", self.activation, ACTIVATIONS)),
            (self.rope_style in ROPE_STYLES, one_of("rope_style", self.rope_style, ROPE_STYLES)),
            (self.rope_type in ROPE_TYPES, one_of("rope_type", self.rope_type, ROPE_TYPES)),
            (self.remat in REMAT_POLICIES, one_of("remat", self.remat, REMAT_POLICIES)),
            (isinstance(self.scan_layers, bool), f"scan_layers must be true or false, got {self.scan_layers!r}"),
            (self.dtype in DTYPES, one_of("dtype", self.dtype, DTYPES)),
            (self.param_dtype in DTYPES, one_of("param_dtype", self.param_dtype, DTYPES)),
            (self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps!r}"),
            (isinstance(self.subln, bool), f"subln must be true or false, got {self.subln!r}"),
            (self.subln_eps is None or self.subln_eps > 0,
             f"subln_eps must be None (norm_eps) or > 0, got {self.subln_eps!r}"),
            (_is_int(self.lambda_init_depth_offset),
             f"lambda_init_depth_offset must be an integer, got {self.lambda_init_depth_offset!r}"),
            (self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta!r}"),
            (self.init_std > 0, f"init_std must be > 0, got {self.init_std!r}"),
            (self.lambda_std >= 0, f"lambda_std must be >= 0, got {self.lambda_std!r}"),
            (self.lambda_init is None or 0.0 <= self.lambda_init < 1.0,
             f"lambda_init must be None (depth schedule) or in [0, 1), got {self.lambda_init!r}"),
        ]
        if self.rope_type == "llama3":
            checks += [
                (self.rope_factor >= 1, f"rope_factor must be >= 1 for llama3 RoPE, got {self.rope_factor!r}"),
                (0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                 "llama3 RoPE needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                 f"{self.rope_low_freq_factor!r} and {self.rope_high_freq_factor!r}"),
                (self.rope_original_max_len > 0, "rope_original_max_len must be > 0"),
            ]
        if self.rope_type == "yarn":
            checks += [
                (self.rope_factor >= 1, f"rope_factor must be >= 1 for yarn RoPE, got {self.rope_factor!r}"),
                (0 < self.rope_beta_slow < self.rope_beta_fast,
                 f"yarn RoPE needs 0 < rope_beta_slow < rope_beta_fast, got {self.rope_beta_slow!r} and "
                 f"{self.rope_beta_fast!r}"),
                (self.rope_original_max_len > 0, "rope_original_max_len must be > 0"),
                (self.rope_mscale is None or self.rope_mscale > 0,
                 f"rope_mscale must be None (no softmax factor) or > 0, got {self.rope_mscale!r}"),
            ]
        elif self.rope_mscale is not None:
            checks.append((False, f"rope_mscale is YaRN's (rope_type 'yarn'), got {self.rope_mscale!r} with rope_type "
                                  f"{self.rope_type!r}"))
        return [message for ok, message in checks if not ok] + config_problems(self.attention_impl, self.dtype)

    def _derive_sizes(self, kind) -> tuple[str, ...]:
        """Resolve the sizes left None so that every field is concrete; returns their names."""
        derived = tuple(name for name in ("num_kv_heads", "head_dim", "mlp_dim") if getattr(self, name) is None)
        heads_per_width = kind.value_width * self.num_heads  # d = d_model / (value_width H): values fill d_model
        if self.head_dim is None:
            if self.d_model % heads_per_width:
                what = f"{kind.value_width} * num_heads" if kind.value_width > 1 else "num_heads"
                raise ValueError(
                    f"invalid ModelConfig: d_model ({self.d_model}) must be divisible by {what} "
                    f"({heads_per_width}) when head_dim is not given; set head_dim explicitly or change num_heads"
                )
            object.__setattr__(self, "head_dim", self.d_model // heads_per_width)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"invalid ModelConfig: num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads}) (attention {self.attention!r}: each kv head serves a whole group "
                "of query heads)"
            )
        if self.head_dim % 2:
            raise ValueError(f"invalid ModelConfig: head_dim must be even for RoPE, got {self.head_dim}")
        if self.mlp_dim is None:
            rounded = round(8 * self.d_model / 3 / MLP_MULTIPLE) * MLP_MULTIPLE
            object.__setattr__(self, "mlp_dim", max(MLP_MULTIPLE, rounded))
        return derived

    # ----------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        values = cls.legacy_values(values)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            named = ", ".join(name + did_you_mean(name, known) for name in unknown)
            raise ValueError(f"unknown ModelConfig keys {named}; valid keys: {sorted(known)}")
        return cls(**values)

    @classmethod
    def legacy_values(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """`values` with the flat keys of config files written before kinds had options (num_noise_heads,
        shared_diff_rank) moved into the chosen kind's `*_options`; such a key set to null for another kind is
        dropped (those files list every kind's keys), set to a value it is an error naming the kind that uses it."""
        values = dict(values)
        for part, table in BLOCK_PARTS.items():
            chosen = values.get(part, cls.__dataclass_fields__[part].default)
            for row in table.rows():
                for key, option in (row.options.legacy_keys.items() if row.options else ()):
                    if key not in values:
                        continue
                    value = values.pop(key)
                    if row.name == chosen:
                        options = dict(values.get(f"{part}_options") or {})
                        values[f"{part}_options"] = {option: value, **options}
                    elif value is not None:
                        raise ValueError(f"invalid ModelConfig: {key} is only used by {part} {row.name!r} "
                                         f"({part}_options.{option}), got {value!r} with {part} {chosen!r}")
        return values

    def to_dict(self) -> dict[str, Any]:
        """The fields as given: derived sizes and options are None again, so a saved config re-derives them; a
        kind without options has no `*_options` entry."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update({name: None for name in self.derived if "." not in name}, global_layers=list(self.global_layers))
        if self.mtp_layer is not None:
            values["mtp_layer"] = {name: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
                                   for name, value in self.mtp_layer.changes().items()}
        for part in BLOCK_PARTS:
            options = self._given_options(part)
            if options is None:
                del values[f"{part}_options"]
            else:
                values[f"{part}_options"] = options
        return values

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`; sizes and options that were derived are derived again from the new fields, and a
        part whose kind changes starts from its new kind's default options (unless `changes` gives them)."""
        values = {name: None for name in self.derived if "." not in name}
        for part in BLOCK_PARTS:
            kept = changes.get(part, getattr(self, part)) == getattr(self, part)
            values[f"{part}_options"] = self._given_options(part) if kept else None
        return dataclasses.replace(self, **{**values, **changes})

    def _given_options(self, part: str) -> dict[str, Any] | None:
        prefix = f"{part}_options."
        derived = tuple(name[len(prefix):] for name in self.derived if name.startswith(prefix))
        return kinds.given_options(getattr(self, f"{part}_options"), derived)

    def window_at(self, depth: int) -> int | None:
        """The sliding window of layer `depth` (None: it attends the whole causal context)."""
        return None if depth in self.global_layers else self.attention_window

    @property
    def mixes_windows(self) -> bool:
        """Whether some layers are windowed and others global (a scanned stack then picks per layer at run time)."""
        return self.attention_window is not None and bool(self.global_layers)

    def mean_context(self, depth: int, seq_len: int) -> float:
        """Keys a query of layer `depth` attends on average over a causal sequence of seq_len tokens (T / 2 without a
        window, the FLOP-counting convention; W - W^2 / 2T under a window W < T)."""
        window = self.window_at(depth)
        if window is None or window >= seq_len:
            return seq_len / 2
        return window - window * window / (2 * seq_len)

    def lambda_init_at(self, depth: int) -> float:
        if self.lambda_init is not None:
            return float(self.lambda_init)
        return lambda_init_for_depth(depth, self.lambda_init_depth_offset)

    @property
    def subln_norm_eps(self) -> float:
        """The epsilon of the per-head subln (subln_eps, or norm_eps when that is None)."""
        return self.norm_eps if self.subln_eps is None else float(self.subln_eps)

    @property
    def num_query_groups(self) -> int:
        """n_rep: query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def param_counts(self, *, active: bool = False) -> dict[str, int]:
        """Parameters per part, counted from the shapes (tied embeddings count once); active: those one token uses (a
        mixture of experts' routed experts: the top_k it is sent to)."""
        D = self.d_model
        counts = {"embedding": self.vocab_size * D, "final_norm": D,
                  "lm_head": 0 if self.tie_embeddings else D * self.vocab_size}
        for segment in kinds.param_stacks(self):  # "decoder": the layers; "mtp": the MTP depths
            per_layer = _layer_params(segment.config, active) + block_kinds.get(segment.block).params(self)
            counts[segment.block] = counts.get(segment.block, 0) + segment.num_layers * per_layer
        return counts

    def param_count(self, *, include_lm_head: bool = True, active: bool = False) -> int:
        """Total parameters (active: those one token uses). `include_lm_head=False` counts one embedding matrix, as
        the paper does."""
        counts = self.param_counts(active=active)
        if not include_lm_head:
            counts.pop("lm_head")
        return sum(counts.values())


def _layer_params(c: ModelConfig, active: bool) -> int:
    """Parameters of one layer of config `c` (active: those one token uses)."""
    mlp = mlp_kinds.get(c.mlp)
    mlp_params = mlp.active_params if active and mlp.active_params else mlp.params
    return (attention_kinds.get(c.attention).attention_params(c) + mlp_params(c)
            + residual_kinds.get(c.residual).params(c) + 2 * c.d_model)  # + the two pre-norms


@dataclasses.dataclass(frozen=True)
class BlockRow:
    """A row a model's layers are built from: its part ("attention", "mlp", "residual"; "block": a row of
    diffjax.block_kinds), the row, and the layers (the MTP depths numbered on from num_layers)."""

    part: str
    row: Any
    layers: tuple[int, ...]


def block_rows(config: ModelConfig) -> tuple[BlockRow, ...]:
    """Every row the model's stacks are built from (diffjax.kinds.param_stacks: the layers, then the MTP depths),
    each once with the layers built with it (a segment's own rows too: an MoE's dense first layers' MLP), by part,
    then in order of first use. The trainer reads their `training`."""
    tables = {**BLOCK_PARTS, "block": block_kinds.TABLE}
    layers_of: dict[tuple[str, str], list[int]] = {}
    stacks = kinds.param_stacks(config)
    for part in tables:
        for segment in stacks:
            name = segment.block if part == "block" else getattr(segment.config, part)
            layers_of.setdefault((part, name), []).extend(range(segment.start, segment.stop))
    return tuple(BlockRow(part, tables[part].get(name), tuple(layers)) for (part, name), layers in layers_of.items())


def stack_config(config: ModelConfig, layer: int) -> ModelConfig:
    """The config layer `layer` is built with (its stack's: diffjax.kinds.param_stacks; the MTP depths numbered on
    from num_layers)."""
    return next(segment.config for segment in kinds.param_stacks(config) if segment.start <= layer < segment.stop)


def _describe(options) -> str:
    return "no options" if options is None else options.describe() or repr(options)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _row(table: kinds.Table, name):
    """The row `name` names, or the error that says what is allowed."""
    try:
        return table.get(name)
    except ValueError as error:
        return str(error)
