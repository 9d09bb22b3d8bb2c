"""A jax.profiler trace (*.xplane.pb, e.g. the trainer's train.profile_steps window) reduced to a per-op table.

    python benchmarks/profile_table.py RUN_DIR/tensorboard [--hlo-dump DIR] [--module train_step] [--steps N]
        [--top 30] --out profile.json                          (writes profile.json and profile.md)
    python benchmarks/profile_table.py trace_diff-1.4b.xplane.pb.gz --hlo hlo_diff-1.4b.txt.gz --steps 2 --out ...
        (a GPU session's kept trace and HLO, reduced again on the CPU)
    python benchmarks/profile_table.py --compare profile_diff-1.4b.json profile_transformer-1.4b.json --out cmp.md
        (categories side by side: where DIFF's step time differs from its twin's)

Time: the device's kernels on a GPU (the /device:GPU planes' "Stream #" lines; each kernel carries the hlo_op /
hlo_module stats CUPTI's collector parses from XLA's annotation stack), else the host's HLO op events (XLA:CPU's
thunks, same stats). Ops of the one module matching --module; shares are of that module's summed op time (on a CPU
ops run on several threads at once: the sum exceeds the wall time). While loops are left out (their bodies' ops are
timed themselves). The trace is read with jax's own reader
(jax.profiler.ProfileData, jaxlib), so no TensorBoard / XProf install is needed.

FLOPs and bytes: from the module's optimized HLO (XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text
--xla_dump_hlo_module_re=train_step"; `hlo_costs`): a dot's 2 x output x contraction (in a fusion: its dots;
cuBLAS custom calls from their dot_dimension_numbers), bytes = operands + result at the op's boundary (an upper
bound on what it moves: operands read twice or broadcast inside count once). Executions per step come from the
while loops' known trip counts (scanned layers), steps from the trace's run ids or --steps. Custom kernels (cuDNN
attention, Pallas Mosaic GPU) carry no FLOP count in the HLO: their TFLOP/s is left empty.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffjax.train.hlo_collectives import tuple_elements  # noqa: E402 (pure: no jax)

CATEGORIES = ("matmul", "attention kernel", "elementwise", "copy or transpose", "reduction", "collective", "other")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
               "c64": 8, "c128": 16, "token": 0}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
MOVEMENT = {"parameter", "constant", "copy", "transpose", "bitcast", "reshape", "broadcast", "slice", "dynamic-slice",
            "dynamic-update-slice", "concatenate", "pad", "tuple", "get-tuple-element", "convert", "reverse",
            "copy-start", "copy-done", "iota"}
CONTROL = {"while", "conditional", "call"}
WRAPPERS = {"eval_jaxpr", "closed_call", "core_call"}  # op_name parts jax versions name differently: not a source
REDUCTIONS = {"reduce", "reduce-window", "reduce-precision", "select-and-scatter", "scatter", "sort"}
ATTENTION_TARGETS = re.compile(r"fmha|mosaic_gpu|triton|flash|attention", re.I)
GEMM_TARGETS = re.compile(r"cublas|gemm|matmul", re.I)


# ------------------------------------------------------------------------------ HLO text

class Instr:
    __slots__ = ("name", "opcode", "shape", "operands", "attrs", "computation")

    def __init__(self, name, opcode, shape, operands, attrs, computation):
        self.name, self.opcode, self.shape, self.operands, self.attrs = name, opcode, shape, operands, attrs
        self.computation = computation


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text) - 1


def _parse_instruction(line: str, computation: str) -> Instr | None:
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple shape
        end = _closing(rest, 0) + 1
    else:
        end = rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    close = _closing(rest, op.end() - 1)
    return Instr(m.group(1), op.group(1), shape, _operand_names(rest[op.end():close]), rest[close + 1:], computation)


def _operand_names(text: str) -> list[str]:
    """Names in an operand list, printed bare ("%a, %b") or with shapes ("f32[2,3]{1,0} %a, (f32[], s32[]) %b")."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i].split()[-1].lstrip("%") if text[start:i].strip() else "")
            start = i + 1
    return [p for p in parts if p]


