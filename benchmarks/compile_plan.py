"""The memory plan against the compiler: each run's real train step compiled for its hardware on this machine
(diffjax.train.aot_plan, what `diffjax-train --plan --compile --topology NAME` does), per device, beside the
formula of diffjax.train.plan.

    python benchmarks/compile_plan.py                  # every row not yet in the JSON, one compile at a time
    python benchmarks/compile_plan.py --rows motif3-full-v5p-128 --again
    python benchmarks/compile_plan.py --table          # only rewrite the .md from the JSON

Each compile is recorded in benchmarks/results/compile_plan.json as it finishes (a long run can stop and go on);
the .md is made from the JSON. TPU rows need libtpu, GPU rows JAX's CUDA plugin (diffjax's `aot` extra has both); a
row whose compiler is absent is left out with the install line (diffjax.ops.aot.missing's). Motif 3's compiles take
3-5 minutes and ~10 GiB of memory each here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (nothing runs: every compile is for a topology)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
MOTIF3 = ["model.remat=full", "train.micro_batch_per_device=1", "parallel.data=1", "parallel.expert=16"]
LORA = ["lora.rank=16", "train.init_from=runs/motif3-base"]  # (the base is abstract here: nothing is read)
ROWS = {  # name: (config, topology, overrides)
    "diff-1.4b-v5e-8": ("paper/diff-1.4b", "v5e-8", ["parallel.data=1", "parallel.fsdp=-1",
                                                     "train.micro_batch_per_device=1"]),
    "diff-1.4b-v5p-8": ("paper/diff-1.4b", "v5p-8", ["parallel.data=1", "parallel.fsdp=-1"]),
    "diff-1.4b-h100x8": ("paper/diff-1.4b", "h100x8", ["parallel.data=1", "parallel.fsdp=-1"]),
    "diff-13.1b-v5p-64": ("paper/diff-13.1b", "v5p-64", ["parallel.data=1", "parallel.fsdp=-1", "model.remat=full",
                                                         "train.micro_batch_per_device=1"]),
    "motif3-full-v5p-128": ("motif3/published", "v5p-128", MOTIF3 + ["parallel.fsdp=4", "train.batch_size=64"]),
    "motif3-lora-v5p-128": ("motif3/published", "v5p-128", MOTIF3 + LORA + ["parallel.fsdp=4",
                                                                            "train.batch_size=64"]),
    "motif3-published-v5p-256": ("motif3/published", "v5p-256", []),  # the shipped settings as they are
    "motif3-full-h100x64": ("motif3/published", "h100x64", MOTIF3 + ["parallel.fsdp=4", "train.batch_size=64"]),
    "motif3-lora-h100x64": ("motif3/published", "h100x64", MOTIF3 + LORA + ["parallel.fsdp=4",
                                                                            "train.batch_size=64"]),
    "motif3-full-h100x128": ("motif3/published", "h100x128", MOTIF3 + ["parallel.fsdp=8", "train.batch_size=128"]),
    "motif3-lora-h100x128": ("motif3/published", "h100x128", MOTIF3 + LORA + ["parallel.fsdp=8",
                                                                             "train.batch_size=128"]),
}
GiB = 2**30


def planned(name: str) -> dict:
    """The row's plan by diffjax.train.plan's formula as it is now."""
    from diffjax.train import aot_plan, plan
    from diffjax.train.config import load_run_config
    from diffjax.train.topologies import parse_topology

    config, topology_name, overrides = ROWS[name]
    run, topology = load_run_config(config, overrides), parse_topology(topology_name)
    memory = plan.plan_memory(run, topology.chip, topology.devices)
    return {"mesh": {k: v for k, v in memory.sizes.items() if v > 1}, "route": memory.route,
            "budget": memory.budget.bytes, "budget_why": memory.budget.why,
            "plan": {"params": memory.params, "gradients": memory.gradients, "optimizer": memory.optimizer,
                     **{f"activations_{k}": v for k, v in memory.activations.items()}, "total": memory.total},
            "plan_flops": aot_plan.planned_flops(run, memory.sizes),
            "plan_flops_per_body": aot_plan.planned_flops(run, memory.sizes) / aot_plan.loop_turns(run, memory.sizes)}


def measure(name: str, hlo_dir: Path | None = None) -> dict:
    import jax

    from diffjax.train import aot_plan
    from diffjax.train.config import load_run_config
    from diffjax.train.topologies import parse_topology

    config, topology_name, overrides = ROWS[name]
    run, topology = load_run_config(config, overrides), parse_topology(topology_name)
    record = {"row": name, "config": config, "topology": topology_name, "overrides": overrides, **planned(name),
              "jax": jax.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "date": datetime.date.today().isoformat()}
    if why := aot_plan.missing_compiler(topology):
        return {**record, "skipped": why}
    step = aot_plan.compile_step(run, topology)
    if hlo_dir is not None and step.hlo:
        import gzip

        hlo_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(hlo_dir / f"{name}.hlo.gz", "wt") as out:
            out.write(step.hlo)
    return {**record, "compiled": step.memory, "refused": step.refused, "required": step.required,
            "total": step.total, "flops": step.flops, "collectives": step.collectives, "notes": step.notes,
            "kernels": step.kernels, "seconds": round(step.seconds, 1)}


def _gib(value) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def table(records: list[dict]) -> str:
    head = ("| row | mesh | plan: state / grads + activations / total GiB | plan before this issue, total | compiled: "
            "arguments / temporaries / outputs + code / total GiB | compiled / plan | budget GiB | fits | collectives "
            "GiB (AG / RS / AR / A2A / CP) | FLOPs: XLA / plan per layer and micro-batch | kernels | compile s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        p = r["plan"]
        planned = (f"{_gib(p['params'] + p['optimizer'])} / "
                   f"{_gib(p['total'] - p['params'] - p['optimizer'])} / {_gib(p['total'])}")
        mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
        planned += f" | {_gib(r.get('plan_before', p)['total'])}"
        if "skipped" in r:
            lines.append(f"| {r['row']} | {mesh} | {planned} | not compiled: {r['skipped']} | | | | | | | |")
            continue
        c = r["compiled"]
        if c is None:
            lines.append(f"| {r['row']} | {mesh} | {planned} | refused: {r['refused']} | "
                         f"{r['total'] / p['total']:.2f} | {_gib(r['budget'])} | NO | | | | {r['seconds']:.0f} |")
            continue
        compiled = (f"{_gib(c['arguments'])} / {_gib(c['temporaries'])} / "
                    f"{_gib(c['outputs'] - c['aliased'] + c['code'])} / {_gib(r['total'])}")
        collectives = " / ".join(f"{r['collectives'][k] / GiB:.1f}" for k in
                                 ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"))
        flops = f"{r['flops'] / r['plan_flops_per_body']:.2f}" if r["flops"] and r.get("plan_flops_per_body") else "-"
        kernels = ", ".join(f"{n} {k}" for k, n in r["kernels"].items()) or "none"
        lines.append(f"| {r['row']} | {mesh} | {planned} | {compiled} | {r['total'] / p['total']:.2f} | "
                     f"{_gib(r['budget'])} | {'yes' if r['total'] <= r['budget'] else 'NO'} | {collectives} | "
                     f"{flops} | {kernels} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--again", action="store_true", help="compile rows already in the JSON again")
    parser.add_argument("--table", action="store_true", help="only rewrite the .md from the JSON")
    parser.add_argument("--replan", action="store_true",
                        help="only recompute the JSON's plans by the formula as it is now (the first kept as "
                             "plan_before)")
    parser.add_argument("--json", type=Path, default=RESULTS / "compile_plan.json")
    parser.add_argument("--hlo-dir", type=Path, help="also write each compiled program's text there (gzip)")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    if unknown := [row for row in rows if row not in ROWS]:
        parser.error(f"--rows: {unknown} not among {list(ROWS)}")
    records = json.loads(args.json.read_text()) if args.json.exists() else []
    if args.replan:
        for record in records:
            record.setdefault("plan_before", record["plan"])
            record.update(planned(record["row"]))
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    elif not args.table:
        for row in rows:
            if not args.again and any(r["row"] == row and "skipped" not in r for r in records):
                continue
            print(f"{row}: compiling", flush=True)
            record = measure(row, args.hlo_dir)
            records = [r for r in records if r["row"] != row] + [record]
            records.sort(key=lambda r: list(ROWS).index(r["row"]))
            args.json.write_text(json.dumps(records, indent=1) + "\n")
            print(json.dumps(record), flush=True)
    out = args.json.with_suffix(".md")
    text = out.read_text() if out.exists() else "# compile_plan\n\n<!-- table -->\n<!-- /table -->\n"
    before, rest = text.split("<!-- table -->", 1)
    after = rest.split("<!-- /table -->", 1)[1]
    out.write_text(f"{before}<!-- table -->\n{table(records)}\n<!-- /table -->{after}")
    print(table(records))


if __name__ == "__main__":
    main()
