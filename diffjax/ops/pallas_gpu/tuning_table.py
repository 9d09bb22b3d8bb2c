"""The best pallas_gpu Tuning per shape class, as a Hopper GPU measured it (benchmarks/pallas_gpu_sweep.py --table
writes the table; a GPU session's output is copied to diffjax/ops/pallas_gpu_tuning.json). default_tuning reads it
first; absent, its shared-memory rule alone decides."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from diffjax.hardware import HOPPER_KINDS

TUNING_TABLE = Path(__file__).resolve().parents[1] / "pallas_gpu_tuning.json"


def tuning_class(d: int, dv: int, single: bool, dtype) -> str:
    """The shape class a swept pallas_gpu Tuning is kept under, e.g. "diff d128 dv256 bfloat16"."""
    return f"{'single' if single else 'diff'} d{d} dv{dv} {jnp.dtype(dtype).name}"


def swept_tuning(d: int, dv: int, single: bool, dtype, table: Path | None = None) -> dict | None:
    """The Tuning fields benchmarks/pallas_gpu_sweep.py measured best for this shape class on a Hopper GPU (the
    table `table`, default TUNING_TABLE), or None: no table, no entry, or a table from a dry run / another GPU."""
    table = TUNING_TABLE if table is None else Path(table)
    if not table.exists():
        return None
    try:
        content = json.loads(table.read_text())
        entry = content["best"].get(tuning_class(d, dv, single, dtype))
        measured = not content.get("dry_run") and any(kind in content["device"] for kind in HOPPER_KINDS)
        return dict(entry["tuning"]) if entry is not None and measured else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{table}: not a pallas_gpu tuning table as benchmarks/pallas_gpu_sweep.py --table writes "
                         f"(device, best: {{class: {{tuning: {{...}}}}}}): {type(e).__name__}: {e}") from None