def parse_hlo(text: str) -> tuple[dict[str, Instr], dict[str, list[Instr]], str | None]:
    """(instructions by name, instructions by computation, the entry computation's name)."""
    instrs, comps, current, entry = {}, collections.defaultdict(list), None, None
    for line in text.splitlines():
        header = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s+(?:\(.*\)\s*->\s*.*)?\{\s*$", line)
        if header and not line.startswith(" "):
            current = header.group(2)
            entry = current if header.group(1) else entry
            continue
        if current and line.strip() and line.strip() != "}":
            instr = _parse_instruction(line, current)
            if instr:
                instrs[instr.name] = instr
                comps[current].append(instr)
    return instrs, comps, entry


def shape_bytes(shape: str) -> float:
    return sum(DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in re.findall(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]", shape))


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(instr: Instr, instrs: dict[str, Instr]) -> float | None:
    """2 x output elements x contracted size, the lhs contracting dims read from the attrs (an HLO dot) or the
    backend config (cuBLAS custom calls)."""
    m = (re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
         or re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs))
    if not m or not instr.operands or instr.operands[0] not in instrs:
        return None
    lhs = _dims(instrs[instr.operands[0]].shape)
    contracted = math.prod(lhs[int(d.strip('" '))] for d in m.group(1).split(",") if d.strip('" '))
    return 2.0 * math.prod(_dims(instr.shape)) * contracted  # tuple shapes (gemm + workspace): the first


def _called(instr: Instr) -> list[str]:
    return re.findall(r"(?:calls|body|to_apply|branch_computations)=\{?%?([\w.\-]+)", instr.attrs)


def _target(instr: Instr) -> str:
    m = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
    return m.group(1) if m else ""


def _inner_opcodes(instr: Instr, instrs, comps, seen=None) -> collections.Counter:
    """Opcodes inside a fusion (recursively), custom-call targets as 'custom-call:TARGET'."""
    seen = seen if seen is not None else set()
    out = collections.Counter()
    for comp in _called(instr):
        if comp in seen:
            continue
        seen.add(comp)
        for inner in comps.get(comp, []):
            out[f"custom-call:{_target(inner)}" if inner.opcode == "custom-call" else inner.opcode] += 1
            if inner.opcode == "fusion":
                out += _inner_opcodes(inner, instrs, comps, seen)
    return out


def _flops(instr: Instr, instrs, comps) -> float | None:
    if instr.opcode == "dot" or (instr.opcode == "custom-call" and GEMM_TARGETS.search(_target(instr))):
        return _dot_flops(instr, instrs)
    if instr.opcode != "fusion":
        return None
    total, found = 0.0, False
    for comp in _called(instr):
        for inner in comps.get(comp, []):
            f = _flops(inner, instrs, comps)
            if f is not None:
                total, found = total + f, True
    return total if found else None


def category(instr: Instr, instrs, comps) -> str:
    op = instr.opcode
    base = op.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return "collective"
    ops = _inner_opcodes(instr, instrs, comps) if op == "fusion" else collections.Counter({
        f"custom-call:{_target(instr)}" if op == "custom-call" else op: 1})
    targets = [o.split(":", 1)[1] for o in ops if o.startswith("custom-call:")]
    if any(ATTENTION_TARGETS.search(t) for t in targets):
        return "attention kernel"
    if ops.keys() & {"dot", "convolution"} or any(GEMM_TARGETS.search(t) for t in targets):
        return "matmul"
    if any(o.removesuffix("-start").removesuffix("-done") in COLLECTIVES for o in ops):
        return "collective"
    if ops.keys() & REDUCTIONS:
        return "reduction"
    if set(ops) <= MOVEMENT:
        return "copy or transpose"
    if targets or ops.keys() & {"while", "conditional", "call", "rng", "rng-bit-generator", "infeed", "outfeed",
                                "send", "recv", "custom-call"}:
        return "other"
    return "elementwise"


def executions_per_run(comps: dict[str, list[Instr]], entry: str | None) -> dict[str, float]:
    """Computation -> times it runs per module execution: while bodies x their known trip counts (1 if unknown),
    nested; computations reached only through fusions are not listed (their ops are not timed on their own)."""
    runs = {entry: 1.0} if entry else {}
    stack = [entry] if entry else []
    while stack:
        comp = stack.pop()
        for instr in comps.get(comp, []):
            if instr.opcode not in ("while", "conditional", "call", "async-start"):
                continue
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
            times = runs[comp] * (float(trips.group(1)) if trips and instr.opcode == "while" else 1.0)
            for callee in re.findall(r"(?:body|to_apply|calls|branch_computations)=\{?([^}]*)", instr.attrs):
                for name in re.findall(r"%?([\w.\-]+)", callee.split(",")[0] if instr.opcode == "while" else callee):
                    if name in comps and name not in runs:
                        runs[name] = times
                        stack.append(name)
    return runs


def hlo_costs(text: str) -> dict[str, dict]:
    """op name -> {category, flops, bytes (per execution), runs (per module execution), source}. A custom call
    inside a fusion (XLA GPU's dynamic-slice fusions around a Mosaic GPU kernel: the kernel reads its operands'
    slices in place) is also listed under its own name, the one the GPU runtime times it by, with the fusion's
    runs and its own operands' bytes (the slices, not the stacks they are cut from)."""
    instrs, comps, entry = parse_hlo(text)
    runs = executions_per_run(comps, entry)
    out = {}
    for comp, times in runs.items():
        for instr in comps.get(comp, []):
            if instr.opcode in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "async-start",
                                "async-done"):  # (an async pair's own computation is costed)
                continue
            out[instr.name] = _cost(instr, instrs, comps, times)
            for inner in _inner_custom_calls(instr, comps) if instr.opcode == "fusion" else ():
                out.setdefault(inner.name, _cost(inner, instrs, comps, times))
    return out


