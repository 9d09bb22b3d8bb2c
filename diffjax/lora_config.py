"""The `lora` section of a run config (LoraConfig) and what lora.targets may name, read from the kinds' rows. No
jax: the run config imports it; the adapters themselves are diffjax.lora's."""

from __future__ import annotations

import dataclasses
import math
import re

from diffjax.config import BLOCK_PARTS

# Where a part's LoRA targets live in a decoder block (its modules' attribute names).
PART_MODULES = {"attention": ("attn",), "mlp": ("mlp",), "residual": ("attn_residual", "mlp_residual")}


def target_kernels() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Every projection lora.targets may name -> (the block modules holding it, the kernel names it covers): the
    registered kinds' rows' training.lora_targets, in table order (Shared DIFF's dense query / key parts are q_base /
    k_base; GDLA's low-rank projections q_down / q_up and kv_down / kv_up; an MoE layer's gate / up / down its shared
    expert's, "experts" its routed experts, per-expert adapters [L, E, ...])."""
    targets: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for part, table in BLOCK_PARTS.items():
        for target in (target for row in table.rows() for target in row.training.lora_targets):
            modules, kernels = targets.get(target.name, (PART_MODULES[part], ()))
            targets[target.name] = (modules, tuple(dict.fromkeys(kernels + target.kernels)))
    return targets


def target_groups() -> dict[str, tuple[str, ...]]:
    """A part's name ("attention", "mlp") -> the projections its kinds put in its group. A group adapts those of its
    projections the model has (at least one); a projection named alone must exist."""
    groups = {part: tuple(dict.fromkeys(target.name for row in table.rows() for target in row.training.lora_targets
                                        if target.grouped)) for part, table in BLOCK_PARTS.items()}
    return {part: names for part, names in groups.items() if names}


def target_names() -> tuple[str, ...]:
    """What lora.targets may hold: every projection, then the groups."""
    return tuple(target_kernels()) + tuple(target_groups())


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The `lora` section of a run config. rank 0: off (full training)."""

    rank: int = 0
    """Rank r of the adapters A (in x r) and B (r x out); 0: no LoRA (full training)."""
    alpha: float = 16.0
    """The update W + alpha / r A B is scaled by alpha / rank."""
    targets: tuple[str, ...] = ("attention",)
    """Projections to adapt: q, k, v, o, q_down, q_up, kv_down, kv_up (GDLA), gate, up, down (an MLP's or an MoE's
    shared expert's), experts (routed experts), or the groups "attention" / "mlp"."""
    trainable: tuple[str, ...] = ()
    """Regular expressions searched in a base parameter's dotted path (e.g. "lambda_", "norm"): those train too (with
    optimizer state); the rest of the base is frozen."""

    def __post_init__(self):
        for name in ("targets", "trainable"):
            value = getattr(self, name)
            if isinstance(value, (list, str)):
                object.__setattr__(self, name, tuple([value] if isinstance(value, str) else value))
        if not (isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 0):
            raise ValueError(f"lora.rank must be an integer >= 0 (0: no LoRA), got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a number > 0, got {self.alpha!r}")
        allowed = target_names()
        if not self.targets or any(t not in allowed for t in self.targets):
            bad = [t for t in self.targets if t not in allowed]
            raise ValueError(f"lora.targets must be a non-empty list of {', '.join(allowed)}; got {list(self.targets)!r}"
                             + (f" ({', '.join(map(repr, bad))} unknown)" if bad else ""))
        for pattern in self.trainable:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as error:
                raise ValueError(f"lora.trainable: {pattern!r} is not a regular expression ({error})") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The targeted projections, groups expanded."""
        groups = target_groups()
        return tuple(dict.fromkeys(p for t in self.targets for p in groups.get(t, (t,))))

    @property
    def kernel_names(self) -> tuple[str, ...]:
        targets = target_kernels()
        return tuple(dict.fromkeys(k for p in self.projections for k in targets[p][1]))

    def is_trainable(self, dotted_path: str) -> bool:
        return any(re.search(pattern, dotted_path) for pattern in self.trainable)
