"""The attention modules, one per kind (diffjax.attention_kinds is the table of kinds).

base.py holds what every kind shares (AttentionModule: the op call, the KV-cache path, explicit maps for the
analyses, one masked softmax); diff.py (V1), standard.py (the baseline), diff_v2.py, shared_diff.py, gda.py and gdla.py state
only what differs. `module_class(config)` is the class of a config's kind: the kind's `module` entry, a
"package.module:Class" path imported on first use or the class itself.
"""

from __future__ import annotations

from diffjax import attention_kinds, kinds
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
from diffjax.model.attention.gdla import GroupedDiffLatentAttention
from diffjax.model.attention.shared_diff import SharedDiffAttention
from diffjax.model.attention.standard import StandardAttention


def module_class(config: ModelConfig) -> type[AttentionModule]:
    return kinds.module_class(attention_kinds.get(config.attention), AttentionModule)


__all__ = [
    "BTD", "SAVED_BY_ATTENTION_POLICY", "AttentionModule", "DiffAttention", "DiffAttentionV2", "ExplicitAttention",
    "GroupedDiffAttention", "GroupedDiffLatentAttention", "SharedDiffAttention", "StandardAttention", "attend", "masked_softmax", "module_class",
]