def _cost(instr: Instr, instrs, comps, times: float) -> dict:
    source = re.search(r'op_name="([^"]*)"', instr.attrs)
    return {"opcode": instr.opcode, "category": category(instr, instrs, comps), "flops": _flops(instr, instrs, comps),
            "bytes": op_bytes(instr, instrs, comps),
            "runs": times, "source": _short_source(source.group(1)) if source else "",
            "pass": step_pass(source.group(1)) if source else ""}


def op_bytes(instr: Instr, instrs, comps) -> float:
    """Bytes an op moves at its boundary: its result and operands, except that an operand read only through
    dynamic-slices (a layer's slice of a stacked array) counts as those slices, and one updated in place by a
    dynamic-update-slice (a layer's slice written into a stack) as nothing, the result then as the update written."""
    operands = [_operand_bytes(o, instrs) for o in instr.operands]
    if instr.opcode == "dynamic-slice":
        return 2 * shape_bytes(instr.shape)
    if instr.opcode == "dynamic-update-slice":
        return 2 * operands[1]
    if instr.opcode != "fusion":
        return shape_bytes(instr.shape) + sum(operands)
    inner = [i for comp in _called(instr) for i in comps.get(comp, [])]
    if not inner:
        return shape_bytes(instr.shape) + sum(operands)
    users = collections.defaultdict(list)
    for i in inner:
        for o in i.operands:
            users[o].append(i)
    for i in inner:
        if i.opcode == "parameter" and i.operands and i.operands[0].isdigit() and int(i.operands[0]) < len(operands):
            uses = _uses_through_bitcasts(i.name, users)
            if uses and all(u.opcode == "dynamic-slice" and u.operands[0] == via for u, via in uses):
                operands[int(i.operands[0])] = sum(shape_bytes(u.shape) for u, _ in uses)
            elif uses and all(u.opcode == "dynamic-update-slice" and u.operands[0] == via for u, via in uses):
                operands[int(i.operands[0])] = 0.0  # written in place
    by_name = {i.name: i for i in inner}
    root = inner[-1]  # XLA prints a computation's root last
    results = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    result = sum(shape_bytes(r.shape) if r is None or r.opcode != "dynamic-update-slice"
                 else shape_bytes(by_name[r.operands[1]].shape) if r.operands[1] in by_name else 0.0
                 for r in results if r is not None)
    return result + sum(operands)


