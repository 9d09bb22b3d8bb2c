"""The attention modules, one per kind (diffjax.attention_kinds is the table of kinds).

base.py holds what every kind shares (AttentionModule: the op call, the KV-cache path, explicit maps for the
analyses, one masked softmax); diff.py (V1), standard.py (the baseline), diff_v2.py, shared_diff.py and gda.py state
only what differs. `module_class(config)` is the class of a config's kind: the kind's `module` entry, a
"package.module:Class" path imported on first use or the class itself.
"""

from __future__ import annotations

import importlib

from diffjax import attention_kinds
from diffjax.config import ModelConfig
from diffjax.model.attention.base import (
    BTD,
    SAVED_BY_ATTENTION_POLICY,
    AttentionModule,
    ExplicitAttention,
    attend,
    masked_softmax,
)
from diffjax.model.attention.diff import DiffAttention
from diffjax.model.attention.diff_v2 import DiffAttentionV2
from diffjax.model.attention.gda import GroupedDiffAttention
from diffjax.model.attention.shared_diff import SharedDiffAttention
from diffjax.model.attention.standard import StandardAttention


def module_class(config: ModelConfig) -> type[AttentionModule]:
    kind = attention_kinds.get(config.attention)
    if isinstance(kind.module, type):
        return kind.module
    module_name, _, class_name = kind.module.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, AttentionModule)):
        raise TypeError(f"attention kind {kind.name!r}: {kind.module!r} is not an AttentionModule subclass")
    return cls


__all__ = [
    "BTD", "SAVED_BY_ATTENTION_POLICY", "AttentionModule", "DiffAttention", "DiffAttentionV2", "ExplicitAttention",
    "GroupedDiffAttention", "SharedDiffAttention", "StandardAttention", "attend", "masked_softmax", "module_class",
]
