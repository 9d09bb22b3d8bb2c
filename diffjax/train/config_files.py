"""The run configs shipped with the package (diffjax/configs/), by name: a config's path under diffjax/configs/
without `.yaml` (`tiny`, `paper/diff-1.4b`, `motif3/small`). Package data, so an installed wheel trains without
the repository."""

from __future__ import annotations

import os
from pathlib import Path

from diffjax import storage
from diffjax.config_values import did_you_mean

SHIPPED = Path(__file__).resolve().parents[1] / "configs"
DEFAULT = "tiny"  # what `diffjax-train` (and `python train.py`) trains without --config


def shipped_names() -> list[str]:
    return sorted(path.relative_to(SHIPPED).with_suffix("").as_posix() for path in SHIPPED.rglob("*.yaml"))


def config_file(name_or_path: str | os.PathLike) -> str | os.PathLike:
    """An existing file or a gs:// URL as given; otherwise the shipped config of that name (`.yaml` and the
    repository's former `configs/` prefix may be written: `configs/tiny.yaml` still names tiny)."""
    if storage.is_url(name_or_path) or Path(name_or_path).is_file():
        return name_or_path
    name = Path(name_or_path).as_posix().removesuffix(".yaml").removeprefix("configs/")
    names = shipped_names()
    if name in names:
        return SHIPPED / f"{name}.yaml"
    raise FileNotFoundError(f"config {os.fspath(name_or_path)!r} is neither a file nor a shipped config"
                            f"{did_you_mean(name, names)} (the shipped ones: {', '.join(names)})")