def _operand_bytes(name: str, instrs) -> float:
    """Bytes of an operand: an instruction's result, or one element of a tuple result (printed 'name#index')."""
    base, _, index = name.partition("#")
    if base not in instrs:
        return 0.0
    shape = instrs[base].shape
    if index:
        elements = tuple_elements(shape)
        shape = elements[int(index)] if int(index) < len(elements) else ""
    return shape_bytes(shape)


def _uses_through_bitcasts(name: str, users) -> list[tuple[Instr, str]]:
    """(user, the name it reads: `name` or a bitcast of it) of every use of `name`, looking through bitcasts."""
    found = []
    for user in users.get(name, []):
        found += _uses_through_bitcasts(user.name, users) if user.opcode == "bitcast" else [(user, name)]
    return found


def _inner_custom_calls(fusion: Instr, comps) -> list[Instr]:
    return [inner for comp in _called(fusion) for inner in comps.get(comp, []) if inner.opcode == "custom-call"]


def kernel_launches(text: str, pattern: str = r"diffjax_mgpu\w*?_(?:fwd|bwd_dq|bwd_dkdv)") -> list[dict]:
    """Custom calls (also those inside fusions) whose jax provenance names a kernel matching `pattern`, in an HLO
    module's text: one entry per kernel and pass of the step (fwd, bwd, bwd remat) with its HLO ops and launches
    per module execution (while-loop trip counts applied: a scanned layer stack's kernels count once per layer)."""
    instrs, comps, entry = parse_hlo(text)
    found = collections.defaultdict(lambda: {"ops": [], "launches": 0.0})
    for comp, times in executions_per_run(comps, entry).items():
        for instr in comps.get(comp, []):
            inner = _inner_custom_calls(instr, comps) if instr.opcode == "fusion" else []
            for call in [instr] * (instr.opcode == "custom-call") + inner:
                op_name = re.search(r'op_name="([^"]*)"', call.attrs)
                kernel = re.search(pattern, op_name.group(1)) if op_name else None
                if kernel:
                    row = found[kernel.group(0), step_pass(op_name.group(1))]
                    row["ops"].append(call.name)
                    row["launches"] += times
    return [{"kernel": kernel, "pass": name, **value} for (kernel, name), value in sorted(found.items())]


def _short_source(op_name: str) -> str:
    """The jax-level provenance of an op: its pass (step_pass), then the last two path parts (e.g. 'bwd:
    checkpoint/diffjax_mgpu_bwd_dq')."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(") and p not in WRAPPERS]
    return (f"{step_pass(op_name)}: " if step_pass(op_name) else "") + "/".join(parts[-2:])[:80]


def step_pass(op_name: str) -> str:
    """The pass of a differentiated step an op belongs to: 'fwd', 'bwd', 'bwd remat' (the backward's
    recomputation of the forward), '' (not differentiated)."""
    name = "bwd" if "transpose(jvp" in op_name else "fwd" if "jvp(" in op_name else ""
    return name + (" remat" if name and "rematted_computation" in op_name else "")


# ------------------------------------------------------------------------------ trace

def _annotation_op(annotation: str) -> tuple[str | None, str | None]:
    """(module, op) from XLA's GPU annotation stack, e.g. 'XlaModule:#hlo_module=jit_train_step,program_id=6#::
    Thunk:#hlo_op=fusion.12#' or '...::fusion.12:#...#'."""
    module = re.search(r"hlo_module=([\w.\-]+)", annotation)
    op = re.findall(r"hlo_op=([\w.\-]+)", annotation)
    if not op:
        last = annotation.split("::")[-1]
        title = last.split(":#", 1)[0]
        op = [title] if title and not title.startswith("XlaModule") else []
    return (module.group(1) if module else None), (op[-1] if op else None)


