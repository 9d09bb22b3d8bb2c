"""The MLP modules, one per kind (diffjax.mlp_kinds is the table of kinds). `module_class(config)` is the class of
a config's kind: the row's `module`, a "package.module:Class" path imported on first use or the class itself."""

from __future__ import annotations

from diffjax import kinds, mlp_kinds
from diffjax.config import ModelConfig
from diffjax.model.mlp.base import MLPModule
from diffjax.model.mlp.gated import GatedMLP


def module_class(config: ModelConfig) -> type[MLPModule]:
    return kinds.module_class(mlp_kinds.get(config.mlp), MLPModule)


__all__ = ["GatedMLP", "MLPModule", "module_class"]
