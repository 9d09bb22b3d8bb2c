"""benchmarks/kernel_resources.py: its ptxas-log and SASS readers on hand-made listings, and (slow, only where JAX's
CUDA plugin and ptxas are installed) the whole script on a small shape, checked against the kernels' source and
against ptxas's own totals."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py"


@pytest.fixture(scope="module")
def kr():
    spec = importlib.util.spec_from_file_location("kernel_resources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PTXAS_LOG = """\
ptxas warning : Registers are spilled to local memory in function 'k_mosaic_gpu_kernel', 532 bytes spill stores, 744 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for k_mosaic_gpu_kernel
    272 bytes stack frame, 532 bytes spill stores, 744 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 272 bytes cumulative stack size, 1 bytes smem
"""

SERIALIZED = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
              "insufficient register resources for the function 'k_mosaic_gpu_kernel'\n")


def test_ptxas_figures(kr):
    assert kr.ptxas_figures(PTXAS_LOG) == {"registers": 168, "stack_frame_bytes": 272, "spill_store_bytes": 532,
                                           "spill_load_bytes": 744, "barriers": 16, "static_smem_bytes": 1,
                                           "wgmma_serialized": None}
    serialized = PTXAS_LOG.replace("ptxas info    : Function", SERIALIZED + "ptxas info    : Function")
    assert kr.ptxas_figures(serialized)["wgmma_serialized"] == "insufficient register resources"
    with pytest.raises(ValueError, match="no resource usage"):
        kr.ptxas_figures("ptxas fatal   : Unsupported .version 9.0")


def _sass(lines: list[str]) -> str:
    """nvdisasm -c's layout: labels on their own line, `/*addr*/  instruction ;` (spills tagged before the ';')."""
    out, addr = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line}")
            addr += 0x10
    return "\n".join(out)


# prologue -> producer (setmaxnreg 40) | consumer (232): a wgmma loop whose barrier wait retries out of line
# (the retry block re-enters the loop body: part of the loop, not a loop of its own), then a store after the loop.
LISTING = _sass([
    "S2R R0, SR_TID.X ;",
    'STL [R1+0x4], R0      (*"SpillRefill"*);',  # prologue: 4 B stored
    "ISETP.GE.AND P0, PT, R0, 0x100, PT ;",
    "@!P0 BRA `(.L_x_0) ;",
    "USETMAXREG.DEALLOC.CTAPOOL 0x28 ;",
    'LDL R2, [R1+0x4]      (*"SpillRefill"*);',  # producer: 4 B loaded
    "EXIT ;",
    ".L_x_0:",
    "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;",
    "MOV R3, RZ ;",
    ".L_x_1:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R3 ;",
    "@!P1 BRA `(.L_x_3) ;",
    ".L_x_2:",
    "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ ;",
    'STL.64 [R1+0x8], R24      (*"SpillRefill"*);',  # loop: 8 B stored
    'LDL.LU.128 R28, [R1+0x10]      (*"SpillRefill"*);',  # loop: 16 B loaded
    "STL [R1+0x40], R5 ;",  # a local store that is not a spill
    "IADD3 R3, R3, 0x1, RZ ;",
    "ISETP.NE.AND P2, PT, R3, 0x8, PT ;",
    "@P2 BRA `(.L_x_1) ;",
    'STL [R1+0x20], R3      (*"SpillRefill"*);',  # consumer, after the loop: 4 B stored
    "EXIT ;",
    ".L_x_3:",
    'LDL R4, [R1+0x4]      (*"SpillRefill"*);',  # the retry path, inside the loop: 4 B loaded
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R3 ;",
    "@!P1 BRA `(.L_x_3) ;",
    "BRA `(.L_x_2) ;",
])


def test_sass_regions_split_spills_by_setmaxnreg_and_loop(kr):
    assert kr.sass_regions(LISTING) == [
        {"region": "prologue", "spill_store_bytes": 4, "spill_load_bytes": 0, "wgmma_loops": []},
        {"region": "dealloc 40", "spill_store_bytes": 0, "spill_load_bytes": 4, "wgmma_loops": []},
        {"region": "try_alloc 232", "spill_store_bytes": 12, "spill_load_bytes": 20,
         "wgmma_loops": [{"instructions": 13, "spill_store_bytes": 8, "spill_load_bytes": 20}]},
    ]


def test_tuning_fields(kr):
    assert kr.tuning_fields("block_q_bwd=64,pingpong=false,dkdv=exchange") == {"block_q_bwd": 64, "pingpong": False, "dkdv": "exchange"}
    with pytest.raises(Exception, match="FIELD=VALUE items of block_q"):
        kr.tuning_fields("blocks=64")


# setmaxnreg (producer, consumers) per kernel: common._set_registers' 40 / 232, or 24 / 240 (dk/dv's lean schedule,
# the single-map backward)
SETMAXNREG = {"diffjax_mgpu_fwd": 40, "diffjax_mgpu_bwd_dq": 40, "diffjax_mgpu_bwd_dkdv": 24,
              "diffjax_mgpu_single_fwd": 40, "diffjax_mgpu_single_bwd_dq": 24, "diffjax_mgpu_single_bwd_dkdv": 24}


@pytest.mark.slow
def test_script_on_a_small_shape(kr, tmp_path):
    """The three kernels of each mode compile for sm_90a; their setmaxnreg is what the kernels ask for, the launch's
    shared memory fits a Hopper CTA, ptxas serializes no wgmma, and (with nvdisasm) the SASS's spill tags add up to
    ptxas's totals."""
    from diffjax.ops.pallas_gpu.common import SMEM_BYTES

    if why := kr.toolchain_missing():
        pytest.skip(why)
    out = tmp_path / "k.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--B", "1", "--T", "256", "--H", "2", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "warning" not in done.stdout, done.stdout  # the pipeline's ptxas and ours agree
    records = json.loads(out.read_text())["kernels"]
    assert [r["kernel"] for r in records] == list(SETMAXNREG)
    for r in records:
        producer = SETMAXNREG[r["kernel"]]
        assert r["setmaxnreg"] == [f"dec {producer}", *[f"inc {(504 - producer) // 2}"] * 2], r["kernel"]
        assert r["wgmma_serialized"] is None, r["kernel"]
        assert 100_000 < r["dynamic_smem_bytes"] <= SMEM_BYTES and r["block"] == [384, 1, 1]
        if "sass_regions" in r:
            assert sum(x["spill_store_bytes"] for x in r["sass_regions"]) == r["spill_store_bytes"]
            assert sum(x["spill_load_bytes"] for x in r["sass_regions"]) == r["spill_load_bytes"]
