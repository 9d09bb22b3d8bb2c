"""Every key of a run config: its type, default, value, allowed values and one line of meaning. `train.py
--help-keys` prints them and the documentation's configuration reference is generated from them, so both say what the
config classes say: a field's meaning is its attribute docstring (the string literal on the line after the field),
read from the class's source as mkdocstrings reads it."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any, Callable

from diffjax import attention_impls, attention_kinds, config, mlp_kinds, residual_kinds
from diffjax.data.config import DATA_SOURCES
from diffjax.lora_config import target_names
from diffjax.mesh_axes import DISTRIBUTED_MODES
from diffjax.tokenizers.config import TOKENIZER_KINDS
from diffjax.train import config as run_config
from diffjax.train.optimizer_config import DECAYS

# Keys whose value is one of a fixed set (a list key: a list of them), read when asked so that a kind registered
# later is listed. A kind's options say their own (Options.choices), keyed as `<part>_options.<field>` whichever kind
# they belong to (option_choices).
ALLOWED: dict[str, Callable[[], tuple[str, ...]]] = {
    "model.attention": attention_kinds.names,
    "model.mlp": mlp_kinds.names,
    "model.residual": residual_kinds.names,
    "model.attention_impl": lambda: attention_impls.IMPLS,
    "model.activation": lambda: config.ACTIVATIONS,
    "model.rope_style": lambda: config.ROPE_STYLES,
    "model.rope_type": lambda: config.ROPE_TYPES,
    "model.dtype": lambda: config.DTYPES,
    "model.param_dtype": lambda: config.DTYPES,
    "model.remat": lambda: config.REMAT_POLICIES,
    "data.source": lambda: DATA_SOURCES,
    "data.tokenizer.kind": lambda: TOKENIZER_KINDS,
    "optim.decay": lambda: DECAYS,
    "train.progress": lambda: run_config.PROGRESS_STYLES,
    "train.on_nonfinite": lambda: run_config.NONFINITE_MODES,
    "train.wandb.mode": lambda: run_config.WANDB_MODES,
    "parallel.distributed": lambda: DISTRIBUTED_MODES,
    "lora.targets": target_names,
}


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted, as on the command line: "model.attention"
    type: str  # the field's annotation as written
    default: Any  # the class's default (dataclasses.MISSING: none)
    value: Any  # in the config walked (the default when walking a class)
    description: str  # the field's attribute docstring, on one line ("" when it has none)

    @property
    def allowed(self) -> tuple[str, ...] | None:
        return ALLOWED[self.name]() if self.name in ALLOWED else option_choices().get(self.name)


def option_choices() -> dict[str, tuple[str, ...]]:
    """`model.<part>_options.<field>` -> its allowed values, for every field a registered kind's options name in
    their `choices`."""
    return {f"model.{part}_options.{field}": allowed for part, row in kinds_with_options()
            for field, allowed in row.options.choices.items()}


@functools.cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal on the line after the field in `cls`'s source (and its bases'), whitespace
    folded to one line."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a class built at run time)
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for field, after in zip(body, body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                found[field.target.id] = " ".join(after.value.value.split())
    return found


def config_keys(section, prefix: str = "") -> list[Key]:
    """The keys of `section` (a config dataclass instance, or a class: its defaults), nested sections walked; a
    ModelConfig's `*_options` resolved to an Options instance are walked as `<part>_options.<field>`."""
    instance = section if not isinstance(section, type) else None
    cls = type(section) if instance is not None else section
    docs = attribute_docstrings(cls)
    keys = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        value = getattr(instance, field.name) if instance is not None else default
        name = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            keys += config_keys(value, name + ".")
        else:
            keys.append(Key(name, str(field.type), default, value, docs.get(field.name, "")))
    return keys


def option_keys(part: str, row) -> list[Key]:
    """The keys of one kind's options class with their defaults (`model.<part>_options.<field>`); [] for a kind
    without options."""
    return config_keys(row.options, f"model.{part}_options.") if row.options else []


def kinds_with_options() -> list[tuple[str, Any]]:
    """(part, row) of every registered kind of every block part that has options of its own."""
    return [(part, row) for part, table in config.BLOCK_PARTS.items() for row in table.rows() if row.options]


def describe_keys(run) -> str:
    """`train.py --help-keys`: every key with the value this run would use, then its type, default, allowed values
    and meaning on the next line."""
    lines = []
    for key in config_keys(run):
        lines.append(f"  {key.name} = {key.value!r}")
        facts = [key.type, f"default {key.default!r}"]
        if key.allowed:
            facts.append("one of: " + ", ".join(key.allowed))
        lines.append(f"      {'; '.join(facts)}. {key.description}")
    return "\n".join(lines)