def trace_events(xplane: Path):
    """(module, op, duration ns, run id, kernel name) of each timed op: GPU kernels where the trace has a GPU, else
    host ops (no kernel name)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_serialized_xspace(_read_bytes(xplane))
    devices = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if devices:
        for plane in devices:
            for line in plane.lines:
                if not line.name.startswith("Stream #"):  # CUPTI overhead, graph metadata, derived lines
                    continue
                for event in line.events:
                    stats = dict(event.stats)
                    module, op = stats.get("hlo_module"), stats.get("hlo_op")
                    if op is None and stats.get("annotation"):  # older jaxlibs: the raw annotation stack
                        module, op = _annotation_op(str(stats["annotation"]))
                    yield module, str(op or event.name), event.duration_ns, None, event.name
        return
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    yield stats.get("hlo_module"), stats["hlo_op"], event.duration_ns, stats.get("run_id"), None


def _read_bytes(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def find_xplane(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.rglob("*.xplane.pb*"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"profile_table: no *.xplane.pb under {path} (is train.profile_steps set?)")
    return found[-1]


def find_hlo(dump: Path, module: str) -> Path | None:
    files = [p for p in dump.glob("*after_optimizations.txt") if re.search(module, p.name)]
    return max(files, key=lambda p: p.stat().st_size) if files else None


# ------------------------------------------------------------------------------ table

def reduce_trace(events, costs: dict[str, dict], module: str, steps: int | None, top: int) -> dict:
    """The table: ops of `module` by summed time, top `top` and one row for the rest; the time by category and
    the attention kernels' time by role (forward, dq, dk/dv)."""
    time_ns, count, runs, modules = collections.Counter(), collections.Counter(), set(), collections.Counter()
    kernels = collections.defaultdict(collections.Counter)
    for mod, op, dur, run, kernel in events:
        modules[mod] += dur
        if mod is not None and not re.search(module, mod) or _is_control(op, costs.get(op)):
            continue
        time_ns[op] += dur
        count[op] += 1
        runs.add(run)
        if kernel and kernel != op:
            kernels[op][kernel] += dur
    if not time_ns:
        raise SystemExit(f"profile_table: no op of a module matching {module!r} in the trace; modules: "
                         f"{', '.join(str(m) for m, _ in modules.most_common(8))}")
    steps = steps or max(1, len(runs - {None}))
    total = sum(time_ns.values())
    # the GPU kernel that took most of an op's time (a cuBLAS or Mosaic kernel's own name)
    kernel_of = {op: kernels[op].most_common(1)[0][0] if kernels[op] else "" for op in time_ns}
    category_of = {op: op_category(op, costs.get(op), kernel_of[op]) for op in time_ns}
    rows = [_row(op, t, count[op], costs.get(op), steps, total, category_of[op], kernel_of[op])
            for op, t in time_ns.most_common(top)]
    rest = total - sum(t for _, t in time_ns.most_common(top))
    if rest > 0:
        rows.append({"op": f"(other {len(time_ns) - top} ops)", "category": "other", "role": "",
                     "ms_per_step": rest / steps / 1e6, "share": 100 * rest / total,
                     "events": sum(count.values()) - sum(r["events"] for r in rows),
                     "tflops": None, "gbps": None, "source": "", "kernel": ""})
    by_category, by_role = collections.Counter(), collections.defaultdict(list)
    for op, t in time_ns.items():
        by_category[category_of[op]] += t
        if category_of[op] == "attention kernel":
            by_role[attention_role(kernel_of[op] or op)].append(op)
    attention = {role: {"ms_per_step": sum(time_ns[op] for op in ops) / steps / 1e6,
                        "share": 100 * sum(time_ns[op] for op in ops) / total,
                        "launches_per_step": sum(count[op] for op in ops) / steps, "ops": sorted(ops),
                        "kernels": sorted({kernel_of[op] for op in ops} - {""})}
                 for role, ops in by_role.items()}
    remainder = [op for op, _ in time_ns.most_common()[top:]]
    return {"module": module, "steps": steps, "ms_per_step": total / steps / 1e6, "ops": len(time_ns), "rows": rows,
            "remainder_by_source": by_source(remainder, time_ns, count, costs, category_of, steps, total),
            "by_category": {c: {"ms_per_step": t / steps / 1e6, "share": 100 * t / total}
                            for c, t in by_category.most_common()},
            "attention_by_role": dict(sorted(attention.items(), key=lambda kv: -kv[1]["ms_per_step"])),
            "hlo_costs": bool(costs)}


