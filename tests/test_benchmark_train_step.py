"""benchmarks/train_step.py runs at tiny size on CPU and writes the JSON the GPU session's figures are read from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.mark.single_leg  # a subprocess of the train step, which test_trainer / test_chunked_loss cover on both legs
def test_train_step_benchmark_tiny_writes_every_figure(tmp_path):
    out = tmp_path / "train_step.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "benchmarks/train_step.py", "--tiny", "--out", str(out)], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    for key in ("device", "platform", "jax", "date", "matmul_tflops_measured", "budget_bytes", "memory_note"):
        assert figures[key] is not None, key
    assert [(row["model"], row["seq_len"], row["micro_batch"]) for row in figures["rows"]] == [
        ("diff-tiny", 64, 2), ("transformer-tiny", 64, 2)]
    for row in figures["rows"]:
        assert row["loss_chunk"] == 32 and row["remat"] == "minimal"
        assert row["tokens_per_s"] > 0 and row["tflops_per_device"] > 0 and row["mfu_vs_measured_matmul"] > 0
        assert "mfu" in row and "peak_bytes_in_use" in row  # None on CPU: no known peak, no allocator stats
        memory = row["memory"]["2"]
        # the donated train state: fp32 params and two Adam moments at least
        assert memory["argument_bytes"] >= 12 * row["params"]
        assert memory["total_bytes"] == (memory["argument_bytes"] + memory["temp_bytes"] + memory["output_bytes"]
                                         - memory["alias_bytes"])
    (ratio,) = figures["ratios"]
    assert ratio["seq_len"] == 64 and ratio["diff_over_transformer"] > 0
    assert "DIFF / Transformer tokens/s" in result.stdout
