"""The fused attention kernels compiled ahead of time for TPU v4 / v5e / v5p / v6e (libtpu's topologies) and an H100
(XLA's deviceless CUDA compiler), on a machine with neither: every attention kind at its shipped config's shapes,
forward and forward+backward, with the block sizes `auto` uses there. No device runs anything.

    python benchmarks/aot_kernels.py [--targets v4,v5e,v5p,v6e,h100] [--cases diff,gdla-windowed,...]
        [--out benchmarks/results/aot_kernels_cpu.json]

Per target, ONE program holds every case (each under its own jax.named_scope, each pass on its own inputs), so a
target costs one compile; the compiled HLO then says, per case and pass, which kernels it holds
(diffjax.ops.aot.compiled_kernels: Mosaic TPU's tpu_custom_call / Mosaic GPU's mosaic_gpu_v2, named by their
pallas_call) and, on a TPU, each kernel's scoped VMEM (libtpu's used_scoped_memory_configs). A case that fell back to XLA or to interpret
mode holds no kernel. On the TPUs the calls go through diffjax.ops with impl="auto" (so `auto` must pick the Pallas
TPU kernel there); on the H100 through impl="pallas_gpu" (auto weighs it against cuDNN per pass: HOPPER_MS), with
the pipeline's ptxas log per kernel where MOSAIC_GPU_DUMP_PTXAS can be read (registers, spills).

Cases: the train step's attention call (packed rows: segment ids; causal) of paper/diff-1.4b, paper/diff-v2-1.4b,
paper/shared-diff-1.4b, paper/transformer-1.4b, a GDA 4:1 layer (Motif-2-12.7B's ratio) and motif3/published
(GDLA: global and windowed layers), shapes from the attention modules' own `project` at the config's sequence
length, one micro-batch row; and a context-parallel chunk (DIFF 1.4B's, half the queries against all the keys at a
traced query offset), called on the kernels directly as context_parallel does.

Needs libtpu for the TPUs (pip install "jax[tpu]==<jax's version>", or diffjax's `aot` extra) and JAX's CUDA plugin
with a ptxas for the H100 (diffjax.ops.aot.missing names the command); a target without them is skipped, named.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: nothing runs here, the targets only compile

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from diffjax import ops  # noqa: E402
from diffjax.ops import aot  # noqa: E402
from diffjax.ops.choice import pallas_gpu_unsupported  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "aot_kernels_cpu.json"
TARGETS = ("v4", "v5e", "v5p", "v6e", "h100")
PASSES = ("fwd", "fwd+bwd")
# The kernels each pass compiles to: the forward (with its residuals when differentiated), dq and dk/dv.
KERNELS = {"tpu": {"fwd": ("diffjax_flash_fwd_m{M}",),
                   "fwd+bwd": ("diffjax_flash_fwd_m{M}", "diffjax_flash_bwd_dq_m{M}", "diffjax_flash_bwd_dkv_m{M}")},
           "gpu": {"fwd": ("diffjax_mgpu{single}_fwd",),
                   "fwd+bwd": ("diffjax_mgpu{single}_fwd", "diffjax_mgpu{single}_bwd_dq", "diffjax_mgpu{single}_bwd_dkdv")}}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call: `call`'s shapes (B 1), and for a context chunk the place of its queries (q_offset)."""

    name: str
    source: str  # where its shapes come from
    call: ops.AttentionCall
    q_offset: int | None = None

    @property
    def maps(self) -> int:
        return 2 if self.call.op == "diff_attention" else 1

    def expected(self, platform: str, pass_: str) -> dict[str, int]:
        names = KERNELS[platform][pass_]
        return {n.format(M=self.maps, single="_single" if self.maps == 1 else ""): 1 for n in names}


def _train_call(config_name: str, overrides=(), layers: str = "") -> ops.AttentionCall:
    """The train step's attention call of a shipped config (its `layers` variant: "global" / "windowed")."""
    from diffjax.model.sizes import attention_calls
    from diffjax.train.config import load_run_config

    config = load_run_config(config_name, ["model.vocab_size=256", *overrides])
    calls = [call for what, call in attention_calls(config.model, config.data.seq_len) if what.startswith("train")
             and (not layers or f"({layers} layers)" in what)]
    return dataclasses.replace(calls[0], saved="all")