def source_key(op: str, cost: dict | None) -> tuple[str, float, str]:
    """(pass, runs per step, source without the pass) of an op: what `by_source` groups by. Runs tell the loop
    an op is in (a scanned layer stack's trip count, a chunked loss's chunks; 1: once per step: the embedding, the
    optimizer). Ops without a jax provenance (XLA's own: zero-filled loop buffers, copies) go by their fusion kind."""
    cost = cost or {}
    name = cost.get("pass", "")
    source = cost.get("source", "").removeprefix(f"{name}: ")
    kind = re.sub(r"[.]\d+$", "", op)
    return name or "-", cost.get("runs", 1.0), source or f"({kind}, no source)"


def by_source(ops: list[str], time_ns, count, costs: dict, category_of: dict, steps: int, total: float) -> list[dict]:
    """`ops` grouped by source_key, most time first: ms / step, share, ops, events, categories, and the HBM rate
    the HLO's bytes (operands + results at each op's boundary) give over the group's time."""
    groups = collections.defaultdict(list)
    for op in ops:
        groups[source_key(op, costs.get(op))].append(op)
    rows = []
    for (name, runs, source), members in groups.items():
        t = sum(time_ns[op] for op in members)
        nbytes = sum(costs[op]["bytes"] * costs[op]["runs"] * steps for op in members if op in costs)
        categories = collections.Counter({category_of[op]: time_ns[op] for op in members})
        rows.append({"pass": name, "runs_per_step": runs, "source": source, "ms_per_step": t / steps / 1e6,
                     "share": 100 * t / total, "ops": len(members), "events": sum(count[op] for op in members),
                     "categories": [c for c, _ in categories.most_common()],
                     "gbps": nbytes / (t * 1e-9) / 1e9 if nbytes and t else None,
                     "top_ops": sorted(members, key=lambda op: -time_ns[op])[:3]})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def _is_control(op: str, cost: dict | None) -> bool:
    """A while / conditional / call: its event spans its body's ops, which are timed themselves."""
    opcode = cost["opcode"] if cost else re.sub(r"\.\d+$", "", op)
    return opcode in CONTROL


# A GPU kernel's name -> category, for ops the HLO does not describe: our Pallas kernels (diffjax_mgpu_*), cuDNN's
# flash attention (cudnn_generated_..._sdpa_..._flash_fprop / bprop), cuBLAS's (nvjet_*, sm90_xmma_gemm_*) and
# CUTLASS's GEMMs, NCCL, copies, then XLA's own fusions (named after their root: loop_add_fusion,
# input_reduce_fusion).
KERNEL_CATEGORIES = (("attention kernel", r"diffjax_mgpu|flash|fmha|sdpa|attention|mha_"), ("collective", r"nccl"),
                     ("matmul", r"nvjet|cutlass|cublas|gemm|xmma|matmul"),
                     ("copy or transpose", r"memcpy|memset|transpose|copy"), ("reduction", r"reduce|scatter"),
                     ("elementwise", r"^loop_|fusion"))
# An attention kernel's role from its name (ours: diffjax_mgpu[_single]_fwd / _bwd_dq / _bwd_dkdv).
ATTENTION_ROLES = (("dk/dv", r"dkdv|dk_dv|dkv"), ("dq", r"(^|_)dq(_|$)"), ("backward", r"bwd|bprop|backward"),
                   ("forward", r"fwd|fprop|forward"))


