"""The checkpoint formats diffjax reads and writes: one row per format, as diffjax.kinds' tables hold the block parts,
each defined by one module per family (diffjax.convert.llama, .diffllama, .motif, .motif3; unilm's attention modules
are diffjax.convert.unilm's). No jax: config.json <-> ModelConfig and the weight plans are plain Python and numpy.

A row says how a config.json is recognised (`model_type`, read in any case; a variant of a model_type, as Motif 3 is
of Motif's, also `detect`s its own), which ModelConfigs it holds (its attention kinds, narrowed by `holds`: exactly one
row holds a config), config in (config.json -> ModelConfig fields) and out (ModelConfig -> the config.json keys the
format models), the weight plan (diffjax.convert.weight_plan.Row per tensor) and what it cannot hold (export problems,
one line each). The table does what every format shares, so that a format is detected once (`detect`, from a
config.json; `of_config`, from a ModelConfig) and nothing else under diffjax/convert/ names a model_type or a kind
(tests/test_formats.py): required keys and dtypes on the way in; on the way out, an export's config.json is the
source's (the conversion keeps it in RUN/hf/) with the keys the format models replaced, so every key diffjax does not
model travels verbatim.

A new format is a module defining its row, registered with `register` (tests/test_formats.py defines a toy one).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping

import numpy as np

from diffjax import kinds
from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError

# The modules whose rows are built in (imported, and so registered, when the table is first read).
BUILT_IN = ("diffjax.convert.llama", "diffjax.convert.diffllama", "diffjax.convert.motif", "diffjax.convert.motif3")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
WRITER_KEYS = ("transformers_version",)  # keys about the program that wrote a config.json, not the model: not kept


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """A row of the table: one checkpoint format (the module docstring says what the table does with it)."""

    name: str  # "llama", "diffllama", "motif", "motif3"
    label: str  # for messages: "Llama", "Motif 3"
    model_type: str  # config.json's model_type, lower case (it is read in any case)
    architecture: str  # config.json's architectures entry: the transformers class
    attention: tuple[str, ...]  # the attention kinds it holds
    # (config.json dict) -> ModelConfig fields (dtypes aside); a ConversionError line for what it cannot read
    config_in: Callable
    config_out: Callable  # (ModelConfig) -> the config.json keys it models (dtypes, model_type, architectures aside)
    weight_plan: Callable  # (ModelConfig) -> [weight_plan.Row], one per checkpoint tensor, in the checkpoint's order
    export_problems: Callable = lambda config: []  # (ModelConfig) -> what this format cannot hold, one line each
    # (config.json dict) -> whether it is this variant of model_type; None: the model_type's plain format, which every
    # config.json of that model_type no variant detects is
    detect: Callable | None = None
    holds: Callable | None = None  # (ModelConfig) -> whether it exports as this format; None: its attention is ours
    spelling: str | None = None  # model_type as written where no source config.json spells it (None: model_type)
    skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)  # {tensor name prefix: why it is not read}
    remote_code: bool = False  # transformers builds it only from the directory's own code (verify: trust_remote_code)

    def holds_config(self, config: ModelConfig) -> bool:
        return self.holds(config) if self.holds is not None else config.attention in self.attention


class _Table(kinds.Table):
    """kinds.Table whose built-in rows are registered on first use (their modules import this one)."""

    def _load(self) -> None:
        for module in BUILT_IN:
            importlib.import_module(module)

    def register(self, row: CheckpointFormat, *, replace: bool = False) -> CheckpointFormat:
        plain = [r.name for r in self._rows.values() if r.model_type == row.model_type and r.detect is None
                 and r.name != row.name]
        if row.detect is None and plain:
            raise ValueError(f"format {row.name!r}: model_type {row.model_type!r} already has a plain format "
                             f"({plain[0]!r}); a variant says how to recognise it (detect)")
        return super().register(row, replace=replace)

    def get(self, name: str) -> CheckpointFormat:
        self._load()
        return super().get(name)

    def names(self) -> tuple[str, ...]:
        self._load()
        return super().names()

    def rows(self) -> tuple[CheckpointFormat, ...]:
        self._load()
        return super().rows()


TABLE = _Table("format")
register, unregister, get, names, rows = TABLE.register, TABLE.unregister, TABLE.get, TABLE.names, TABLE.rows


# ------------------------------------------------------------------------------ which format


def detected(hf: Mapping) -> CheckpointFormat | None:
    """The format of a config.json: a variant of its model_type that detects it, else the model_type's plain format;
    None for a model_type no row reads."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str):
        return None
    candidates = [row for row in rows() if row.model_type == model_type.lower()]
    variants = [row for row in candidates if row.detect is not None and row.detect(hf)]
    if len(variants) > 1:
        raise ConversionError(f"config.json: formats {[row.name for row in variants]} all claim it; a variant's detect "
                              "must recognise its own keys only")
    return next(iter(variants), None) or next((row for row in candidates if row.detect is None), None)


