"""The GPU session's capture phase without a GPU: the profile reducer on a real CPU trace and on XLA GPU HLO text,
the Nsight Compute reducer on a synthetic `ncu --csv --page details` file, the sweep's tuning table as `auto` reads
it, and (slow) `DRY_RUN=1 benchmarks/gpu_session.sh capture sweep` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import ncu_summary  # noqa: E402
import profile_table  # noqa: E402

from diffjax.jax_compat import H100, lowering_target  # noqa: E402
from diffjax.ops.pallas_gpu import tuning_table  # noqa: E402
from diffjax.ops.pallas_gpu import Tuning, default_tuning  # noqa: E402

NCU_EXAMPLE = REPO_ROOT / "benchmarks" / "testdata" / "ncu_details_example.csv"
ROW_KEYS = {"op", "category", "role", "ms_per_step", "share", "events", "tflops", "gbps", "source", "kernel"}


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


def test_kernels_without_an_hlo_op_are_categorised_by_their_name():
    """The 2026-11-27 capture's case: XProf gives the Mosaic GPU kernels inside XLA's dynamic-slice fusions no HLO
    op, so with the HLO's costs alone they fell under "other". Their kernel names say what they are: attention,
    split by role (forward launched three times, dq, dk/dv), cuBLAS / cuDNN kernels likewise."""
    kernels = {"mpmd_map.10": "diffjax_mgpu_bwd_dkdv_mosaic_gpu_kernel", "mpmd_map.13": "diffjax_mgpu_bwd_dq_mosaic_gpu_kernel",
               "mpmd_map.0": "diffjax_mgpu_fwd_mosaic_gpu_kernel", "mpmd_map.2": "diffjax_mgpu_fwd_mosaic_gpu_kernel",
               "mpmd_map.14": "diffjax_mgpu_single_fwd_mosaic_gpu_kernel",
               "custom-call.7": "nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN",
               "custom-call.9": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1",
               "fusion.4": "loop_add_fusion_2", "rng.1": "some_kernel"}
    events = [("jit_train_step", op, 1000 * (i + 1), None, kernel)
              for _ in range(2) for i, (op, kernel) in enumerate(kernels.items())]
    costs = {"rng.1": {"opcode": "rng", "category": "other", "runs": 1}}
    table = profile_table.reduce_trace(events, costs, module="train_step", steps=2, top=30)
    assert_table_shape(table)
    rows = {r["op"]: r for r in table["rows"]}
    assert {op: (rows[op]["category"], rows[op]["role"]) for op in kernels} == {
        "mpmd_map.10": ("attention kernel", "dk/dv"), "mpmd_map.13": ("attention kernel", "dq"),
        "mpmd_map.0": ("attention kernel", "forward"), "mpmd_map.2": ("attention kernel", "forward"),
        "mpmd_map.14": ("attention kernel", "forward"), "custom-call.7": ("matmul", ""),
        "custom-call.9": ("attention kernel", "backward"), "fusion.4": ("elementwise", ""), "rng.1": ("other", "")}
    forward = table["attention_by_role"]["forward"]
    assert forward["launches_per_step"] == 3 and forward["ops"] == ["mpmd_map.0", "mpmd_map.14", "mpmd_map.2"]
    assert forward["ms_per_step"] == pytest.approx((3 + 4 + 5) * 1000 / 1e6)
    assert "| mpmd_map.10` | attention kernel: dk/dv |" in profile_table.markdown(table, "t").replace("| `", "| ")
    assert "| forward | 0.012 |" in profile_table.markdown(table, "t")


# XLA GPU's form of a scanned step with Mosaic GPU kernels (as the 2026-11-27 capture's optimized HLO has it): a
# dynamic-slice fusion around the forward kernel (the kernel reads its layer's slice in place), plain custom calls
# in the backward, the layer loop's known trip count.
KERNEL_HLO = """HloModule jit_train_step, entry_computation_layout={()}

