"""What the three tables of block parts share (jax-free): a decoder block is an attention kind
(diffjax.attention_kinds) + an MLP kind (diffjax.mlp_kinds) + a residual form (diffjax.residual_kinds), each
chosen by name in ModelConfig (`attention`, `mlp`, `residual`) and each a row of its table.

A row names its module ("package.module:Class", imported when a model is built, or the class itself) and may
carry its own options: a frozen dataclass subclassing `Options` whose fields are that kind's settings and
nothing else's (GDA's noise heads, Shared DIFF's rank). ModelConfig holds them as `attention_options`,
`mlp_options` and `residual_options` (mappings in YAML: `model.attention_options.num_noise_heads=2`); only the
kind's module, its row and its own converter read them.

A row also carries its training side (`Training`): the parameters weight decay spares, the projections LoRA may
adapt, the mesh axes it gives a meaning to, and its facet (diffjax.model.facets.Facet: what its layers hand the
train step, a step check, an update after the optimizer's, metrics and guards). The trainer reads the rows of a
model's layers and names no kind.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, ClassVar, Generic, Mapping, TypeVar

from diffjax.config_values import build_config, nonfinite_problems, one_of


class Options:
    """A kind's own settings (subclass it as a frozen dataclass). A field left None may be derived from the rest
    of the ModelConfig (`defaults`); `problems` says what is invalid once every size is known."""

    # Flat ModelConfig keys that config files written before options existed used -> this class's field.
    legacy_keys: ClassVar[Mapping[str, str]] = {}
    # Fields whose value is one of a fixed set -> that set (checked before `problems`, listed by --help-keys).
    choices: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    def defaults(self, config) -> dict[str, Any]:
        """{field: value} for the fields left None, derived from `config` (its shared sizes are resolved)."""
        return {}

    def problems(self, config) -> list[str]:
        """What is invalid about these options in `config`, one line each (they and the sizes resolved)."""
        return []

    def describe(self) -> str:
        """A few words for logs and tables ("2 noise heads"); "" when there is nothing to say."""
        return ""

    def layer_changes(self, config, depth: int) -> dict[str, Any]:
        """ModelConfig changes (ModelConfig.replace keywords) that build layer `depth` ({}: as the config says): an
        MoE kind's dense first layers. Runs of layers with equal changes are the model's segments (layer_segments)."""
        return {}


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """A projection LoRA may adapt (a `lora.targets` entry): the kernels it covers in the part's module."""

    name: str  # the lora.targets entry: "q", "gate", "experts", ...
    kernels: tuple[str, ...]  # parameter names in the part's module ("q_kernel"; Shared DIFF's "q_base")
    grouped: bool = True  # in its part's group ("attention", "mlp"); False: adapted only when named (routed experts)


@dataclasses.dataclass(frozen=True)
class Training:
    """A row's training side. What is here is data (jax-free: config checks read it); what runs in the train step
    and as metrics are written is the facet."""

    # Regular expressions searched in a parameter's dotted path: the part's parameters weight decay spares when
    # optim.no_decay is left to the model (DIFF's "lambda_": decay would pull lambda toward lambda_init)
    no_decay: tuple[str, ...] = ()
    lora_targets: tuple[LoraTarget, ...] = ()  # the projections lora.targets may name
    mesh_axes: tuple[str, ...] = ()  # the mesh axes only kinds like this one give a meaning to (the MoE's "expert")
    # "package.module:Class" of a diffjax.model.facets.Facet subclass (imported when a trainer is built), or the
    # class itself; None: nothing runs in the step for this kind
    facet: str | type | None = None


NO_TRAINING = Training()


