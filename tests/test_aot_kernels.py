"""The kernel matrix compiled for hardware that is not here (benchmarks/aot_kernels.py): every attention kind's fused
kernels, forward and forward+backward, compiled by libtpu for TPU v4, v5e, v5p and v6e with the block sizes `auto`
uses there, and by XLA's deviceless CUDA compiler for an H100, each program holding the kernels' custom calls (no
fallback to XLA, none to interpret mode). The CI cut (`cases(small=True)`): one kv head, at most 512 tokens, the
same kernels in smaller grids; one program per target. Skipped, with the pip command, where libtpu or JAX's CUDA
plugin is absent. Full-size figures: benchmarks/results/aot_kernels.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from diffjax import ops
from diffjax.ops import aot

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "aot_kernels.py"


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("aot_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _compiled(matrix, name, case_names=None, **kwargs):
    platform = "gpu" if name.startswith("h100") else "tpu"
    if why := aot.missing(platform):
        pytest.skip(why)
    cases = [case for case in matrix.cases(small=True) if case_names is None or case.name in case_names]
    return matrix.compile_matrix(aot.target(name), cases, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("generation", [pytest.param("v5p", marks=pytest.mark.both_legs), "v4", "v5e", "v6e"])
def test_every_kinds_kernels_compile_for_the_tpu_generation(matrix, generation):
    result = _compiled(matrix, generation)
    assert result["device_kind"] == ops.DEVICES[generation].kind and not result["not_compiled"]
    assert len(result["rows"]) == 2 * len(matrix.cases(small=True))
    for row in result["rows"]:
        where = f"{generation} {row['case']} {row['pass']}"
        assert row["route"] in ("pallas_tpu", "auto"), where  # auto's route on that chip (a context chunk: direct)
        assert row["kernels"] == row["expected"], where  # Mosaic kernels, none interpreted or replaced by XLA
        vmem = row["scoped_vmem_bytes"]
        assert set(vmem) == set(row["expected"]) and all(0 < size < 16 * 2**20 for s in vmem.values() for size in s), where


@pytest.mark.slow
@pytest.mark.single_leg
def test_motif3s_windowed_kernels_compile_for_an_h100_and_shared_diffs_head_dim_is_refused_by_name(matrix):
    """Motif 3's windowed GDLA through diffjax.ops (impl pallas_gpu, single-map mode: d 192 / dv 128, GQA 5:1,
    packed, window 129), forward and backward kernels through ptxas; Shared DIFF's d 96 is a call the kernels refuse
    (auto takes Triton or cuDNN there: the route preview says why). tests/test_kernel_resources.py compiles both
    modes' kernels directly; the whole matrix for the H100 takes minutes here: benchmarks/aot_kernels.py."""
    result = _compiled(matrix, "h100", case_names=("gdla-windowed", "shared_diff"), passes=("fwd+bwd",))
    assert result["device_kind"] == ops.DEVICES["h100"].kind
    assert [row["case"] for row in result["rows"]] == ["gdla-windowed"]
    assert "head dim" in result["not_compiled"]["shared_diff"]
    assert result["rows"][0]["kernels"] == result["rows"][0]["expected"]
