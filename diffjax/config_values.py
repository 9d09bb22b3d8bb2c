"""Config values from YAML or the command line, converted by dataclass field types (jax-free: ModelConfig builds its
kinds' options with it, the run config its sections).

`build_config(cls, values)` builds a frozen dataclass from a nested mapping: unknown keys and values of the wrong
type are errors that name the key and what is allowed; command-line strings become the field's type ("3e-4" a
float where a float is expected). A class may rename keys older config files used (`legacy_values`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any


def read_yaml_mapping(path) -> dict:
    """The mapping a YAML file holds (a pathlib or etils path; empty: {}). ValueError in one line naming the file and
    the line and column of a syntax error, or what the file holds instead of a mapping."""
    import yaml

    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"config file {path}{where}: not valid YAML ({getattr(error, 'problem', None) or error})") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of sections, got {type(values).__name__}")
    return values


def plain(value):
    """Tuples as lists, recursively (for YAML / JSON)."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def convert(value, annotation, key: str):
    """`value` (from YAML or a command-line string) as the field type `annotation`; errors name `key`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            if type(None) in options:
                return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return convert(value, option, key)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: cannot use {value!r} ({'; '.join(errors)})")
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping of {annotation.__name__} fields, got {value!r}")
        return build_config(annotation, value, prefix=key)
    if origin is tuple:
        (item_type, *_rest) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return tuple(convert(item, item_type, f"{key}[{i}]") for i, item in enumerate(value))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be an integer, got {value!r}") from None
        if not (math.isfinite(number) and number == int(number)):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return int(number)
    if annotation is float:
        if isinstance(value, bool):
            raise ValueError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    if annotation is Any:  # converted by the class that reads it (ModelConfig's kind options)
        return value
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return str(value)
    raise TypeError(f"{key}: unsupported field type {annotation!r}")


def build_config(cls, values: dict[str, Any], *, prefix: str = ""):
    """`cls(**values)` with nested dataclasses built recursively and values converted to field types."""
    if hasattr(cls, "legacy_values"):
        values = cls.legacy_values(values)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(where + k for k in unknown)}; "
            f"valid keys{' under ' + prefix if prefix else ''}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        message = str(error)
        raise ValueError(message if prefix in message or not prefix else f"{prefix}: {message}") from None
