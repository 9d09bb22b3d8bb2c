"""The checkpoint formats diffjax reads and writes: one row per format, as diffjax.kinds' tables hold the block parts,
each defined by one module per family (diffjax.convert.llama, .diffllama, .motif, .motif3; unilm's attention modules
are diffjax.convert.unilm's). No jax: config.json <-> ModelConfig and the weight plans are plain Python and numpy.

A row says how a config.json is recognised (`model_type`, read in any case; a variant of a model_type, as Motif 3 is
of Motif's, also `detect`s its own), which ModelConfigs it holds (`holds`: sets of configs given by the values of
their kinds and options, `Configs`; a config is held by at most one format, checked when a format registers), config
in (config.json -> ModelConfig fields) and out (ModelConfig -> the config.json keys the format models), the weight
plan (diffjax.convert.weight_plan.Row per tensor) and what it cannot hold (export problems, one line each). The table
does what every format shares, so that a format is detected once (`detect`, from a config.json; `of_config`, from a
ModelConfig) and nothing else under diffjax/convert/ names a model_type or a kind (tests/test_formats.py): required
keys and dtypes on the way in; on the way out, an export's config.json is the source's (the conversion keeps it in
RUN/hf/) with the keys the format models replaced, so every key diffjax does not model travels verbatim.

A new format is a module defining its row, registered with `register` (tests/test_formats.py defines two toy ones).
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
class Not:
    """Any value but these: a `Configs` field's values (activation=Not("polynorm"))."""

    values: tuple

    def __init__(self, *values):
        object.__setattr__(self, "values", values)


ANY = Not()


def _admits(allowed: tuple | Not, value) -> bool:
    return value not in allowed.values if isinstance(allowed, Not) else value in allowed


def _words(allowed: tuple | Not) -> str:
    """ "'diff', 'gda'" or "not 'polynorm'"."""
    listed = ", ".join(map(repr, allowed.values if isinstance(allowed, Not) else allowed))
    return f"not {listed}" if isinstance(allowed, Not) else listed


class Configs:
    """A set of ModelConfigs by the values of some of their fields: `Configs(attention="diff",
    activation=Not("polynorm"), lambda_init_depth_offset=0)` is every config with attention "diff", any activation but
    "polynorm" and offset 0, whatever its other fields. A field's values: one value, a tuple of them, or Not(values)."""

    def __init__(self, **values):
        known = {field.name for field in dataclasses.fields(ModelConfig)}
        if unknown := sorted(set(values) - known):
            raise ValueError(f"Configs: {unknown} are not ModelConfig fields")
        self.values = {name: v if isinstance(v, (Not, tuple)) else (v,) for name, v in values.items() if v != ANY}

    def __repr__(self) -> str:
        return f"Configs({self.describe()})"

    def __contains__(self, config: ModelConfig) -> bool:
        return not self.outside(config)

    def admits(self, name: str, value) -> bool:
        """Whether some config of this set has `value` in field `name`."""
        return _admits(self.values.get(name, ANY), value)

    def outside(self, config: ModelConfig) -> list[str]:
        """The fields whose value in `config` is not in this set's."""
        return [name for name, allowed in self.values.items() if not _admits(allowed, getattr(config, name))]

    def describe(self, *names: str) -> str:
        """ "attention 'diff', activation not 'polynorm'" (of `names`, or of every field it names)."""
        return ", ".join(f"{name} {_words(self.values[name])}" for name in names or self.values)

    def overlap(self, other: Configs) -> Configs | None:
        """The configs in both sets; None: none. (A field of Not values has values left without end.)"""
        both = {}
        for name in {**self.values, **other.values}:
            a, b = self.values.get(name, ANY), other.values.get(name, ANY)
            if isinstance(a, Not) and isinstance(b, Not):
                both[name] = Not(*a.values, *(v for v in b.values if v not in a.values))
                continue
            listed, other_values = (b, a) if isinstance(a, Not) else (a, b)
            both[name] = tuple(v for v in listed if _admits(other_values, v))
            if not both[name]:
                return None
        return Configs(**both)


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """A row of the table: one checkpoint format (the module docstring says what the table does with it)."""

    name: str  # "llama", "diffllama", "motif", "motif3"
    label: str  # for messages: "Llama", "Motif 3"
    model_type: str  # config.json's model_type, lower case (it is read in any case)
    architecture: str  # config.json's architectures entry: the transformers class
    holds: tuple[Configs, ...]  # the ModelConfigs it holds (exports as): no other format holds any of them
    # (config.json dict) -> ModelConfig fields (dtypes aside); a ConversionError line for what it cannot read
    config_in: Callable
    config_out: Callable  # (ModelConfig) -> the config.json keys it models (dtypes, model_type, architectures aside)
    weight_plan: Callable  # (ModelConfig) -> [weight_plan.Row], one per checkpoint tensor, in the checkpoint's order
    export_problems: Callable = lambda config: []  # (ModelConfig) -> what this format cannot hold, one line each
    # (config.json dict) -> whether it is this variant of model_type; None: the model_type's plain format, which every
    # config.json of that model_type no variant detects is
    detect: Callable | None = None
    spelling: str | None = None  # model_type as written where no source config.json spells it (None: model_type)
    skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)  # {tensor name prefix: why it is not read}
    remote_code: bool = False  # transformers builds it only from the directory's own code (verify: trust_remote_code)

    def holds_config(self, config: ModelConfig) -> bool:
        return any(config in configs for configs in self.holds)

    def holds_value(self, name: str, value) -> bool:
        """Whether it holds some config with `value` in field `name` (e.g. "attention", "gdla")."""
        return any(configs.admits(name, value) for configs in self.holds)

    def misses(self, config: ModelConfig) -> list[str]:
        """Why it does not hold `config`, by its nearest set: ["mlp='moe': Llama holds mlp 'gated' only", ...]."""
        nearest = min(self.holds, key=lambda configs: len(configs.outside(config)), default=Configs())
        return [f"{name}={getattr(config, name)!r}: {self.label} holds {nearest.describe(name)}"
                f"{'' if isinstance(nearest.values[name], Not) else ' only'}" for name in nearest.outside(config)]