%dynamic-slice-fusion (p0: bf16[24,8,4096,8,2,128], p1: s32[]) -> bf16[8,4096,8,256] {
  %p0 = bf16[24,8,4096,8,2,128]{5,4,3,2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic_slice.1 = bf16[1,8,4096,8,2,128]{5,4,3,2,1,0} dynamic-slice(%p0, %p1, %c, %c, %c, %c, %c), dynamic_slice_sizes={1,8,4096,8,2,128}
  %bitcast.1 = bf16[8,4096,8,2,128]{4,3,2,1,0} bitcast(%dynamic_slice.1)
  ROOT %mpmd_map.14 = bf16[8,4096,8,256]{3,2,1,0} custom-call(%bitcast.1, %bitcast.1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/while/body/eval_jaxpr/jvp()/while/body/eval_jaxpr/diffjax_mgpu_fwd/mpmd_map"}
}

%body (p: (s32[], bf16[24,8,4096,8,2,128])) -> (s32[], bf16[24,8,4096,8,2,128]) {
  %p = (s32[], bf16[24,8,4096,8,2,128]{5,4,3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[24,8,4096,8,2,128]{5,4,3,2,1,0} get-tuple-element(%p), index=1
  %dynamic_slice_fusion = bf16[8,4096,8,256]{3,2,1,0} fusion(%x, %i), kind=kCustom, calls=%dynamic-slice-fusion
  %q = bf16[8,4096,8,2,128]{4,3,2,1,0} bitcast(%dynamic_slice_fusion)
  %mpmd_map.2 = bf16[8,4096,8,256]{3,2,1,0} custom-call(%q, %q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/while/body/eval_jaxpr/transpose(jvp())/while/body/checkpoint/rematted_computation/diffjax_mgpu_fwd/mpmd_map"}
  %mpmd_map.10 = bf16[8,4096,8,2,128]{4,3,2,1,0} custom-call(%q, %mpmd_map.2), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/while/body/eval_jaxpr/transpose(jvp())/while/body/checkpoint/diffjax_mgpu_bwd_dkdv/mpmd_map"}
  ROOT %t = (s32[], bf16[24,8,4096,8,2,128]{5,4,3,2,1,0}) tuple(%i, %x)
}

ENTRY %main (a: bf16[24,8,4096,8,2,128]) -> (s32[], bf16[24,8,4096,8,2,128]) {
  %a = bf16[24,8,4096,8,2,128]{5,4,3,2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[24,8,4096,8,2,128]{5,4,3,2,1,0}) tuple(%zero, %a)
  ROOT %while.1 = (s32[], bf16[24,8,4096,8,2,128]{5,4,3,2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"24"}}
}
"""


def test_custom_calls_inside_fusions_and_the_kernels_per_layer():
    """The forward kernel inside a dynamic-slice fusion is costed under its own name (the one the GPU runtime
    times it by): the loop's 24 runs, its own operands' bytes (the layer's slice, not the stack), its pass; and
    step_hlo's count finds each kernel per pass and layer, failing its check at a third forward launch."""
    import step_hlo

    cost = profile_table.hlo_costs(KERNEL_HLO)["mpmd_map.14"]
    assert (cost["category"], cost["runs"], cost["source"]) == ("attention kernel", 24, "fwd: diffjax_mgpu_fwd/mpmd_map")
    assert cost["bytes"] == 2 * (8 * 4096 * 8 * 256 + 2 * 8 * 4096 * 8 * 2 * 128)
    assert profile_table.hlo_costs(KERNEL_HLO)["mpmd_map.2"]["source"].startswith("bwd remat: ")
    launches = {(r["kernel"], r["pass"]): (r["ops"], r["launches"]) for r in profile_table.kernel_launches(KERNEL_HLO)}
    assert launches == {("diffjax_mgpu_fwd", "fwd"): (["mpmd_map.14"], 24), ("diffjax_mgpu_fwd", "bwd remat"): (["mpmd_map.2"], 24),
                        ("diffjax_mgpu_bwd_dkdv", "bwd"): (["mpmd_map.10"], 24)}
    result = step_hlo.check(profile_table.kernel_launches(KERNEL_HLO), layers=24)
    assert (result["forward_per_layer"], result["ok"]) == (2, True)
    third = KERNEL_HLO.replace("  %q = ", '  %mpmd_map.0 = bf16[8,4096,8,256]{3,2,1,0} custom-call(%x), custom_call_target='
                               '"mosaic_gpu_v2", metadata={op_name="jit(train_step)/while/body/jvp()/diffjax_mgpu_fwd/mpmd_map"}\n  %q = ')
    result = step_hlo.check(profile_table.kernel_launches(third), layers=24)
    assert (result["forward_per_layer"], result["ok"]) == (3, False)
    assert "forward kernel launches per layer: 3 (at most 2): FAILS" in step_hlo.markdown(result)


STACK_HLO = """HloModule m

%read_slice (p0: bf16[24,64,128], p1: s32[]) -> f32[64,128] {
  %p0 = bf16[24,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,64,128}
  %b = bf16[64,128]{1,0} bitcast(%ds)
  ROOT %cv = f32[64,128]{1,0} convert(%b)
}

%write_slice (p0: f32[24,64,128], p1: f32[64,128], p2: s32[]) -> f32[24,64,128] {
  %p0 = f32[24,64,128]{2,1,0} parameter(0)
  %p1 = f32[64,128]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %b = f32[1,64,128]{2,1,0} bitcast(%p1)
  ROOT %dus = f32[24,64,128]{2,1,0} dynamic-update-slice(%p0, %b, %p2, %c, %c)
}

ENTRY %main (s: bf16[24,64,128], acc: f32[24,64,128], i: s32[]) -> f32[24,64,128] {
  %s = bf16[24,64,128]{2,1,0} parameter(0)
  %acc = f32[24,64,128]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %pair = (f32[64,128]{1,0}, s32[]) tuple(%i, %i)
  %read = f32[64,128]{1,0} fusion(%s, %i), kind=kLoop, calls=%read_slice
  %add = f32[64,128]{1,0} add(%read, %pair#0)
  ROOT %write = f32[24,64,128]{2,1,0} fusion(%acc, %add, %i), kind=kLoop, calls=%write_slice
}
"""


def test_bytes_of_slices_of_stacks_and_in_place_updates():
    """A layer's slice read from a stack counts as the slice, one written into a stack in place as the update (not
    the 24-layer buffer twice); a tuple element ('name#0') as that element."""
    costs = profile_table.hlo_costs(STACK_HLO)
    assert costs["read"]["bytes"] == 64 * 128 * (2 + 4) + 4  # the bf16 slice in, the f32 result out, the index
    assert costs["write"]["bytes"] == 64 * 128 * (4 + 4) + 4  # the update in and written, the index
    assert costs["add"]["bytes"] == 3 * 64 * 128 * 4


def test_the_ops_below_the_top_rows_by_source():
    """--by-source: the ops the "(other N ops)" row sums, grouped by pass, runs per step (the loop they are in) and
    jax source, adding up to that row; XLA's own ops (no provenance) by their fusion kind."""
    costs = profile_table.hlo_costs(GPU_HLO)
    costs.update({"fusion.6": {**costs["fusion.3"], "source": "", "pass": ""},
                  "loop_broadcast_fusion.2": {"opcode": "fusion", "category": "copy or transpose", "runs": 1.0,
                                              "bytes": 8.0, "flops": None, "source": "", "pass": ""}})
    durations = {"custom-call.9": 50, "custom-call.7": 40, "fusion.3": 30, "fusion.6": 20, "fusion.5": 10,
                 "loop_broadcast_fusion.2": 5}
    events = [("jit_train_step", op, 1000 * ns, None, None) for _ in range(2) for op, ns in durations.items()]
    table = profile_table.reduce_trace(events, costs, module="train_step", steps=2, top=1)
    groups = {(g["pass"], g["runs_per_step"], g["source"]): g for g in table["remainder_by_source"]}
    assert set(groups) == {("-", 24, "body/dot_general"), ("-", 24, "(fusion, no source)"), ("-", 1, "(fusion, no source)"),
                           ("-", 1, "(loop_broadcast_fusion, no source)")}
    assert groups["-", 24, "(fusion, no source)"]["ops"] == 2  # fusion.3 and fusion.6: one group
    other = table["rows"][-1]
    assert other["op"] == "(other 5 ops)"
    assert sum(g["ms_per_step"] for g in groups.values()) == pytest.approx(other["ms_per_step"])
    assert sum(g["events"] for g in groups.values()) == other["events"]
    text = profile_table.markdown(table, "t", by_source=True)
    assert "The 5 ops below the top rows by source" in text and "| - | 24 | body/dot_general | matmul | 1 | 2 |" in text
    assert "ops below the top rows" not in profile_table.markdown(table, "t")


def test_gpu_kernel_annotations_name_their_hlo_op():
    assert profile_table._annotation_op(
        "XlaModule:#hlo_module=jit_train_step,program_id=6#::Thunk:#hlo_op=fusion.12#") == ("jit_train_step", "fusion.12")
    assert profile_table._annotation_op("XlaModule:#hlo_module=jit_f#::custom-call.3:#kernel#") == ("jit_f", "custom-call.3")
    assert profile_table._annotation_op("XlaModule:#hlo_module=jit_f#") == ("jit_f", None)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_the_mgpu_peer_lowers_for_an_h100_in_its_dtype(mode, monkeypatch):
    """jax's attention_mgpu stages q, k, v in float16 shared memory: bfloat16 inputs do not lower (every mgpu row
    of the 2026-11-27 capture failed so), the benchmark's MGPU_DTYPE does, forward and backward."""
    import attention

    attention_mgpu = pytest.importorskip("jax.experimental.pallas.ops.gpu.attention_mgpu")
    # the forward reads the CUDA runtime's version (a ptxas bug in 12.8-12.9.0): a CPU's jaxlib has none
    monkeypatch.setattr(attention_mgpu, "cuda_versions", SimpleNamespace(cuda_runtime_get_version=lambda: 12090))
    fn, args = attention.mgpu_fns(attention_mgpu, False, 1, 256, 1)[mode]

    def lower(dtype):
        with lowering_target(H100) as cuda:
            shapes = [jax.ShapeDtypeStruct(a.shape, dtype) for a in args]
            return fn.trace(*shapes).lower(lowering_platforms=(cuda,)).as_text()

    assert args[0].dtype == attention.MGPU_DTYPE
    assert lower(attention.MGPU_DTYPE).count("mosaic_gpu") >= (1 if mode == "fwd" else 3)
    with pytest.raises(Exception, match="(?i)dtype"):
        lower(jnp.bfloat16)


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
    monkeypatch.setattr(tuning_table, "TUNING_TABLE", table)
    plain = default_tuning(64, 128, 2, jnp.bfloat16)  # no table
    swept = Tuning(block_k=64, block_k_dq=64, block_q_bwd=64, stages=3, pingpong=False)
    assert swept != plain
    write_table(table, **swept._asdict())
    assert default_tuning(64, 128, 2, jnp.bfloat16) == swept
    assert default_tuning(128, 256, 2, jnp.bfloat16) == default_tuning(128, 256, 2, jnp.bfloat16, swept=False)  # no entry
    assert default_tuning(64, 128, 2, jnp.bfloat16, swept=False) == plain
    for kwargs in ({"dry_run": True}, {"device": "cpu"}):  # a dry run's or another device's table is not a measurement
        write_table(table, **kwargs, **swept._asdict())
        assert tuning_table.swept_tuning(64, 128, False, jnp.bfloat16) is None
    write_table(table, block_k=128, block_k_dq=128, block_q_bwd=128, stages=8)  # does not fit shared memory
    assert default_tuning(64, 128, 2, jnp.bfloat16) == plain
    table.write_text('{"best": []}')
    with pytest.raises(ValueError, match="pallas_gpu_tuning.json: not a pallas_gpu tuning table"):
        tuning_table.swept_tuning(64, 128, False, jnp.bfloat16)


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
    assert tuning_table.swept_tuning(128, 256, False, jnp.bfloat16, table) == Tuning(block_k=128)._asdict()
    assert len(pallas_gpu_sweep.candidates(Tuning(), pallas_gpu_sweep.FORWARD_OPTIONS)) == 8


def test_every_tuning_field_is_swept():
    """A kernel variant behind a new Tuning field needs its options in the sweep (the session's sweep phase runs
    what pallas_gpu_sweep.py's options give, no list of its own)."""
    import pallas_gpu_sweep

    assert pallas_gpu_sweep.unswept_fields() == []
    assert set(pallas_gpu_sweep.FIXED_FIELDS) <= set(Tuning._fields)


def test_the_sweeps_best_is_a_tuning_that_agrees_with_the_default():
    import pallas_gpu_sweep

    sweep = object.__new__(pallas_gpu_sweep.Sweep)
    fast_but_wrong, slow = (Tuning(pingpong=False)._asdict(), Tuning()._asdict())
    sweep.rows = [{"tuning": slow, "mode": "fwd", "s": 2.0, "agrees": True},
                  {"tuning": fast_but_wrong, "mode": "fwd", "s": 1.0, "agrees": False},
                  {"tuning": fast_but_wrong, "mode": "fwd+bwd", "error": "unsupported"}]
    assert sweep.best("fwd")["tuning"] == slow and sweep.best("fwd+bwd") is None
    assert pallas_gpu_sweep.rel_diff(jnp.array([1.0, -2.0]), jnp.array([1.0, -2.5])) == pytest.approx(0.5 / 2.5)


def test_the_motif3_slice_holds_as_many_moe_layers_as_the_memory_plan_fits():
    """published's first 4 layers hold 2 MoE layers (110 GiB with their bf16 grads and AdamW moments): an H100's
    budget (95% of 81,559 MiB) takes one (dense_first_layers 3), an H200's would take both. One MoE layer's MLP is
    385 experts of 3 x 4096 x 1280 (+ a 384-wide router) where a dense layer has 3 x 4096 x 12288: 11.0 GiB in bf16."""
    import motif3_step

    h100, h200 = 0.95 * 81559 * 2**20, 0.95 * 143771 * 2**20
    config, plans = motif3_step.choose_slice(motif3_step.base_config(tiny=False), 4096, h100, log=lambda line: None)
    assert (config.num_layers, config.mlp_options.dense_first_layers, config.mlp_options.num_experts) == (4, 3, 384)
    assert (config.d_model, list(config.global_layers), config.remat) == (4096, [0], "full")
    assert [p["moe_layers"] for p in plans] == [2, 1, 0] and [p["fits"] for p in plans] == [False, True, True]
    assert plans[0]["total"] <= 0.9 * h200  # the published first 4 layers, on an H200
    moe_minus_dense = (385 * 3 * 4096 * 1280 + 384 * 4096 - 3 * 4096 * 12288) * 2
    assert plans[0]["params"] - plans[1]["params"] == pytest.approx(moe_minus_dense, rel=1e-3)


def test_the_gpu_tests_run_by_value_resume_and_skip_what_the_sweep_proved(tmp_path):
    """gpu_tests_plugin: the DIFF kernels first and triton last whatever the collection order, an earlier call's
    tests deselected, the long causal d 128 case skipped once this call's sweep checked T 8192 against XLA, and one
    log line per finished test (setup, call and teardown summed)."""
    import gpu_tests_plugin as plugin

    class Item:
        def __init__(self, nodeid):
            self.nodeid, self.name, self.markers = nodeid, nodeid.split("::")[-1], []

        def add_marker(self, marker):
            self.markers.append(marker)

    names = ["test_triton_compiled_on_gpu_matches_reference[96]", "test_pallas_gpu_compiled_other_tunings[change0]",
             "test_pallas_gpu_compiled_forward_and_grads[causal-long-d128]",
             "test_pallas_gpu_single_compiled_forward_and_grads[full-T>S-d128]",
             "test_pallas_gpu_compiled_forward_and_grads[full-rep2-G2-token-d128]", "test_unknown"]
    items = [Item(f"tests/test_ops_pallas_gpu.py::{name}") for name in names]
    done = tmp_path / "done.tsv"
    done.write_text(f"passed\t12.0\t{items[3].nodeid}\n")
    sweep = {"dry_run": False, "single": False, "causal": True, "d": 128, "dv": 256, "T": 8192,
             "reference_check": {"fwd": {"ok": True}, "fwd+bwd": {"ok": True}}}
    (tmp_path / "pallas_gpu_sweep.json").write_text(json.dumps(sweep))
    deselected = []
    config = SimpleNamespace(getoption={"gpu_done": done, "gpu_evidence": tmp_path}.get,
                             hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    plugin.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == [names[2], names[4], names[1], names[0], "test_unknown"]
    assert [i.name for i in deselected] == [names[3]]
    assert [m.kwargs["reason"] for m in items[0].markers] == [
        "proven in this call by the sweep's reference check at T 8192 (pallas_gpu_sweep.json)"]
    assert items[1].markers == []
    sweep["reference_check"]["fwd+bwd"]["ok"] = False  # a failed check proves nothing
    (tmp_path / "pallas_gpu_sweep.json").write_text(json.dumps(sweep))
    items = [Item(f"tests/test_ops_pallas_gpu.py::{names[2]}")]
    plugin.pytest_collection_modifyitems(config, items)
    assert items[0].markers == []

    log = plugin._Log(tmp_path / "log.tsv")
    for when, outcome, seconds in (("setup", "passed", 1.0), ("call", "failed", 2.5), ("teardown", "passed", 0.5)):
        log.pytest_runtest_logreport(SimpleNamespace(nodeid="t::a", when=when, outcome=outcome, duration=seconds,
                                                     failed=outcome == "failed"))
    log.pytest_runtest_logreport(SimpleNamespace(nodeid="t::b", when="call", outcome="passed", duration=9.0, failed=False))
    assert (tmp_path / "log.tsv").read_text() == "failed\t4.0\tt::a\n"  # b never reached its teardown
    assert plugin.done_ids(tmp_path / "log.tsv") == {"t::a"}


def run_session(out: Path, work: Path, *phases: str, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "WORK": str(work), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    env.pop("XLA_FLAGS", None)  # the script's own (its HLO dump), not the tests' 8 devices
    result = subprocess.run(["bash", "benchmarks/gpu_session.sh", *phases], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.single_leg  # every phase a CPU runs, in subprocesses (~5 min)
def test_gpu_session_dry_run(tmp_path):
    """The prepared call's phases and capture at CPU size: each ends with status 0, $OUT holds at most 8 files (the
    key ones and session.tar.gz with everything), the figures are there. (Resuming the tests: the plugin's test above.)"""
    out, work, files = tmp_path / "out", tmp_path / "work", tmp_path / "files"
    phases = ("hlo", "sweep", "bench", "trainstep", "motif3", "tests", "capture")
    result = run_session(out, work, *phases)
    assert sorted(p.name for p in out.iterdir()) == sorted(["gpu.txt", "session.tar.gz", "step_hlo.md", "sweep.log",
                                                            "bench.log", "trainstep_4096_attention.log", "motif3.log",
                                                            "gpu_tests.tsv"])
    gpu_txt = (out / "gpu.txt").read_text()
    assert all(f"== {phase}: exit status 0" in gpu_txt for phase in phases), gpu_txt
    files.mkdir()
    subprocess.run(["tar", "-xzf", str(out / "session.tar.gz"), "-C", str(files)], check=True)
    assert json.loads((files / "step_hlo.json").read_text())["ok"]
    sweep = json.loads((files / "pallas_gpu_sweep.json").read_text())
    assert sweep["dry_run"] and all(check["ok"] for check in sweep["reference_check"].values())
    assert all(r["agrees"] for r in sweep["rows"] if "s" in r)
    assert [r["tuning"]["dkdv"] for r in sweep["rows"] if r["mode"] == "dkdv"] == ["exchange", Tuning().dkdv]  # baseline first
    tuning = json.loads((files / "pallas_gpu_tuning.json").read_text())
    assert tuning["dry_run"] is True and "diff d128 dv256 bfloat16" in tuning["best"]
    assert json.loads((files / "train_step_gpu_4096_attention.json").read_text())["ratios"]
    motif3 = json.loads((files / "motif3_step.json").read_text())
    assert motif3["tiny"] and motif3["choices"]["dense_first_layers"] == 2 and motif3["rows"][0]["tokens_per_s"] > 0
    tests = (out / "gpu_tests.tsv").read_text().splitlines()
    test_files = next(line.split('"')[1] for line in (REPO_ROOT / "benchmarks" / "gpu_session.sh").read_text().splitlines()
                      if line.startswith("GPU_TEST_FILES="))
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                *test_files.split()], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    gpu_tests = [line for line in collected.splitlines() if "::" in line]
    assert len(tests) == len(gpu_tests) > 20, (tests, gpu_tests)
    assert all(line.startswith("skipped\t") for line in tests)  # no GPU: every gpu test skips
    assert "mgpu: skipped" in result.stdout
    check_capture(files)



def check_capture(files: Path):
    """capture's files: both twins' profile tables (reduced again from the kept trace and HLO to the same rows), the
    side-by-side categories, the ncu summary of the synthetic CSV."""
    for model in ("diff-1.4b", "transformer-1.4b"):
        table = json.loads((files / f"profile_{model}.json").read_text())
        assert_table_shape(table)
        assert table["hlo_costs"] and table["steps"] == 2
        assert any(r["category"] == "matmul" and r["tflops"] for r in table["rows"])
        again = files / f"again_{model}.json"
        assert profile_table.main([str(files / f"trace_{model}.xplane.pb.gz"), "--hlo", str(files / f"hlo_{model}.txt.gz"),
                                   "--steps", "2", "--out", str(again)]) == 0
        assert json.loads(again.read_text())["rows"] == table["rows"]
    side_by_side = (files / "profile_diff_vs_twin.md").read_text()
    assert "| category | diff-1.4b ms / step | transformer-1.4b ms / step | transformer-1.4b - diff-1.4b |" in side_by_side
    assert "| matmul |" in side_by_side and "| total |" in side_by_side
    kernels = [r["kernel"] for r in json.loads((files / "ncu_summary.json").read_text())]
    assert sorted(kernels) == ["diffjax_mgpu_bwd_dkdv", "diffjax_mgpu_bwd_dq", "diffjax_mgpu_fwd"]