def op_category(op: str, cost: dict | None, kernel: str) -> str:
    """The HLO's category; where the HLO does not describe the op (no entry, or "other"), its GPU kernel's name
    decides, then the op's own name."""
    hlo = (cost or {}).get("category")
    if hlo and hlo != "other":
        return hlo
    by_kernel = next((c for c, pattern in KERNEL_CATEGORIES if kernel and re.search(pattern, kernel, re.I)), None)
    return by_kernel or hlo or _category_by_name(op)


def attention_role(kernel: str) -> str:
    """'forward', 'dq', 'dk/dv', 'backward' (a fused backward: cuDNN's bprop), or 'other'."""
    return next((role for role, pattern in ATTENTION_ROLES if re.search(pattern, kernel, re.I)), "other")


def _category_by_name(op: str) -> str:
    """Without the HLO or a kernel name: a guess from XLA's fusion naming (its fusions are named after their ops)."""
    rules = (("attention kernel", r"fmha|flash|mgpu|attention"),
             ("collective", r"all-reduce|all-gather|reduce-scatter"),
             ("matmul", r"dot|gemm|cublas|matmul|conv"), ("reduction", r"reduce"),
             ("copy or transpose", r"copy|transpose|memcpy|slice|concatenate|pad"), ("elementwise", r"fusion"))
    return next((c for c, pattern in rules if re.search(pattern, op, re.I)), "other")


def _row(op, t_ns, events, cost, steps, total, category, kernel) -> dict:
    cost = cost or {}
    executions = cost.get("runs", 0) * steps
    rate = executions / (t_ns * 1e-9) if executions else None  # executions per second of this op's time
    flops, nbytes = cost.get("flops"), cost.get("bytes")
    role = attention_role(kernel or op) if category == "attention kernel" else ""
    return {"op": op, "category": category, "role": role,
            "ms_per_step": t_ns / steps / 1e6, "share": 100 * t_ns / total, "events": events,
            "tflops": flops * rate / 1e12 if flops and rate else None,
            "gbps": nbytes * rate / 1e9 if nbytes and rate else None, "source": cost.get("source", ""),
            "kernel": kernel[:60]}


def markdown(table: dict, title: str, by_source: bool = False) -> str:
    fmt = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
    lines = [f"## {title}", "",
             f"Module `{table['module']}`: {table['ops']} ops, {table['ms_per_step']:.2f} ms of op time per step "
             f"({table['steps']} steps traced){'' if table['hlo_costs'] else '; no HLO dump: no FLOPs / bytes'}.", "",
             "| category | ms / step | share |", "|---|---|---|"]
    lines += [f"| {c} | {v['ms_per_step']:.3f} | {v['share']:.1f}% |" for c, v in table["by_category"].items()]
    lines += ["", "| # | op | category | ms / step | share | events | TFLOP/s | GB/s | source | kernel |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {i} | `{r['op']}` | {r['category']}{': ' + r['role'] if r.get('role') else ''} | "
              f"{r['ms_per_step']:.3f} | {r['share']:.1f}% | {r['events']} | {fmt(r['tflops'], '.1f')} | "
              f"{fmt(r['gbps'], '.0f')} | {r['source'].replace('|', '/')} | {r['kernel']} |"
              for i, r in enumerate(table["rows"], 1)]
    if table.get("attention_by_role"):
        lines += ["", f"Attention kernels by role ({table['steps']} steps traced):", "",
                  "| role | ms / step | share | launches / step | ops | kernels |", "|---|---|---|---|---|---|"]
        lines += [f"| {role} | {v['ms_per_step']:.3f} | {v['share']:.1f}% | {v['launches_per_step']:g} | "
                  f"{', '.join(f'`{op}`' for op in v['ops'])} | {', '.join(v['kernels'])} |"
                  for role, v in table["attention_by_role"].items()]
    if by_source and table.get("remainder_by_source"):
        lines += remainder_markdown(table)
    return "\n".join(lines) + "\n"


