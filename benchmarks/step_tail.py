"""The H100 train step's tail (everything but matmuls and attention kernels) from its compile on a CPU.

    python benchmarks/step_tail.py compile --out DIR [--kind transformer] [KEY=VALUE ...]   # deviceless H100
    python benchmarks/step_tail.py compare BEFORE.txt.gz AFTER.txt.gz [--capture PROFILE.json] [--out FILE.md]

`compile`: paper/diff-1.4b's (--kind transformer: its twin's) train step as the 2026-11-27 capture ran it (seq
4096, micro-batch 8, remat attention, bf16, impl auto, the chunked loss; KEY=VALUE: ModelConfig fields, e.g.
remat=minimal) compiled for a deviceless H100 (`diffjax.ops.aot`: JAX's CUDA plugin at jax's version and a ptxas,
`aot.missing("gpu")` names the pip command; run with JAX_PLATFORMS=cpu). The attention ops route as on an H100 and
the Mosaic GPU kernels compile. Writes DIR/hlo.txt.gz (the optimized HLO) and DIR/tail.json (its tail, below).

`compare`: two such HLOs' tails side by side. The tail: every op outside the matmuls and attention kernels,
grouped as benchmarks/profile_table.py --by-source groups a trace (pass, runs per step: the loop, jax source),
with its HBM bytes per step (operands + results at each op's boundary, slices of stacks as read). With
--capture (a profile_table JSON of the GPU's trace of the same step, e.g. the 2026-11-27 capture's, whose ops
were timed with their bytes) each group's time is predicted from its bytes at the rate the capture measured for
the same group (else the capture's median rate over the tail), and the saving from BEFORE to AFTER is the sum of
the differences. A compile says what XLA builds, not how fast: only a GPU confirms a prediction.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CAPTURE = dict(size="1.4b", micro_batch=8, seq_len=4096, remat="attention", dtype="bfloat16", impl="auto")
NOT_TAIL = ("matmul", "attention kernel")
PASSES = ("fwd", "bwd", "bwd remat")  # profile_table.step_pass's names


# ------------------------------------------------------------------------------------------------ compile


def compiled_step_hlo(overrides: dict, kind: str = "diff") -> tuple[str, dict]:
    """(the optimized HLO of paper/<kind>-1.4b's train step compiled for an H100, figures)."""
    import jax
    import numpy as np

    from diffjax.train.mesh import ParallelConfig, make_mesh
    from diffjax.train.optimizer import OptimizerConfig, make_optimizer
    from diffjax.train.step import sharded_init
    from train_step import paper_twins

    from diffjax.ops import aot

    config = paper_twins(CAPTURE["size"])[kind]
    config = config.replace(**{"remat": CAPTURE["remat"], "scan_layers": True, "attention_impl": CAPTURE["impl"],
                               "dtype": CAPTURE["dtype"], "max_seq_len": max(config.max_seq_len, CAPTURE["seq_len"]),
                               **overrides})
    if why := aot.missing("gpu"):
        raise SystemExit(f"step_tail.py: {why}")
    target = aot.gpu_target(1, "h100")
    mesh = make_mesh(ParallelConfig(data=1), list(target.devices))
    tx, schedule = make_optimizer(OptimizerConfig(), 1000)
    training, init = sharded_init(config, tx, mesh)
    abstract = jax.eval_shape(init, jax.random.key(0))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                         training.state_shardings)
    step = training.jit_train_step(tx, schedule, config)
    tokens = jax.ShapeDtypeStruct((1, CAPTURE["micro_batch"], CAPTURE["seq_len"]), np.int32,
                                  sharding=training.step_batch_sharding)
    start = time.perf_counter()
    with aot.compile_for(target):
        compiled = step.lower(state, dict.fromkeys(("tokens", "segment_ids", "positions"), tokens)).compile()
    return compiled.as_text(), {"compile_s": time.perf_counter() - start, "config": config.to_dict()}


# ------------------------------------------------------------------------------------------------ the tail


def tail_groups(hlo_text: str) -> dict[tuple, dict]:
    """(pass, runs per step, source, category) -> {ops, bytes per step, scatter} of the ops outside NOT_TAIL;
    scatter: the group holds a scatter (its time is its atomics', not its bytes')."""
    instrs, comps, _ = profile_table.parse_hlo(hlo_text)
    groups = collections.defaultdict(lambda: {"ops": [], "bytes": 0.0, "scatter": False})
    for op, cost in profile_table.hlo_costs(hlo_text).items():
        if cost["category"] in NOT_TAIL or cost["opcode"] in profile_table.CONTROL:
            continue
        key = (*profile_table.source_key(op, cost), cost["category"])
        groups[key]["ops"].append(op)
        groups[key]["bytes"] += cost["bytes"] * cost["runs"]
        inner = profile_table._inner_opcodes(instrs[op], instrs, comps) if cost["opcode"] == "fusion" else {}
        groups[key]["scatter"] |= cost["opcode"] == "scatter" or "scatter" in inner
    return dict(groups)


