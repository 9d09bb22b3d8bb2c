"""What a run guarantees when things go wrong: divergence, damaged checkpoints, kill -9 and metrics,
bad input. Tiny model, few steps (the helpers of test_trainer.py)."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from diffjax.train import train
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.config import CheckpointConfig
from diffjax.train.guard import DivergedError
from test_trainer import _config, _read_metrics

QUIET = dict(log=lambda _: None)


def _all_finite(run_dir, step) -> bool:
    state = Checkpointer(run_dir, CheckpointConfig()).read(step)["state"]
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state) if np.asarray(x).dtype.kind == "f")


def test_a_diverging_run_stops_before_saving_a_nonfinite_state(tmp_path):
    run_dir = tmp_path / "run"
    diverging = ["train.steps=12", "optim.lr=1e3", "train.log_every=10", "checkpoint.every=1", "checkpoint.keep=3"]
    with pytest.raises(DivergedError, match=r"diverged at step (\d+) .*the newest good checkpoint, (\S+), is kept") as info:
        train(_config(run_dir, *diverging), **QUIET)
    bad_step, kept = map(int, re.search(r"step (\d+) .*checkpoints/(\d+),", str(info.value)).groups())
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    assert kept == bad_step - 1 == steps[-1], (steps, str(info.value))
    assert all(_all_finite(run_dir, step) for step in steps)
    assert max(r["step"] for r in _read_metrics(run_dir)) < bad_step

    # skip mode: the run goes on, the bad steps are logged as skipped and the state stays finite.
    result = train(_config(tmp_path / "skip", *diverging, "train.on_nonfinite=skip"), **QUIET)
    assert result.step == 12 and _all_finite(tmp_path / "skip", 12)
    skipped = [r["step"] for r in _read_metrics(tmp_path / "skip") if r.get("skipped")]
    assert skipped and skipped[-1] == 12
