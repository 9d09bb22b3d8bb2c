"""The GPU session's capture phase without a GPU: the profile reducer on a real CPU trace and on XLA GPU HLO text,
the Nsight Compute reducer on a synthetic `ncu --csv --page details` file, the sweep's tuning table as `auto` reads
it, and (slow) `DRY_RUN=1 benchmarks/gpu_session.sh capture sweep` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import ncu_summary  # noqa: E402
import profile_table  # noqa: E402

from diffjax.ops import choice  # noqa: E402
from diffjax.ops.pallas_gpu import Tuning, default_tuning  # noqa: E402

NCU_EXAMPLE = REPO_ROOT / "benchmarks" / "testdata" / "ncu_details_example.csv"
ROW_KEYS = {"op", "category", "ms_per_step", "share", "events", "tflops", "gbps", "source", "kernel"}


def assert_table_shape(table: dict):
    assert table["rows"], table
    for row in table["rows"]:
        assert set(row) == ROW_KEYS, row
        assert row["category"] in profile_table.CATEGORIES, row
    assert sum(r["share"] for r in table["rows"]) == pytest.approx(100, abs=0.1)
    assert sum(c["share"] for c in table["by_category"].values()) == pytest.approx(100, abs=0.1)
    assert sum(r["ms_per_step"] for r in table["rows"]) == pytest.approx(table["ms_per_step"], rel=1e-6)


def test_profile_table_of_a_cpu_trace(tmp_path):
    """A jitted scan of 3 matmuls, traced twice by jax.profiler on the CPU: the reducer finds 2 steps, the
    matmul FLOPs per step from the optimized HLO (3 x 2 M N K), and no while loop (its body's ops are timed)."""
    M, K, N, length = 64, 96, 48, 3

    def f(x_MK, w_LKN):
        def body(carry, w_KN):
            return carry, jnp.tanh(x_MK @ w_KN).sum(axis=0)
        return jax.lax.scan(body, 0.0, w_LKN)[1]

    args = (jnp.ones((M, K)), jnp.ones((length, K, N)))
    compiled = jax.jit(f).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            jax.block_until_ready(compiled(*args))
    costs = profile_table.hlo_costs(compiled.as_text())
    matmul_flops = sum(c["flops"] * c["runs"] for c in costs.values() if c["category"] == "matmul" and c["flops"])
    assert matmul_flops == length * 2 * M * K * N

    table = profile_table.reduce_trace(profile_table.trace_events(profile_table.find_xplane(tmp_path)), costs,
                                       module=r"^jit_f$", steps=None, top=30)
    assert table["steps"] == 2
    assert_table_shape(table)
    assert not any(r["op"].startswith("while") for r in table["rows"])
    for row in table["rows"]:
        cost = costs.get(row["op"])
        if cost and cost["flops"]:  # achieved rate = FLOPs per step / time per step
            assert row["tflops"] == pytest.approx(cost["flops"] * cost["runs"] / (row["ms_per_step"] * 1e-3) / 1e12)
    text = profile_table.markdown(table, "test")
    assert "| # | op | category | ms / step | share |" in text and "`" + table["rows"][0]["op"] + "`" in text


GPU_HLO = """HloModule jit_train_step, entry_computation_layout={()}

%fused_transpose (param_0: bf16[8,4096,16,128]) -> bf16[8,16,4096,128] {
  %param_0 = bf16[8,4096,16,128]{3,2,1,0} parameter(0)
  ROOT %transpose.1 = bf16[8,16,4096,128]{3,2,1,0} transpose(%param_0), dimensions={0,2,1,3}
}

%fused_loss (param_0.1: f32[4096,1024]) -> f32[4096] {
  %param_0.1 = f32[4096,1024]{1,0} parameter(0)
  %constant.1 = f32[] constant(0)
  %exponential.1 = f32[4096,1024]{1,0} exponential(%param_0.1)
  ROOT %reduce.1 = f32[4096]{0} reduce(%exponential.1, %constant.1), dimensions={1}, to_apply=%add
}

%body (p: (s32[], bf16[32768,2048])) -> (s32[], bf16[32768,2048]) {
  %p = (s32[], bf16[32768,2048]{1,0}) parameter(0)
  %x = bf16[32768,2048]{1,0} get-tuple-element(%p), index=1
  %w = bf16[2048,8192]{1,0} constant({...})
  %custom-call.7 = (bf16[32768,8192]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}, metadata={op_name="jit(train_step)/while/body/dot_general"}
  %q = bf16[8,4096,16,128]{3,2,1,0} bitcast(%x)
  %fusion.3 = bf16[8,16,4096,128]{3,2,1,0} fusion(%q), kind=kLoop, calls=%fused_transpose
  %custom-call.9 = (bf16[8,16,4096,128]{3,2,1,0}, f32[8,16,4096]{2,1,0}) custom-call(%fusion.3, %fusion.3, %fusion.3), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(train_step)/while/body/attention"}
  ROOT %t = (s32[], bf16[32768,2048]{1,0}) tuple(%p)
}

ENTRY %main (a: f32[4096,1024], b: bf16[32768,2048]) -> f32[4096] {
  %a = f32[4096,1024]{1,0} parameter(0)
  %b = bf16[32768,2048]{1,0} parameter(1)
  %init = (s32[], bf16[32768,2048]{1,0}) tuple(%b)
  %while.2 = (s32[], bf16[32768,2048]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"24"},"known_init_step":{"init":"0","step":"1"}}
  %all-reduce.4 = f32[4096,1024]{1,0} all-reduce(%a), replica_groups={}, to_apply=%add
  ROOT %fusion.5 = f32[4096]{0} fusion(%all-reduce.4), kind=kInput, calls=%fused_loss
}
"""


def test_hlo_costs_of_xla_gpu_text():
    """XLA GPU's forms: a cuBLAS gemm custom call (tuple result with its workspace) in a while body of 24 trips, a
    transpose fusion, cuDNN attention, an all-reduce, a reduction fusion."""
    costs = profile_table.hlo_costs(GPU_HLO)
    gemm = costs["custom-call.7"]
    assert (gemm["category"], gemm["flops"], gemm["runs"]) == ("matmul", 2 * 32768 * 8192 * 2048, 24)
    assert gemm["bytes"] == 2 * (32768 * 8192 + 2048 * 8192 + 32768 * 2048) + 4194304
    assert gemm["source"] == "body/dot_general"
    assert (costs["fusion.3"]["category"], costs["fusion.3"]["runs"]) == ("copy or transpose", 24)
    assert costs["custom-call.9"]["category"] == "attention kernel" and costs["custom-call.9"]["flops"] is None
    assert costs["all-reduce.4"]["category"] == "collective"
    assert (costs["fusion.5"]["category"], costs["fusion.5"]["runs"]) == ("reduction", 1)
    assert profile_table._is_control("while.2", costs["while.2"])


@pytest.mark.parametrize("operands", ["%x, %w", "f32[64,96]{1,0} %x, f32[96,48]{1,0} %w"])
def test_hlo_operands_printed_bare_or_with_shapes(operands):
    text = ("HloModule m\n\nENTRY %main (x: f32[64,96], w: f32[96,48]) -> f32[64,48] {\n"
            "  %x = f32[64,96]{1,0} parameter(0)\n  %w = f32[96,48]{1,0} parameter(1)\n"
            f"  ROOT %dot.1 = f32[64,48]{{1,0}} dot({operands}), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}\n}}\n")
    dot = profile_table.hlo_costs(text)["dot.1"]
    assert (dot["flops"], dot["bytes"], dot["runs"]) == (2 * 64 * 48 * 96, 4 * (64 * 48 + 64 * 96 + 96 * 48), 1)


def test_gpu_kernel_annotations_name_their_hlo_op():
    assert profile_table._annotation_op(
        "XlaModule:#hlo_module=jit_train_step,program_id=6#::Thunk:#hlo_op=fusion.12#") == ("jit_train_step", "fusion.12")
    assert profile_table._annotation_op("XlaModule:#hlo_module=jit_f#::custom-call.3:#kernel#") == ("jit_f", "custom-call.3")
    assert profile_table._annotation_op("XlaModule:#hlo_module=jit_f#") == ("jit_f", None)


def test_ncu_summary_of_the_synthetic_details_csv():
    """The fixture's values (benchmarks/testdata/ncu_details_example.csv) come back per kernel: launches averaged,
    durations in ms whatever the unit, other kernels filtered out, stalls ranked."""
    summary = {r["kernel"]: r for r in ncu_summary.summarize(ncu_summary.read_rows(NCU_EXAMPLE.read_text()),
                                                              "diffjax_mgpu")}
    assert sorted(summary) == ["diffjax_mgpu_bwd_dkdv", "diffjax_mgpu_bwd_dq", "diffjax_mgpu_fwd"]
    fwd, dkdv = summary["diffjax_mgpu_fwd"], summary["diffjax_mgpu_bwd_dkdv"]
    assert fwd["launches"] == 2
    assert fwd["duration_ms"] == pytest.approx((2.81 + 2.7905) / 2)  # "2.81" msecond and "2,790.50" usecond
    assert fwd["sm_throughput_pct"] == pytest.approx((60.12 + 59.88) / 2)
    assert dkdv["duration_ms"] == pytest.approx(5.21)  # "5,210,000" nsecond
    assert (dkdv["registers_per_thread"], dkdv["achieved_occupancy_pct"], dkdv["tensor_pipe_pct"]) == (168, 18.70, 38.5)
    assert [s["reason"] for s in dkdv["top_stalls"]] == ["barrier", "long_scoreboard", "mio_throttle"]
    assert [r["kernel"] for r in ncu_summary.summarize(ncu_summary.read_rows(NCU_EXAMPLE.read_text()))][0] == \
        "diffjax_mgpu_bwd_dkdv"  # by time; unfiltered, the cutlass kernel is there too
    assert "| `diffjax_mgpu_fwd` | 2 | 2.800 |" in ncu_summary.markdown(list(summary.values()))
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_summary.read_rows("==PROF== No kernels were profiled.\n")


def test_ncu_metrics_are_picked_from_this_ncus_list():
    query = """Device gh100 (GH100)
Metric Name                                                      Metric Type  Metric Unit  Metric Description
sm__pipe_tensor_op_gmma_cycles_active                           Counter      cycle        # of cycles where GMMA was active
sm__pipe_alu_cycles_active                                       Counter      cycle        # of cycles where ALU was active
smsp__average_warps_issue_stalled_barrier_per_issue_active       Ratio                     average # of warps ...
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active Ratio                   average # of warps ...
"""
    assert ncu_summary.pick_metrics(query) == [
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"]


def write_table(path: Path, device="NVIDIA H100 80GB HBM3", dry_run=False, **tuning):
    entry = {"tuning": Tuning(**tuning)._asdict(), "T": 8192, "causal": True}
    path.write_text(json.dumps({"device": device, "dry_run": dry_run, "best": {"diff d64 dv128 bfloat16": entry}}))


def test_the_swept_tuning_is_the_default_where_its_table_has_one(tmp_path, monkeypatch):
    table = tmp_path / "pallas_gpu_tuning.json"
    monkeypatch.setattr(choice, "TUNING_TABLE", table)
    plain = default_tuning(64, 128, 2, jnp.bfloat16)  # no table
    swept = Tuning(block_k=64, block_k_dq=64, block_q_bwd=64, stages=3, pingpong=False)
    assert swept != plain
    write_table(table, **swept._asdict())
    assert default_tuning(64, 128, 2, jnp.bfloat16) == swept
    assert default_tuning(128, 256, 2, jnp.bfloat16) == default_tuning(128, 256, 2, jnp.bfloat16, swept=False)  # no entry
    assert default_tuning(64, 128, 2, jnp.bfloat16, swept=False) == plain
    for kwargs in ({"dry_run": True}, {"device": "cpu"}):  # a dry run's or another device's table is not a measurement
        write_table(table, **kwargs, **swept._asdict())
        assert choice.swept_tuning(64, 128, False, jnp.bfloat16) is None
    write_table(table, block_k=128, block_k_dq=128, block_q_bwd=128, stages=8)  # does not fit shared memory
    assert default_tuning(64, 128, 2, jnp.bfloat16) == plain
    table.write_text('{"best": []}')
    with pytest.raises(ValueError, match="pallas_gpu_tuning.json: not a pallas_gpu tuning table"):
        choice.swept_tuning(64, 128, False, jnp.bfloat16)


def test_the_sweep_merges_its_best_into_the_table(tmp_path):
    import pallas_gpu_sweep

    table = tmp_path / "t.json"
    write_table(table)
    result = {"d": 128, "dv": 256, "single": False, "T": 8192, "causal": True, "device": "NVIDIA H100 80GB HBM3",
              "jax": "0.11.2", "dry_run": False, "date": "2026-11-27"}
    best = {"tuning": Tuning(block_k=128)._asdict(), "s": 0.008, "tflops": 400.0, "tflops_vs_cudnn": 0.9}
    pallas_gpu_sweep.update_table(table, result, best)
    merged = json.loads(table.read_text())["best"]
    assert sorted(merged) == ["diff d128 dv256 bfloat16", "diff d64 dv128 bfloat16"]
    assert choice.swept_tuning(128, 256, False, jnp.bfloat16, table) == Tuning(block_k=128)._asdict()
    assert len(pallas_gpu_sweep.candidates(Tuning(), pallas_gpu_sweep.FORWARD_OPTIONS)) == 8


@pytest.mark.slow
@pytest.mark.single_leg  # subprocesses of the trainer and the sweep on CPU (~2 min)
def test_gpu_session_capture_dry_run(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # the script's own (its HLO dump), not the tests' 8 devices
    result = subprocess.run(["bash", "benchmarks/gpu_session.sh", "capture", "sweep"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for model in ("diff-1.4b", "transformer-1.4b"):
        table = json.loads((tmp_path / f"profile_{model}.json").read_text())
        assert_table_shape(table)
        assert table["hlo_costs"] and table["steps"] == 2
        assert any(r["category"] == "matmul" and r["tflops"] for r in table["rows"])
        again = tmp_path / f"again_{model}.json"  # the kept trace and HLO reduce again to the same table
        assert profile_table.main([str(tmp_path / f"trace_{model}.xplane.pb.gz"), "--hlo", str(tmp_path / f"hlo_{model}.txt.gz"),
                                   "--steps", "2", "--out", str(again)]) == 0
        assert json.loads(again.read_text())["rows"] == table["rows"]
    side_by_side = (tmp_path / "profile_diff_vs_twin.md").read_text()
    assert "| category | diff-1.4b ms / step | transformer-1.4b ms / step | transformer-1.4b - diff-1.4b |" in side_by_side
    assert "| matmul |" in side_by_side and "| total |" in side_by_side
    kernels = [r["kernel"] for r in json.loads((tmp_path / "ncu_summary.json").read_text())]
    assert sorted(kernels) == ["diffjax_mgpu_bwd_dkdv", "diffjax_mgpu_bwd_dq", "diffjax_mgpu_fwd"]
    assert "mgpu: skipped" in result.stdout
    tuning = json.loads((tmp_path / "pallas_gpu_tuning.json").read_text())
    assert tuning["dry_run"] is True and "diff d128 dv256 bfloat16" in tuning["best"]
    rows = json.loads((tmp_path / "pallas_gpu_sweep.json").read_text())["rows"]  # dk/dv variants: the baseline first
    assert [r["tuning"]["dkdv"] for r in rows if r["mode"] == "dkdv"] == ["exchange", Tuning().dkdv]