def cases(small: bool = False) -> list[Case]:
    """The matrix; `small`: each call cut to one kv head (its query heads per kv head kept), at most SMALL_T
    tokens: the same kernels (head dims, GQA ratio, masks) in smaller grids, which libtpu compiles ~3x faster (CI)."""
    gda = ["model.attention=gda", "model.num_heads=16", "model.num_kv_heads=4", "model.head_dim=128",
           "model.attention_options={num_noise_heads: 4}"]
    shrink = _small if small else (lambda call: call)
    diff = shrink(_train_call("paper/diff-1.4b"))
    B, T, H, _, d = diff.q_shape
    chunk = dataclasses.replace(diff, q_shape=(B, T // 2, H, 2, d), segments=None)
    return [
        Case("diff", "paper/diff-1.4b", diff),
        Case("diff_v2", "paper/diff-v2-1.4b", shrink(_train_call("paper/diff-v2-1.4b"))),
        Case("shared_diff", "paper/shared-diff-1.4b", shrink(_train_call("paper/shared-diff-1.4b"))),
        Case("gda", "paper/diff-1.4b as GDA 16:4, kv 4, d 128", shrink(_train_call("paper/diff-1.4b", gda))),
        Case("gdla-global", "motif3/published, global layers", shrink(_train_call("motif3/published", layers="global"))),
        Case("gdla-windowed", "motif3/published, windowed layers",
             shrink(_train_call("motif3/published", layers="windowed"))),
        Case("standard", "paper/transformer-1.4b", shrink(_train_call("paper/transformer-1.4b"))),
        Case("diff-context-chunk", "paper/diff-1.4b, 2nd query half at a traced offset", chunk, q_offset=T // 2),
    ]


SMALL_T = 512


def _small(call: ops.AttentionCall) -> ops.AttentionCall:
    B, T, H = call.q_shape[:3]
    K = call.k_shape[2]
    cut = lambda shape, heads: (B, min(shape[1], SMALL_T), heads) + tuple(shape[3:])  # noqa: E731
    return dataclasses.replace(call, q_shape=cut(call.q_shape, H // K), k_shape=cut(call.k_shape, 1),
                               v_shape=cut(call.v_shape, 1))


def _inputs(case: Case, sharding) -> tuple:
    """(q, k, v, lam, segment_ids, q_offset) as ShapeDtypeStructs on `sharding` (lam per token: [B, T, H])."""
    q, k, v, ids = case.call.arrays()
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
    lam = spec(jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)) if case.maps == 2 else None
    offset = None if case.q_offset is None else spec(jax.ShapeDtypeStruct((), jnp.int32))
    return spec(q), spec(k), spec(v), lam, None if ids is None else spec(ids), offset


def _attend(case: Case, impl: str, q, k, v, lam, ids, offset):
    """The case's call: through diffjax.ops (impl), or a context chunk's on the kernels themselves."""
    kw = dict(causal=case.call.causal, segment_ids=ids, window=case.call.window)
    if offset is not None:  # what context_parallel_fused runs per query chunk
        if impl == "pallas_gpu":
            from diffjax.ops.pallas_gpu import diff_attention_pallas_gpu as kernel
        else:
            from diffjax.ops.pallas_tpu import diff_attention_pallas as kernel
        return kernel(q, k, v, lam, q_offset=offset, **kw)
    if case.maps == 2:
        return ops.diff_attention(q, k, v, lam, impl=impl, **kw)
    return ops.dot_product_attention(q, k, v, impl=impl, **kw)


def program(matrix: list[Case], impl: str, passes=PASSES):
    """f(inputs) -> outputs: each case's forward ("fwd") and gradient in q, k, v, lam ("fwd+bwd"), each in its scope
    "case.pass" on its own inputs[case, pass]."""

    def f(inputs):
        outs = {}
        for case, p in ((case, p) for case in matrix for p in passes):
            q, k, v, lam, ids, offset = inputs[case.name, p]

            def loss(q, k, v, lam, case=case, ids=ids, offset=offset):
                return _attend(case, impl, q, k, v, lam, ids, offset).astype(jnp.float32).sum()

            with jax.named_scope(f"{case.name}.{p}"):
                if p == "fwd":
                    outs[case.name, p] = _attend(case, impl, q, k, v, lam, ids, offset)
                else:
                    outs[case.name, p] = jax.grad(loss, argnums=(0, 1, 2) if lam is None else (0, 1, 2, 3))(q, k, v, lam)
        return outs

    return f


@contextlib.contextmanager
def ptxas_log(path: Path, enabled: bool):
    """Mosaic GPU's pipeline prints each kernel's ptxas -v log to fd 1 with MOSAIC_GPU_DUMP_PTXAS: into `path`."""
    if not enabled:
        yield
        return
    from kernel_resources import captured_stdout

    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    try:
        with captured_stdout(path):
            yield
    finally:
        os.environ.pop("MOSAIC_GPU_DUMP_PTXAS")


def ptxas_figures(log: str) -> list[dict]:
    """[{entry, registers, spill_store_bytes, spill_load_bytes, stack_frame_bytes}] in the log's order."""
    figures = []
    pattern = (r"Compiling entry function '(\w+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
               r"spill loads.*?Used (\d+) registers")
    for entry, stack, stores, loads, registers in re.findall(pattern, log, re.S):
        figures.append({"entry": entry, "registers": int(registers), "spill_store_bytes": int(stores),
                        "spill_load_bytes": int(loads), "stack_frame_bytes": int(stack)})
    return figures


def compile_matrix(target: aot.Target, matrix: list[Case], passes=PASSES, gpu_figures: bool = False) -> dict:
    """Compile every case's `passes` for `target` in one program; per case and pass its kernels (and each kernel's
    scoped VMEM on a TPU; with gpu_figures, ptxas's figures per kernel on a GPU, in the pipeline's order). A case the
    pallas_gpu kernels refuse is left out on a GPU, with why (`not_compiled`)."""
    platform = target.device.platform
    impl = "pallas_gpu" if platform == "gpu" else "auto"
    refused = {case.name: why for case in matrix if platform == "gpu" and (why := pallas_gpu_unsupported(case.call))}
    matrix = [case for case in matrix if case.name not in refused]
    sharding = jax.sharding.NamedSharding(aot.Target(target.name, target.devices[:1]).mesh(),
                                          jax.sharding.PartitionSpec())
    inputs = {(case.name, p): _inputs(case, sharding) for case in matrix for p in passes}
    start = time.perf_counter()
    with aot.compile_for(target):
        lowered = jax.jit(program(matrix, impl, passes)).lower(inputs)
    lowered_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ptxas.log"
        with aot.compile_for(target), ptxas_log(log, gpu_figures and platform == "gpu"):
            compiled = lowered.compile()
        ptxas = ptxas_figures(log.read_text(errors="replace")) if log.exists() else []
    compile_s = time.perf_counter() - start - lowered_s
    calls = aot.compiled_kernels(compiled.as_text())
    memory = compiled.memory_analysis()
    rows = []
    for case in matrix:
        route = ops.choose(case.call, impl, target.device)
        for p in passes:
            mine = [call for call in calls if call.within(f"{case.name}.{p}")]
            row = {"case": case.name, "source": case.source, "pass": p, "call": case.call.describe(),
                   "route": route.by_pass()[p][0] if case.q_offset is None else impl,
                   "kernels": dict(collections.Counter(call.name for call in mine)),
                   "expected": case.expected(platform, p)}
            if platform == "tpu":
                row["scoped_vmem_bytes"] = {call.name: [c.scoped_vmem_bytes for c in mine if c.name == call.name]
                                            for call in mine}
            rows.append(row)
    return {"target": target.name, "device_kind": target.device.kind, "lower_s": round(lowered_s, 2),
            "compile_s": round(compile_s, 2), "not_compiled": refused,
            "memory": {k: getattr(memory, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                        "temp_size_in_bytes", "generated_code_size_in_bytes")},
            "ptxas": ptxas, "rows": rows}


def print_result(result: dict) -> None:
    print(f"{result['target']} ({result['device_kind']}): lowered in {result['lower_s']} s, compiled in "
          f"{result['compile_s']} s; per device: {result['memory']}")
    for row in result["rows"]:
        ok = "ok" if row["kernels"] == row["expected"] else "MISSING"
        vmem = row.get("scoped_vmem_bytes")
        vmem = "" if not vmem else "  scoped VMEM " + ", ".join(
            f"{k.removeprefix('diffjax_flash_')} {max(v) / 2**20:.2f} MiB" for k, v in sorted(vmem.items()))
        print(f"  {ok:7} {row['case']:19} {row['pass']:8} {row['route']:10} {sum(row['kernels'].values())} kernels{vmem}")
    for case, why in result["not_compiled"].items():
        print(f"  not compiled: {case}: the kernel {why} (auto takes another route there)")
    for figures in result["ptxas"]:
        print(f"  ptxas {figures}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {TARGETS}")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--small", action="store_true", help="the CI test's cut: one kv head, at most 512 tokens")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    matrix = cases(small=args.small)
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {c.name for c in matrix}
        if unknown:
            parser.error(f"unknown cases {sorted(unknown)}; known: {[c.name for c in matrix]}")
        matrix = [c for c in matrix if c.name in wanted]
    results, skipped = [], {}
    for name in args.targets.split(","):
        platform = "gpu" if name.startswith("h100") else "tpu"
        if why := aot.missing(platform):
            skipped[name] = why
            print(f"{name}: skipped: {why}")
            continue
        result = compile_matrix(aot.target(name), matrix, gpu_figures=True)
        print_result(result)
        results.append(result)
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin")
                if importlib.util.find_spec(p.replace("-", "_")) or p in ("jax", "jaxlib")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                                    "versions": versions, "skipped": skipped, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
