"""Registers, spills, stack frame and shared memory of the pallas_gpu kernels as ptxas compiles them for an H100
(sm_90a), on a machine without a GPU.

    python benchmarks/kernel_resources.py [--B 2] [--T 8192] [--H 8] [--K H] [--G 2] [--d 128] [--dv 256]
        [--single-dv d] [--window W] [--packed] [--dtype bfloat16] [--non-causal] [--modes diff,single]
        [--tuning block_q_bwd=64,stages=3] [--cuda-dir DIR] [--out benchmarks/results/kernel_resources_cpu.json]

Defaults: the Nsight capture's shape (B 2, T 8192, H 8 query and kv heads, d 128, dv 256, bf16, causal) and each
mode's default Tuning. Modes: `diff` (q [B, T, H, 2, d], k [B, T, K, G, d], v [B, T, K, dv]) and `single`
(standard attention, the equal-parameter baseline: 2H query heads of d on 2K kv heads, values --single-dv wide,
default d; Motif 3's GDLA: --H 40 --K 8 --d 192 --single-dv 128). --window W: a sliding window of W keys;
--packed: segment ids (packed documents: every step masks). Each mode's jitted gradient is compiled once, which
builds its three kernels (fwd with residuals, bwd_dq, bwd_dkdv).

How: XLA compiles *deviceless* for a one-device CUDA topology made from an H100 target description, so the
Mosaic GPU custom calls go through the same pipeline as on a GPU (jaxlib/mosaic/gpu/custom_call.cc: MLIR -> LLVM ->
PTX -> ptxas); MOSAIC_GPU_DUMP_PTX hands back each kernel's PTX. ptxas -v on that PTX gives the figures (the same
ptxas is put first on PATH, where the pipeline finds its own; its log is checked against ours), and the launch's
dynamic shared memory comes from the lowered Mosaic module. With nvdisasm, the SASS is split by setmaxnreg region
(producer / consumers) and the spills counted per region and per pass of each region's loops (loops with wgmmas:
the streamed steps), from the instructions nvdisasm tags as SpillRefill.

Needs JAX's CUDA plugin of the installed jax version (no GPU or driver needed), e.g. in a separate venv:
    pip install "jax-cuda12-plugin==$JAX" "jax-cuda12-pjrt==$JAX" nvidia-cuda-nvcc-cu12 [nvidia-cuda-nvdisasm]
and a ptxas that knows sm_90a (CUDA >= 12.0: nvidia-cuda-nvcc-cu12, or a CUDA toolkit on PATH / --cuda-dir).
Figures depend on the ptxas version (the JSON records it) and on jax's Mosaic lowering (and its version).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffjax.ops import aot  # noqa: E402
from diffjax.ops.pallas_gpu import (  # noqa: E402
    Tuning,
    default_tuning,
    diff_attention_pallas_gpu,
    dot_product_attention_pallas_gpu,
    unsupported,
)

ARCH = "sm_90a"
KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
OUT = Path(__file__).resolve().parent / "results" / "kernel_resources_cpu.json"


# ------------------------------------------------------------------------------------------------ toolchain


def _tool(name: str, cuda_dir: str | None, only_there: bool = False) -> str | None:
    """`name` from --cuda-dir's bin/ (only there when asked), else where diffjax.ops.aot finds it (PATH, then the pip
    CUDA packages)."""
    if cuda_dir and ((Path(cuda_dir) / "bin" / name).is_file() or only_there):
        return str(Path(cuda_dir) / "bin" / name) if (Path(cuda_dir) / "bin" / name).is_file() else None
    return aot.cuda_tool(name)


def toolchain_missing(cuda_dir: str | None = None) -> str | None:
    """What to install (one line) when JAX's CUDA plugin or a ptxas (--cuda-dir's where given) is absent, else None."""
    if cuda_dir is None:
        return aot.missing("gpu")
    if _tool("ptxas", cuda_dir, only_there=True) is None:
        return f"kernel_resources.py needs ptxas for {ARCH} in {cuda_dir}/bin"
    return aot.cuda_plugin_missing()


def toolchain(cuda_dir: str | None) -> dict:
    """The ptxas (and nvdisasm, optional) to use. The ptxas directory goes first on PATH, where Mosaic's pipeline
    looks for its own."""
    if why := toolchain_missing(cuda_dir):
        raise SystemExit(why)
    ptxas = _tool("ptxas", cuda_dir, only_there=True)
    os.environ["PATH"] = f"{Path(ptxas).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    return {"ptxas": ptxas, "ptxas_version": re.search(r"V(\d+\.\d+\.\d+)", version).group(1),
            "nvdisasm": _tool("nvdisasm", cuda_dir)}


def cuda_sharding():
    """A NamedSharding on one H100 of a deviceless CUDA topology (diffjax.ops.aot): jit with it compiles for that GPU."""
    return jax.sharding.NamedSharding(aot.gpu_target(1).mesh(), jax.sharding.PartitionSpec())


# ------------------------------------------------------------------------------------------------ compile


def lower(mode: str, args, sharding):
    """The jitted gradient of one mode's attention at the command line's shape, lowered for the CUDA device, and
    its Tuning (the mode's default with --tuning's fields)."""
    B, T, H, K, d, dtype = args.B, args.T, args.H, args.K or args.H, args.d, jnp.dtype(args.dtype)
    if mode == "diff":
        shapes = [(B, T, H, 2, d), (B, T, K, args.G, d), (B, T, K, args.dv)]
        tuning = default_tuning(d, args.dv, args.G, dtype)
    else:
        dv = args.single_dv or d
        shapes = [(B, T, 2 * H, d), (B, T, 2 * K, d), (B, T, 2 * K, dv)]
        tuning = default_tuning(d, dv, 1, dtype, single=True)
    tuning = tuning._replace(**(args.tuning or {}))
    inputs = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in shapes]
    why_not = unsupported(*inputs, tuning)
    if why_not:
        raise SystemExit(f"kernel_resources.py: mode {mode}: pallas_gpu {why_not}")
    if mode == "diff":
        inputs.append(jax.ShapeDtypeStruct((B, T, H), jnp.float32, sharding=sharding))
    segment_ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sharding) if args.packed else None

    def loss(*a, segment_ids=None):
        fn = diff_attention_pallas_gpu if mode == "diff" else dot_product_attention_pallas_gpu
        o = fn(*a, causal=not args.non_causal, segment_ids=segment_ids, window=args.window, tuning=tuning,
               interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*inputs, segment_ids=segment_ids).lower(), tuning


@contextlib.contextmanager
def captured_stdout(path: Path):
    """File descriptor 1 (where Mosaic's C++ prints its dumps) into `path` while inside."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def compile_kernels(lowered, workdir: Path) -> dict[str, dict]:
    """Compile; each Mosaic kernel's PTX and the pipeline's own ptxas log, by entry name."""
    os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
    dump = workdir / "dump.txt"
    try:
        with captured_stdout(dump):
            lowered.compile()
    finally:
        for key in ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS"):
            os.environ.pop(key)
    kernels = {}
    for chunk in re.split(r"(?m)^(?=//\n// Generated by LLVM NVPTX)", dump.read_text()):
        if entry := re.search(r"\.entry\s+(\w+)", chunk):
            ptx, _, log = chunk.partition("\nptxas")
            kernels[entry.group(1)] = {"ptx": ptx, "pipeline_ptxas": "ptxas" + log if log else ""}
    return kernels


def launch_shapes(lowered) -> dict[str, dict]:
    """Per Mosaic kernel (module name): dynamic shared memory, grid and block of its launch, read from the
    serialized module each custom call carries."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir, passmanager

    out = {}
    for op in _ops(lowered.compiler_ir("stablehlo").operation):
        if op.name != "stablehlo.custom_call" or "mosaic_gpu" not in str(op.attributes["call_target_name"]):
            continue
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        with jax_mlir.make_ir_context() as ctx, ir.Location.unknown():
            ctx.allow_unregistered_dialects = True
            module = ir.Module.parse(ir.StringAttr(config["module"]).value_bytes)
            passmanager.PassManager.parse("builtin.module(mosaic_gpu-serde{serialize=false})").run(module.operation)
            launch = next(o for o in _ops(module.operation) if o.name == "gpu.launch").opview
            out[ir.StringAttr(module.operation.attributes["sym_name"]).value] = {
                "dynamic_smem_bytes": _constant(launch.dynamicSharedMemorySize),
                "grid": [_constant(getattr(launch, f"gridSize{x}")) for x in "XYZ"],
                "block": [_constant(getattr(launch, f"blockSize{x}")) for x in "XYZ"]}
    return out


def _ops(op):
    for region in op.regions:
        for block in region:
            for child in block:
                yield child
                yield from _ops(child)


def _constant(value):
    owner = None if value is None else value.owner
    return int(owner.attributes["value"].value) if getattr(owner, "name", "") == "arith.constant" else None


# ------------------------------------------------------------------------------------------------ ptxas, SASS


def ptxas_figures(log: str) -> dict:
    """registers / stack frame / spill bytes / barriers / static shared memory from a `ptxas -v` log, and why ptxas
    serialized the kernel's wgmmas (its C7512 note: a wait after every wgmma instruction), or None."""
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    used = re.search(r"Used (\d+) registers(?:, used (\d+) barriers)?.*?(\d+) bytes smem", log)
    if not (stack and used):
        raise ValueError(f"no resource usage in the ptxas log: {log[-300:]!r}")
    serialized = re.search(r"wgmma\.mma_async instructions are serialized due to (.+?) for the function", log)
    return {"registers": int(used.group(1)), "stack_frame_bytes": int(stack.group(1)),
            "spill_store_bytes": int(stack.group(2)), "spill_load_bytes": int(stack.group(3)),
            "barriers": int(used.group(2) or 0), "static_smem_bytes": int(used.group(3)),
            "wgmma_serialized": serialized.group(1) if serialized else None}


def run_ptxas(tools: dict, ptx: str, workdir: Path, name: str) -> tuple[dict, Path]:
    src, cubin = workdir / f"{name}.ptx", workdir / f"{name}.cubin"
    src.write_text(ptx)
    done = subprocess.run([tools["ptxas"], "-v", f"-arch={ARCH}", str(src), "-o", str(cubin)], check=False, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"kernel_resources.py: ptxas {tools['ptxas_version']} failed on {name}: {done.stderr.strip()[-400:]}")
    return ptxas_figures(done.stdout + done.stderr), cubin


def setmaxnreg(ptx: str) -> list[str]:
    """The kernel's setmaxnreg instructions in code order, e.g. ['dec 40', 'inc 232', 'inc 232']."""
    return [f"{a} {n}" for a, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]


def parse_sass(text: str):
    """nvdisasm -c listing -> instructions [(text)], basic blocks [(start, end)] and successor sets."""
    ins, at_label, pending = [], {}, []
    for line in text.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*)", line):
            at_label.update((label, len(ins)) for label in pending)
            pending = []
            ins.append(m.group(1))
    target = [m.group(1) if (m := re.search(r"\bBRA\b.*\((\.L_x_\d+)\)", t)) else None for t in ins]
    ends = [bool(target[i] or re.search(r"\b(EXIT|RET)\b", t)) for i, t in enumerate(ins)]
    starts = sorted({0, *at_label.values(), *(i + 1 for i, end in enumerate(ends) if end)} - {len(ins)})
    blocks = list(zip(starts, starts[1:] + [len(ins)]))
    block_of = {i: b for b, (s, e) in enumerate(blocks) for i in range(s, e)}
    succ = []
    for s, e in blocks:
        last, nxt = ins[e - 1], {block_of[e]} if e < len(ins) else set()
        conditional = last.startswith("@")
        if target[e - 1]:
            succ.append({block_of[at_label[target[e - 1]]]} | (nxt if conditional else set()))
        else:
            succ.append(nxt if (not ends[e - 1] or conditional) else set())
    return ins, blocks, succ