def capture_rates(profile: dict) -> tuple[dict, float]:
    """({(pass, runs, source, category): bytes per ms} measured in a capture, the median over its tail groups):
    from a profile_table JSON made with the step's HLO (its rows and remainder groups)."""
    rates = {}
    for g in profile.get("remainder_by_source", []):
        if g["gbps"] and g["gbps"] > 100 and g["categories"][0] not in NOT_TAIL:  # (below: bytes the HLO hides)
            rates[g["pass"], g["runs_per_step"], g["source"], g["categories"][0]] = g["gbps"] * 1e6
    median = statistics.median(rates.values()) if rates else 1.5e9
    for row in profile.get("rows", []):  # the top rows: one op each, its events over the traced steps its runs
        head, _, rest = row["source"].partition(": ")
        name, source = (head, rest) if head in PASSES else ("-", row["source"])
        key = (name, row["events"] / profile["steps"], source, row["category"])
        if row["gbps"] and row["category"] not in NOT_TAIL and key not in rates:
            rates[key] = row["gbps"] * 1e6
    return rates, median


def predicted_ms(key: tuple, group: dict, rates: dict, default: float) -> float | None:
    """The group's bytes at its rate; None for a scatter (bound by its atomics: predicted apart, by hand)."""
    return None if group["scatter"] else group["bytes"] / rates.get(key, default)


def compare(before: dict, after: dict, rates: dict, default: float) -> list[dict]:
    rows = []
    for key in sorted(set(before) | set(after), key=lambda k: -max(before.get(k, {}).get("bytes", 0),
                                                                 after.get(k, {}).get("bytes", 0))):
        empty = {"ops": [], "bytes": 0.0, "scatter": False}
        b, a = before.get(key, empty), after.get(key, empty)
        rows.append({"pass": key[0], "runs_per_step": key[1], "source": key[2], "category": key[3],
                     "ops_before": len(b["ops"]), "ops_after": len(a["ops"]),
                     "gb_before": b["bytes"] / 1e9, "gb_after": a["bytes"] / 1e9,
                     "ms_before": predicted_ms(key, b, rates, default), "ms_after": predicted_ms(key, a, rates, default),
                     "measured_rate": key in rates})
    return rows


def compare_markdown(rows: list[dict], title: str, min_gb: float = 0.05) -> str:
    changed = [r for r in rows if abs(r["gb_after"] - r["gb_before"]) >= min_gb or r["ops_before"] != r["ops_after"]]
    total = lambda k: sum(r[k] or 0.0 for r in rows)  # noqa: E731 (scatters' None: left out)
    ms = lambda x: "atomics" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [f"## {title}", "",
             f"Tail bytes per step {total('gb_before'):.1f} -> {total('gb_after'):.1f} GB; predicted "
             f"{total('ms_before'):.1f} -> {total('ms_after'):.1f} ms / step (saving "
             f"{total('ms_before') - total('ms_after'):.1f} ms; scatters apart: their atomics, not their bytes, take "
             f"their time). Groups that changed (by at least {min_gb} GB or in op count); * = rate measured for that "
             "group in the capture, else its median:", "",
             "| pass | runs / step | source | category | ops | GB / step | predicted ms / step |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pass']} | {r['runs_per_step']:g} | {r['source'].replace('|', '/')} | {r['category']} | "
              f"{r['ops_before']} -> {r['ops_after']} | {r['gb_before']:.2f} -> {r['gb_after']:.2f} | "
              f"{ms(r['ms_before'])} -> {ms(r['ms_after'])}{' *' if r['measured_rate'] else ''} |" for r in changed]
    return "\n".join(lines) + "\n"


def read_hlo(path: Path) -> str:
    return profile_table._read_bytes(path).decode()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("compile", help="compile the step for a deviceless H100")
    build.add_argument("--out", type=Path, required=True, help="directory for hlo.txt.gz and tail.json")
    build.add_argument("--kind", choices=("diff", "transformer"), default="diff", help="paper/<kind>-1.4b")
    build.add_argument("overrides", nargs="*", help="ModelConfig fields KEY=VALUE (as YAML values)")
    both = sub.add_parser("compare", help="two compiled steps' tails")
    both.add_argument("before", type=Path)
    both.add_argument("after", type=Path)
    both.add_argument("--capture", type=Path, help="profile_table JSON of the capture (--by-source): measured rates")
    both.add_argument("--title", default="The step's tail, before -> after")
    both.add_argument("--out", type=Path, help="markdown file to write")
    args = parser.parse_args(argv)
    if args.command == "compile":
        import yaml

        overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.overrides)}
        text, figures = compiled_step_hlo(overrides, args.kind)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hlo.txt.gz").write_bytes(gzip.compress(text.encode()))
        groups = tail_groups(text)
        figures["tail_gb_per_step"] = sum(g["bytes"] for g in groups.values()) / 1e9
        (args.out / "tail.json").write_text(json.dumps(figures, indent=1))
        print(f"compiled in {figures['compile_s']:.0f} s; tail {figures['tail_gb_per_step']:.1f} GB / step; "
              f"wrote {args.out}/hlo.txt.gz")
        return 0
    rates, default = capture_rates(json.loads(args.capture.read_text())) if args.capture else ({}, 1.5e9)
    rows = compare(tail_groups(read_hlo(args.before)), tail_groups(read_hlo(args.after)), rates, default)
    text = compare_markdown(rows, args.title)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
