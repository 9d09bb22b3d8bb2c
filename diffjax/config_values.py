"""Config values from YAML or the command line, converted by dataclass field types (jax-free: ModelConfig builds its
kinds' options with it, the run config its sections).

`build_config(cls, values)` builds a frozen dataclass from a nested mapping: unknown keys and values of the wrong
type are errors that name the key and what is allowed; command-line strings become the field's type ("3e-4" a
float where a float is expected). A class may rename keys older config files used (`legacy_values`).

`did_you_mean` is the one way a name that is not allowed (a config key, a kind, an impl, a shipped config's name)
names the closest allowed ones: "unknown config key train.stesp (did you mean train.steps?)"; an unknown key also
finds the same name under another section ("train.lr (did you mean optim.lr?)").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import math
import numbers
import types
import typing
from typing import Any, Iterable

# Every dotted key of the class the outermost build_config builds (a RunConfig's: train.steps, optim.lr, ...), so
# that an unknown key nested in one section can be found under another.
_ALL_KEYS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("all_keys", default=())


def closest(name, allowed: Iterable) -> list[str]:
    """The allowed names closest to `name`: difflib's similarity at least 0.6 and within 0.1 of the best, up to 3."""
    scored = sorted(((difflib.SequenceMatcher(None, str(name), str(item)).ratio(), str(item)) for item in allowed),
                    key=lambda pair: -pair[0])
    return [item for score, item in scored[:3] if score >= max(0.6, scored[0][0] - 0.1)]


def did_you_mean(name, allowed: Iterable) -> str:
    """' (did you mean X?)' / ' (did you mean X or Y?)' naming the `closest` allowed names; '' when none is close."""
    return meant(closest(name, allowed))


def meant(names: Iterable[str], why: str = "") -> str:
    """The one wording of what was meant: ' (did you mean X or Y?)' naming `names`, `why` before it ('options are
    not abbreviated: '); '' for no names. (A one-line error ending in it needs no usage after it: command_line.)"""
    names = list(names)
    return f" ({why}did you mean {' or '.join(names)}?)" if names else ""


def one_of(field: str, value, allowed: Iterable) -> str:
    """The error for a `value` of `field` that is not one of `allowed`, naming the closest."""
    allowed = tuple(allowed)
    return f"{field} must be one of {allowed}, got {value!r}{did_you_mean(value, allowed)}"


def dotted_keys(cls, prefix: str = "") -> list[str]:
    """Every key of a config dataclass, dotted, nested dataclass fields included (`train`, `train.steps`, ...)."""
    hints, keys = typing.get_type_hints(cls), []
    for field in dataclasses.fields(cls):
        if field.init:
            keys.append(prefix + field.name)
            annotation = hints[field.name]
            nested = [a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a)] or [annotation]
            if dataclasses.is_dataclass(nested[0]):
                keys += dotted_keys(nested[0], f"{prefix}{field.name}.")
    return keys


def _unknown_key(where: str, name: str, fields: Iterable[str]) -> str:
    """The unknown key `where + name` with what was meant: the same name under another section (train.lr: optim.lr),
    else the closest names of its own section (`fields`), else the closest key anywhere."""
    key, everywhere = where + name, _ALL_KEYS.get()
    # (only for sections of the outermost class: a kind's options are not among its keys)
    in_tree = not where or where.rstrip(".") in everywhere
    elsewhere = [other for other in everywhere if other.rsplit(".", 1)[-1] == name and other != key] if in_tree else []
    close = elsewhere[:3] or [where + field for field in closest(name, fields)] or closest(key, everywhere)
    return key + meant(close)


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
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {value!r}") from None
        if not math.isfinite(number):  # nan, inf, and what overflows to inf (1e400)
            raise ValueError(_not_finite(key, value))
        return number
    if annotation is Any:  # converted by the class that reads it (ModelConfig's kind options)
        return value
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return str(value)
    raise TypeError(f"{key}: unsupported field type {annotation!r}")


def _not_finite(key: str, value) -> str:
    return f"{key} must be a finite number, got {value!r}"


@functools.cache
def _float_fields(cls) -> tuple[str, ...]:
    """The fields of a config dataclass typed float (or float | None)."""
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls)
                 if hints[f.name] is float or float in typing.get_args(hints[f.name]))


def nonfinite_problems(config, prefix: str = "") -> list[str]:
    """One line per float field of a config dataclass that holds nan or an infinity: no diffjax setting means
    anything there (an unbounded one is None), and a run with one diverges or computes nothing. `convert` refuses
    them from YAML and the command line; a config's own validation calls this for one built in Python."""
    values = ((name, getattr(config, name)) for name in _float_fields(type(config)))
    return [_not_finite(prefix + name, value) for name, value in values
            if isinstance(value, numbers.Real) and not math.isfinite(value)]


def build_config(cls, values: dict[str, Any], *, prefix: str = ""):
    """`cls(**values)` with nested dataclasses built recursively and values converted to field types."""
    with _all_keys_of(cls, outermost=not _ALL_KEYS.get()):
        return _build_config(cls, values, prefix)


@contextlib.contextmanager
def _all_keys_of(cls, outermost: bool):
    token = _ALL_KEYS.set(tuple(dotted_keys(cls))) if outermost else None
    try:
        yield
    finally:
        if token is not None:
            _ALL_KEYS.reset(token)


def _build_config(cls, values: dict[str, Any], prefix: str):
    if hasattr(cls, "legacy_values"):
        values = cls.legacy_values(values)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        named = [_unknown_key(where, key, fields) for key in unknown]
        raise ValueError(
            f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(named)}; "
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