def dominators(succ: list[set]) -> tuple[list[set], dict]:
    """Each block's dominators (iterative data flow from block 0) and each block's predecessors."""
    preds = defaultdict(set)
    for b, ss in enumerate(succ):
        for s in ss:
            preds[s].add(b)
    dom = [set(range(len(succ))) for _ in succ]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, len(succ)):
            new = set.intersection(*(dom[p] for p in preds[b])) | {b} if preds[b] else {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom, preds


def natural_loops(succ, dom, preds) -> list[set]:
    """Blocks of each natural loop (back edge b -> h where h dominates b), merged per header."""
    loops = defaultdict(set)
    for b, ss in enumerate(succ):
        for h in ss & dom[b]:
            body, todo = {h}, [b]
            while todo:
                x = todo.pop()
                if x not in body:
                    body.add(x)
                    todo.extend(preds[x])
            loops[h] |= body
    return list(loops.values())


def _spill_bytes(ins, blocks, body, op: str) -> int:
    total = 0
    for b in body:
        for t in ins[slice(*blocks[b])]:
            if "SpillRefill" in t and (m := re.match(rf"(@!?U?P\w+\s+)?{op}(\.LU)?(\.(64|128))?\s", t)):
                total += int(m.group(4) or 32) // 8
    return total


def sass_regions(text: str) -> list[dict]:
    """Per setmaxnreg region in code order (the blocks its USETMAXREG dominates; 'prologue' the rest): spill bytes,
    and for each innermost loop with wgmmas in it the spill bytes in its body (one pass: a streamed step)."""
    ins, blocks, succ = parse_sass(text)
    dom, preds = dominators(succ)
    marks = [b for b, (s, e) in enumerate(blocks) if any("SETMAXREG" in t for t in ins[s:e])]
    owner = {b: max((m for m in marks if m in dom[b]), default=None, key=lambda m: len(dom[m])) for b in range(len(blocks))}
    gmma = [loop for loop in natural_loops(succ, dom, preds) if any("GMMA" in t for b in loop for t in ins[slice(*blocks[b])])]
    innermost = [loop for loop in gmma if not any(other < loop for other in gmma)]
    out = []
    for mark in [None, *marks]:
        body = {b for b, o in owner.items() if o == mark}
        found = mark is not None and re.search(r"SETMAXREG\.(\w+).*?(0x[0-9a-f]+)", " ".join(ins[slice(*blocks[mark])]))
        steps = [{"instructions": sum(e - s for s, e in (blocks[b] for b in loop)),
                  "spill_store_bytes": _spill_bytes(ins, blocks, loop, "STL"), "spill_load_bytes": _spill_bytes(ins, blocks, loop, "LDL")}
                 for loop in innermost if loop <= body]
        out.append({"region": f"{found.group(1).lower()} {int(found.group(2), 16)}" if found else "prologue",
                    "spill_store_bytes": _spill_bytes(ins, blocks, body, "STL"),
                    "spill_load_bytes": _spill_bytes(ins, blocks, body, "LDL"), "wgmma_loops": steps})
    return out


# ------------------------------------------------------------------------------------------------ report


def kernel_records(mode: str, args, tools: dict, sharding, workdir: Path) -> list[dict]:
    """One mode's three kernels: ptxas figures, setmaxnreg, launch shape and (with nvdisasm) the SASS regions."""
    lowered, tuning = lower(mode, args, sharding)
    launches, kernels = launch_shapes(lowered), compile_kernels(lowered, workdir)
    records = []
    for entry, dump in sorted(kernels.items(), key=lambda kv: [f"_{k}_mosaic" in kv[0] for k in KERNELS].index(True)):
        name = entry.removesuffix("_mosaic_gpu_kernel")
        figures, cubin = run_ptxas(tools, dump["ptx"], workdir, name)
        pipeline = ptxas_figures(dump["pipeline_ptxas"]) if "Used" in dump["pipeline_ptxas"] else None
        if pipeline is not None and pipeline != figures:
            print(f"warning: {name}: the pipeline's own ptxas reported {pipeline}, ptxas {tools['ptxas_version']} {figures}")
        record = {"mode": mode, "kernel": name, "tuning": tuning._asdict(), **figures, **launches.get(name, {}),
                  "setmaxnreg": setmaxnreg(dump["ptx"]), "ptx_isa": re.search(r"\.version (\S+)", dump["ptx"]).group(1)}
        if tools["nvdisasm"]:
            sass = subprocess.run([tools["nvdisasm"], "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            record["sass_regions"] = sass_regions(sass)
        records.append(record)
    return records


def print_table(records: list[dict]) -> None:
    print(f"{'kernel':28} {'regs':>4} {'setmaxnreg':>20} {'stack':>6} {'spill st':>8} {'spill ld':>8} {'dyn smem':>9}  grid x block")
    for r in records:
        print(f"{r['kernel']:28} {r['registers']:>4} {','.join(r['setmaxnreg']) or '-':>20} {r['stack_frame_bytes']:>6} "
              f"{r['spill_store_bytes']:>8} {r['spill_load_bytes']:>8} {r.get('dynamic_smem_bytes', '?'):>9}  "
              f"{r.get('grid')} x {r.get('block')}")
        if r.get("wgmma_serialized"):
            print(f"    wgmma serialized by ptxas: {r['wgmma_serialized']}")
        for region in r.get("sass_regions", []):
            if region["spill_store_bytes"] or region["spill_load_bytes"]:
                loops = "; ".join(f"{x['spill_store_bytes']} B st + {x['spill_load_bytes']} B ld in a {x['instructions']}-instr loop"
                                  for x in region["wgmma_loops"] if x["spill_store_bytes"] or x["spill_load_bytes"])
                print(f"    {region['region']:>10}: {region['spill_store_bytes']} B st, {region['spill_load_bytes']} B ld"
                      f"{' (per pass: ' + loops + ')' if loops else ''}")


def tuning_fields(text: str) -> dict:
    """'block_q_bwd=64,dkdv=exchange' -> {'block_q_bwd': 64, 'dkdv': 'exchange'} over the default Tuning's fields
    (each parsed as the type of the default Tuning's value)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in Tuning._fields or not value:
            raise argparse.ArgumentTypeError(f"--tuning takes FIELD=VALUE items of {', '.join(Tuning._fields)}; got {item!r}")
        default = getattr(Tuning(), key)
        out[key] = value.lower() in ("1", "true") if isinstance(default, bool) else type(default)(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("B", 2), ("T", 8192), ("H", 8), ("K", None), ("G", 2), ("d", 128), ("dv", 256)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--single-dv", type=int, default=None, help="single mode's value head dim (default d)")
    parser.add_argument("--window", type=int, default=None, help="a sliding window of this many keys (causal)")
    parser.add_argument("--packed", action="store_true", help="with segment ids (packed documents)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--modes", default="diff,single", help="comma-separated: diff, single")
    parser.add_argument("--tuning", type=tuning_fields, default=None, help="Tuning fields over each mode's default")
    parser.add_argument("--cuda-dir", default=None, help="a CUDA directory whose bin/ has ptxas (and nvdisasm)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if set(modes) - {"diff", "single"}:
        parser.error(f"--modes takes diff and / or single, got {args.modes!r}")
    if not jax.config.jax_platforms:  # nothing runs, so no CUDA runtime to check: the topology needs no device
        jax.config.update("jax_platforms", "cpu")
    tools = toolchain(args.cuda_dir)
    sharding = cuda_sharding()
    with tempfile.TemporaryDirectory() as tmp:
        records = [r for mode in modes for r in kernel_records(mode, args, tools, sharding, Path(tmp))]
    shape = {k: v for k, v in vars(args).items() if k not in ("out", "cuda_dir", "modes", "tuning")}
    print(f"{ARCH}, ptxas {tools['ptxas_version']}, jax {jax.__version__}; {shape}")
    for mode in modes:
        print(f"{mode}: {Tuning(**next(r['tuning'] for r in records if r['mode'] == mode))}")
    print_table(records)
    if not tools["nvdisasm"]:
        print("(no nvdisasm: pip install nvidia-cuda-nvdisasm for the spills per setmaxnreg region and per loop pass)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": f"cpu, ptxas {tools['ptxas_version']}", "target": f"NVIDIA H100 80GB HBM3 ({ARCH})", "jax": jax.__version__,
        "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
        "shape": shape, "kernels": records,
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
