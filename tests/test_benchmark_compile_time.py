"""benchmarks/compile_time.py writes its figures under runs/ (git-ignored) unless --out names a file: running
README's command leaves the tracked record in benchmarks/results/ as it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_run_without_out_leaves_the_tracked_results_alone(tmp_path):
    (tmp_path / "benchmarks").mkdir()  # a checkout of its own, so that the real runs/ and results/ stay untouched
    shutil.copy(REPO_ROOT / "benchmarks" / "compile_time.py", tmp_path / "benchmarks")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "benchmarks/compile_time.py", "--init", str(REPO_ROOT / "configs" / "tiny.yaml")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    written = tmp_path / "runs" / "benchmarks" / "compile_init_cpu.json"
    assert f"wrote {written}" in result.stdout
    assert json.loads(written.read_text())["rows"][0]["params"] > 0
    assert not (tmp_path / "benchmarks" / "results").exists()