@dataclasses.dataclass(frozen=True)
class PartKind:
    """A row of the MLP kinds' or the residual forms' table (attention kinds have a richer row: AttentionKind)."""

    name: str  # the ModelConfig field's value (ModelConfig.mlp, ModelConfig.residual)
    label: str  # for tables and logs
    module: str | type  # "package.module:Class" (imported when a model is built) or the class itself
    params: Callable = lambda config: 0  # (ModelConfig) -> the part's parameters in one layer
    # (ModelConfig) -> the parameters one token's forward multiplies by in one layer (FLOPs: 2 per multiply-add); a
    # mixture of experts counts the experts a token is routed to, not all of them
    matmul_params: Callable = lambda config: 0
    # (ModelConfig) -> the parameters one token uses in one layer (a mixture of experts: the routed experts it is sent
    # to); None: all of `params`
    active_params: Callable | None = None
    options: type[Options] | None = None  # the kind's own settings (ModelConfig.mlp_options / residual_options)
    training: Training = NO_TRAINING  # its training side
    # (ModelConfig) -> values per token of the part's widest activation, what a memory plan counts (an MLP: the hidden
    # units one token computes, a mixture of experts' top_k routed and shared ones; a residual form: its stream);
    # None: mlp_dim for an MLP, d_model for a residual form
    activation_width: Callable | None = None
    # (ModelConfig) -> (used, of): the share of the part's parameters on the "expert" logical axis one token uses (a
    # mixture of experts: top_k of num_experts); None: the part has none
    expert_share: Callable | None = None
    # (ModelConfig, expert shards S) -> rows per token an expert-parallel dispatch buffer holds (ops/expert_parallel.py:
    # S destinations x min(top_k, E / S) rows each, S times what a token sends), what a memory plan counts; None: the
    # part dispatches nothing
    dispatch_rows: Callable | None = None


def choice_problems(options: Options) -> list[str]:
    """The usual check of the fields `options.choices` names: each one of its values."""
    return [one_of(name, getattr(options, name), allowed) for name, allowed in options.choices.items()
            if getattr(options, name) not in allowed]


def positive_int_problems(options: Options, *names: str) -> list[str]:
    """The usual check of size fields: each a positive integer (or None before defaults fill it)."""
    problems = []
    for name in names:
        value = getattr(options, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            problems.append(f"{name} must be a positive integer, got {value!r}")
    return problems


K = TypeVar("K")


class Table(Generic[K]):
    """Rows by name: `register` adds one (a kind defined in user code or a test), `get` finds one."""

    def __init__(self, field: str):
        self.field = field  # the ModelConfig field that names a row
        self._rows: dict[str, K] = {}

    def register(self, row: K, *, replace: bool = False) -> K:
        """Add `row` (replace=True overwrites a row of the same name)."""
        if row.name in self._rows and not replace:
            raise ValueError(f"{self.field} kind {row.name!r} is already registered "
                             "(pass replace=True to overwrite it)")
        self._rows[row.name] = row
        return row

    def unregister(self, name: str) -> None:
        self._rows.pop(name, None)

    def get(self, name: str) -> K:
        if name not in self._rows:
            raise ValueError(one_of(self.field, name, self.names()))
        return self._rows[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._rows)

    def rows(self) -> tuple[K, ...]:
        return tuple(self._rows.values())


def resolve_options(row, given, config, field: str) -> tuple[Options | None, tuple[str, ...]]:
    """(the row's options for `config` with defaults filled, the names of the fields that were derived) from what
    was given: None, a mapping (YAML / the command line) or an instance of the row's options class. Errors name
    `field` (e.g. "attention_options.num_noise_heads") and say what is allowed."""
    options_class = row.options
    if options_class is None:
        if given:  # (None and an empty mapping are no options)
            shown = dict(given) if isinstance(given, Mapping) else given
            raise ValueError(f"{field}: {row.name!r} has no options, got {shown!r}")
        return None, ()
    if given is None:
        given = {}
    if isinstance(given, Mapping):
        given = build_config(options_class, dict(given), prefix=field)
    elif not isinstance(given, options_class):
        raise ValueError(f"{field} must be a mapping of {options_class.__name__} fields, got {given!r}")
    derived = tuple(f.name for f in dataclasses.fields(given) if getattr(given, f.name) is None)
    resolved = dataclasses.replace(given, **{k: v for k, v in given.defaults(config).items() if k in derived})
    problems = nonfinite_problems(resolved, f"{field}.") or \
        [f"{field}.{line}" for line in choice_problems(resolved) + resolved.problems(config)]
    if problems:
        raise ValueError("; ".join(problems))
    return resolved, derived


def given_options(options: Options | None, derived: tuple[str, ...]) -> dict[str, Any] | None:
    """The options as given (derived fields None again, so a saved config derives them afresh); None: no options."""
    if options is None:
        return None
    return {f.name: None if f.name in derived else getattr(options, f.name) for f in dataclasses.fields(options)}


def module_class(row, base: type) -> type:
    """The class a row names: its `module` ("package.module:Class", imported now, or the class), a `base` subclass."""
    return named_class(row.name, row.module, base)


def named_class(kind: str, named: str | type, base: type) -> type:
    """The class `named` ("package.module:Class", imported now, or the class itself), a `base` subclass; errors name
    the kind."""
    if isinstance(named, type):
        cls = named
    else:
        module_name, _, class_name = named.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"kind {kind!r}: {named!r} is not a {base.__name__} subclass")
    return cls