def detect(hf: Mapping) -> CheckpointFormat:
    """`detected`, or one ConversionError line naming the model_types diffjax reads."""
    row = detected(hf)
    if row is None:
        supported = tuple(sorted({row.model_type for row in rows()}))
        raise ConversionError(f"config.json: model_type {hf.get('model_type')!r} is not supported; supported: "
                              f"{supported} (in any case)")
    return row


def of_config(config: ModelConfig) -> CheckpointFormat:
    """The one format that holds `config` (what it exports as), or one ConversionError line saying which kinds the
    formats hold."""
    holding = [row for row in rows() if row.holds_config(config)]
    if len(holding) > 1:
        raise ConversionError(f"formats {[row.name for row in holding]} all hold attention={config.attention!r}; "
                              "narrow a registered format's holds")
    if not holding:
        held = ", ".join(f"{row.label} (attention {', '.join(map(repr, row.attention))})"
                         for row in sorted(rows(), key=lambda row: row.label))
        raise ConversionError(f"cannot export to Hugging Face: attention={config.attention!r}: Hugging Face has "
                              f"{held} only")
    return holding[0]


def check_exportable(config: ModelConfig) -> CheckpointFormat:
    """The format `config` exports as; ConversionError naming each setting that format cannot hold."""
    row = of_config(config)
    if problems := row.export_problems(config):
        raise ConversionError(f"cannot export to Hugging Face ({row.label}): " + "; ".join(problems))
    return row


# ------------------------------------------------------------------------------ config.json <-> ModelConfig


def dtype_name(dtype) -> str:
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    return {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}.get(name, name)


def model_config(row: CheckpointFormat, hf: Mapping, *, dtype=None, param_dtype=None) -> ModelConfig:
    """The ModelConfig of a config.json of format `row`. dtype None: the checkpoint's own (config.json's dtype)."""
    if missing := [key for key in REQUIRED if key not in hf]:
        raise ConversionError(f"config.json: missing required key(s) {missing}")
    fields = row.config_in(hf)
    dtype = dtype_name(dtype if dtype is not None else hf.get("dtype") or hf.get("torch_dtype") or "float32")
    try:
        config = ModelConfig(**fields, dtype=dtype, param_dtype=dtype_name(param_dtype) if param_dtype else dtype)
    except ValueError as error:  # ModelConfig's own validation, e.g. num_heads not divisible by num_kv_heads
        raise ConversionError(f"config.json describes a {row.label} model diffjax cannot build: {error}") from None
    if not row.holds_config(config):  # (a format's own bug: what it reads would export as another format)
        raise ConversionError(f"format {row.name!r} read config.json as attention={config.attention!r}, which it does "
                              "not hold: its config_in and holds / attention must agree")
    return config


def config_from_hf(hf: Mapping, *, dtype=None, param_dtype=None) -> ModelConfig:
    """ModelConfig for an HF config.json dict of any registered format (detected from it)."""
    return model_config(detect(hf), hf, dtype=dtype, param_dtype=param_dtype)


def config_json(row: CheckpointFormat, config: ModelConfig, *, dtype: str, source: Mapping | None = None) -> dict:
    """config.json of `config` in format `row`: the keys the format models from `config`, every other key of `source`
    (the config.json it was converted from, when of the same format) verbatim, a dict value key by key, and
    model_type as the source spelled it."""
    modelled = {"architectures": [row.architecture], "model_type": row.spelling or row.model_type,
                **row.config_out(config), "dtype": dtype, "torch_dtype": dtype}
    kept = {"use_cache": True}
    if source is not None and detected(source) is row:
        kept.update((key, value) for key, value in source.items() if key not in WRITER_KEYS)
        modelled["model_type"] = source["model_type"]
    return dict(sorted(_merged(kept, modelled).items()))


def _merged(kept: dict, modelled: Mapping) -> dict:
    out = dict(kept)
    for key, value in modelled.items():
        both_dicts = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _merged(out[key], value) if both_dicts else value
    return out
