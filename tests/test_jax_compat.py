"""The supported jax range is enforced at import in one line, and the version differences are bridged in
diffjax.jax_compat (the kernels' lowering on each version is tested in test_ops_pallas_gpu.py,
test_ops_gpu_paths.py and test_ops_tpu_lowering.py, which CI runs on the oldest and the newest jax)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diffjax import jax_compat

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, expected", [
    ("0.10.2", None), ("0.11.2", None), ("0.12.0.1", None), ("0.12.9", None),
    ("0.10.1", "old"), ("0.9.0", "old"), ("0.10.2rc1", None),
    ("0.13.0", "new"), ("0.13.0.dev20261201", "new"), ("1.0", "new"),
])
def test_versions_outside_the_tested_range_are_named(version, expected):
    problem = jax_compat.jax_version_problem(version)
    assert (problem and problem[0]) == expected, problem
    if problem:
        assert f"jax {version}" in problem[1] and jax_compat.SUPPORTED_JAX in problem[1]


def test_pyproject_pins_the_range_the_check_enforces():
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"jax{jax_compat.SUPPORTED_JAX}" in [d.replace(" ", "") for d in dependencies]


def _import_with_jax_version(version: str, module: str) -> subprocess.CompletedProcess:
    """Import `module` in a fresh interpreter whose package metadata reports jax `version`."""
    script = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        f"m.version = lambda name: {version!r} if name == 'jax' else real(name)\n"
        f"import {module}\n"
        "print('imported')\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "", "PYTHONPATH": str(REPO_ROOT)}, timeout=300)


def test_a_newer_jax_gets_one_warning_line_and_the_kernels_still_import():
    result = _import_with_jax_version("0.13.0", "diffjax.ops.pallas_gpu")
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "UntestedJaxWarning" in line]
    assert len(warnings) == 1 and "jax 0.13.0 is newer and untested" in warnings[0], result.stderr[-2000:]


def test_an_older_jax_is_refused_in_one_line_before_jax_loads():
    result = _import_with_jax_version("0.9.2", "diffjax.config")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("ImportError: diffjax needs jax >=0.10.2,<0.13"), result.stderr[-2000:]


class _Ref:
    pass


def test_mosaic_gpu_load_calls_each_versions_signature():
    """jax 0.10's plgpu.load(src, idx, *, layout) takes () for the whole ref; 0.11+'s load(src, *, layout) has no idx."""
    calls = []

    class Jax010:
        @staticmethod
        def load(src, idx, *, layout=None, optimized=True):
            calls.append(("0.10", src, idx, layout))

    class Jax012:
        @staticmethod
        def load(src, *, layout=None, optimized=True):
            calls.append(("0.12", src, layout))

    ref = _Ref()
    jax_compat.mosaic_gpu_load(Jax010, ref, "wgmma")
    jax_compat.mosaic_gpu_load(Jax012, ref, "wgmma")
    assert calls == [("0.10", ref, (), "wgmma"), ("0.12", ref, "wgmma")]


def test_lowering_target_names_what_it_takes():
    with pytest.raises(ValueError, match=r"platform must be one of \['gpu', 'tpu'\], got 'cuda'"):
        with jax_compat.lowering_target("NVIDIA H100", platform="cuda"):
            pass