class _Table(kinds.Table):
    """kinds.Table whose built-in rows are registered on first use (their modules import this one), and whose rows hold
    configs no other row holds."""

    _loading = False

    def _load(self) -> None:
        if self._loading:
            return
        self._loading = True
        try:
            for module in BUILT_IN:
                importlib.import_module(module)
        finally:
            self._loading = False

    def register(self, row: CheckpointFormat, *, replace: bool = False) -> CheckpointFormat:
        self._load()  # (a format registered before the built-in ones is checked against them)
        others = [r for r in self._rows.values() if r.name != row.name]
        plain = [r.name for r in others if r.model_type == row.model_type and r.detect is None]
        if row.detect is None and plain:
            raise ValueError(f"format {row.name!r}: model_type {row.model_type!r} already has a plain format "
                             f"({plain[0]!r}); a variant says how to recognise it (detect)")
        if not (isinstance(row.holds, tuple) and all(isinstance(configs, Configs) for configs in row.holds)):
            raise ValueError(f"format {row.name!r}: holds must be a tuple of formats.Configs, got {row.holds!r}")
        for other in others:
            for both in (a.overlap(b) for a in row.holds for b in other.holds):
                if both is not None:
                    raise ValueError(f"format {row.name!r} would hold configs format {other.name!r} holds "
                                     f"({both.describe()}): a config is held by one format; narrow one's holds")
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
    """The format that holds `config` (what it exports as; no other does), or one ConversionError line: the formats
    holding its attention kind, when none does, else what the nearest formats hold instead."""
    holding = [row for row in rows() if row.holds_config(config)]
    if holding:
        return holding[0]
    by_attention = [row for row in rows() if any("attention" not in configs.outside(config) for configs in row.holds)]
    if not by_attention:
        held = ", ".join(f"{row.label} (attention {_attention_words(row)})"
                         for row in sorted(rows(), key=lambda row: row.label) if row.holds)
        raise ConversionError(f"cannot export to Hugging Face: attention={config.attention!r}: Hugging Face has {held} "
                              "only")
    fewest = min(len(row.misses(config)) for row in by_attention)
    nearest = [row for row in by_attention if len(row.misses(config)) == fewest]
    labels = " / ".join(row.label for row in nearest)
    raise ConversionError(f"cannot export to Hugging Face ({labels}): " +
                          "; ".join(miss for row in nearest for miss in row.misses(config)))


def _attention_words(row: CheckpointFormat) -> str:
    """ "'diff', 'gda'": the attention kinds the row's sets name."""
    words = []
    for allowed in (configs.values["attention"] for configs in row.holds):
        words += [word for word in ([_words(allowed)] if isinstance(allowed, Not) else map(repr, allowed))
                  if word not in words]
    return ", ".join(words)


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
        raise ConversionError(f"format {row.name!r} read config.json as a model it does not hold "
                              f"({'; '.join(row.misses(config))}): its config_in and holds must agree")
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