FIRST_SEGMENT = "blocks"  # the params key of a model's first (often only) segment of layers


DECODER_BLOCK = "decoder"  # the block kind of the model's layers (diffjax.block_kinds)
MTP_BLOCK = "mtp"  # the block kind of the multi-token-prediction depths


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of consecutive layers [start, stop) built alike: one scanned stack of `config`'s block (the model's
    config with the layers' `Options.layer_changes` applied; its num_layers and depth-indexed fields stay the
    model's). `block` names the row of diffjax.block_kinds whose module is the class of its layers. Its params live
    under `name`: "blocks" for the first (a model of one segment is stored as before segments existed),
    "blocks_from_<start>" for the others; `stack_name` names another stack (MTP_STACK)."""

    start: int
    stop: int
    config: Any
    stack_name: str | None = None
    block: str = DECODER_BLOCK

    @property
    def name(self) -> str:
        if self.stack_name is not None:
            return self.stack_name
        return FIRST_SEGMENT if self.start == 0 else f"{FIRST_SEGMENT}_from_{self.start}"

    @staticmethod
    def start_of(name: str) -> int | None:
        """The first layer of the segment whose params live under `name` (Segment.name's inverse for the layer
        segments); None when `name` names no layer segment (the embedding, the final norm, the MTP stack, ...)."""
        if name == FIRST_SEGMENT:
            return 0
        prefix, _, start = name.partition("_from_")
        return int(start) if prefix == FIRST_SEGMENT and start.isdigit() and start[0] != "0" else None

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


def layer_segments(config) -> tuple[Segment, ...]:
    """The model's layers as runs of equally built layers (one Segment, the config itself, unless a kind's options
    build some layers differently)."""
    parts = [getattr(config, f"{part}_options") for part in ("attention", "mlp", "residual")]
    changes = [{k: v for options in parts if options is not None
                for k, v in options.layer_changes(config, depth).items()} for depth in range(config.num_layers)]
    segments, start = [], 0
    for depth in range(1, config.num_layers + 1):
        if depth == config.num_layers or changes[depth] != changes[start]:
            segments.append(Segment(start, depth, config.replace(**changes[start]) if changes[start] else config))
            start = depth
    return tuple(segments)


# The multi-token-prediction blocks' stack (ModelConfig.mtp_depths): a name under "blocks" so that what walks the
# stacked params by that prefix (checkpoints, LoRA merges) takes it as a stack.
MTP_STACK = "blocks_mtp"


def param_stacks(config) -> tuple[Segment, ...]:
    """Every stack of block params: the layer segments, then the MTP depths' (one Segment of `mtp_depths` MTP_BLOCK
    blocks named MTP_STACK, depths counted on from num_layers, built with ModelConfig.mtp_layer_config)."""
    segments = layer_segments(config)
    if not config.mtp_depths:
        return segments
    L = config.num_layers
    return segments + (Segment(L, L + config.mtp_depths, config.mtp_layer_config(), MTP_STACK, MTP_BLOCK),)