def remainder_markdown(table: dict) -> list[str]:
    """The ops below the top rows (the "(other N ops)" row) grouped by source_key, with their sum by category."""
    groups = table["remainder_by_source"]
    by_category = collections.Counter()
    for g in groups:
        by_category[g["categories"][0]] += g["ms_per_step"]
    fmt = lambda x: "" if x is None else f"{x:.0f}"  # noqa: E731
    lines = ["", f"The {sum(g['ops'] for g in groups)} ops below the top rows by source ({table['steps']} steps "
             "traced; runs / step: the loop an op is in, e.g. the layer scan's trip count; GB/s: the HLO's bytes at "
             "each op's boundary over the group's time). By category (each group under its largest): "
             + ", ".join(f"{c} {ms:.1f}" for c, ms in by_category.most_common())
             + f"; {sum(by_category.values()):.1f} ms / step.", "",
             "| pass | runs / step | source | category | ops | events | ms / step | share | GB/s | largest ops |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {g['pass']} | {g['runs_per_step']:g} | {g['source'].replace('|', '/')} | {', '.join(g['categories'])} | "
              f"{g['ops']} | {g['events']} | {g['ms_per_step']:.3f} | {g['share']:.1f}% | {fmt(g['gbps'])} | "
              f"{', '.join(f'`{op}`' for op in g['top_ops'])} |" for g in groups]
    return lines


def compare_markdown(tables: dict[str, dict]) -> str:
    """Two or more tables' categories side by side (ms / step), each against the first: where the time differs."""
    names = list(tables)
    categories = sorted({c for t in tables.values() for c in t["by_category"]},
                        key=lambda c: -tables[names[0]]["by_category"].get(c, {}).get("ms_per_step", 0))
    ms = lambda name, c: tables[name]["by_category"].get(c, {}).get("ms_per_step", 0.0)  # noqa: E731
    lines = ["| category | " + " | ".join(f"{n} ms / step" for n in names) + " | "
             + " | ".join(f"{n} - {names[0]}" for n in names[1:]) + " |", "|---" * (2 * len(names)) + "|"]
    for c in [*categories, "total"]:
        row = [tables[n]["ms_per_step"] if c == "total" else ms(n, c) for n in names]
        lines.append(f"| {c} | " + " | ".join(f"{v:.2f}" for v in row) + " | "
                     + " | ".join(f"{v - row[0]:+.2f}" for v in row[1:]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, nargs="?", help="an *.xplane.pb(.gz) or a directory holding one (the newest)")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="TABLE",
                        help="instead: these tables' (JSON) categories side by side, written to --out (markdown)")
    parser.add_argument("--hlo-dump", type=Path, help="XLA's --xla_dump_to directory (FLOPs and bytes per op)")
    parser.add_argument("--hlo", type=Path, help="or the module's optimized HLO text itself (.txt or .txt.gz)")
    parser.add_argument("--module", default="train_step", help="regex of the HLO module to tabulate")
    parser.add_argument("--steps", type=int, help="module executions in the trace (default: its run ids, else 1)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--by-source", action="store_true",
                        help="also break the ops below --top down by source (pass, loop, jax provenance)")
    parser.add_argument("--title", default="Per-op profile")
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the markdown table beside it (.md)")
    args = parser.parse_args(argv)
    if args.compare:
        text = compare_markdown({p.stem.removeprefix("profile_"): json.loads(p.read_text()) for p in args.compare})
        args.out.write_text(text)
        print(text)
        return 0
    if args.trace is None:
        parser.error("give a trace (or --compare TABLE ...)")
    hlo = args.hlo or (find_hlo(args.hlo_dump, args.module) if args.hlo_dump else None)
    costs = hlo_costs(_read_bytes(hlo).decode()) if hlo else {}
    table = reduce_trace(trace_events(find_xplane(args.trace)), costs, args.module, args.steps, args.top)
    table["trace"], table["hlo"] = str(find_xplane(args.trace)), str(hlo) if hlo else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1))
    text = markdown(table, args.title, args.by_source)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
