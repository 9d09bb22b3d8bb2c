"""The run configs shipped with the package, by name: a config's path under the repository's configs/ without
`.yaml` (`tiny`, `paper/diff-1.4b`, `motif3/small`). pyproject.toml maps the package `diffjax.configs` to configs/,
so an installed wheel holds them as package data (diffjax/configs/) and trains without the repository."""

from __future__ import annotations

import os
from pathlib import Path

from diffjax import storage
from diffjax.config_values import did_you_mean

_PACKAGE = Path(__file__).resolve().parents[1]
# An installed wheel: diffjax/configs/. A checkout (an editable install, PYTHONPATH, python train.py): configs/ beside
# diffjax/. The wheel's is looked for first: a site-packages/configs/ beside it would be another distribution's.
SHIPPED = next((d for d in (_PACKAGE / "configs", _PACKAGE.parent / "configs") if d.is_dir()), _PACKAGE / "configs")
DEFAULT = "tiny"  # what `diffjax-train` (and `python train.py`) trains without --config


def shipped_names() -> list[str]:
    return sorted(path.relative_to(SHIPPED).with_suffix("").as_posix() for path in SHIPPED.rglob("*.yaml"))


def config_file(name_or_path: str | os.PathLike) -> str | os.PathLike:
    """An existing file or a gs:// URL as given; otherwise the shipped config of that name (`.yaml` and the
    repository's `configs/` prefix may be written: `configs/tiny.yaml` names tiny outside a checkout too)."""
    if storage.is_url(name_or_path) or Path(name_or_path).is_file():
        return name_or_path
    name = Path(name_or_path).as_posix().removesuffix(".yaml").removeprefix("configs/")
    names = shipped_names()
    if name in names:
        return SHIPPED / f"{name}.yaml"
    raise FileNotFoundError(f"config {os.fspath(name_or_path)!r} is neither a file nor a shipped config"
                            f"{did_you_mean(name, names)} (the shipped ones: {', '.join(names)})")
