"""Nsight Compute's per-kernel details reduced to one row per kernel: time, SM / memory / tensor-pipe throughput,
registers, occupancy and the top warp stall reasons.

    ncu --csv --page details --kernel-name regex:diffjax_mgpu --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --metrics "$(python benchmarks/ncu_summary.py \\
        --pick-metrics <(ncu --query-metrics --chip gh100))" python ... > ncu_details.csv
    python benchmarks/ncu_summary.py ncu_details.csv --out ncu_summary.json      (and ncu_summary.md beside it)

Input, as ncu 2023-2025 writes `--csv --page details` (the profiled program's own output and ==PROF== lines may
come before and between): a header row "ID","Process ID","Process Name","Host Name","Kernel Name","Context",
"Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value" (newer
versions add "Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type", "Estimated Speedup"), then one
row per launch (ID) and metric. Sections print their body's display names (SpeedOfLight: "Duration", "Compute (SM)
Throughput", "Memory Throughput"; LaunchStats: "Registers Per Thread", "Dynamic Shared Memory Per Block", "Grid
Size"; Occupancy: "Theoretical Occupancy", "Achieved Occupancy", "Block Limit Registers"; WarpStateStats: "Warp
Cycles Per Issued Instruction"); `--metrics` ones (section "Command line profiler metrics") their raw names:
the tensor pipe's `sm__pipe_tensor*_cycles_active.avg.pct_of_peak_sustained_active` and the stall reasons'
`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio` (cycles per issued instruction spent stalled
for that reason). Values may carry thousands separators ("53,261,312"); durations come in ns / us / ms.
Launches of one kernel name are averaged.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import re
import statistics
import sys
from pathlib import Path

HEADER_START = '"ID","Process ID"'
TIME_UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,  # -> ms
              "second": 1e3, "s": 1e3}
FIELDS = {  # summary field: the details page's metric name
    "sm_throughput_pct": "Compute (SM) Throughput",
    "memory_throughput_pct": "Memory Throughput",
    "dram_throughput_pct": "DRAM Throughput",
    "registers_per_thread": "Registers Per Thread",
    "dynamic_smem_per_block": "Dynamic Shared Memory Per Block",
    "theoretical_occupancy_pct": "Theoretical Occupancy",
    "achieved_occupancy_pct": "Achieved Occupancy",
    "block_limit_registers": "Block Limit Registers",
    "block_limit_smem": "Block Limit Shared Mem",
    "warp_cycles_per_issued": "Warp Cycles Per Issued Instruction",
}
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active")
TENSOR_PIPE = re.compile(r"sm__pipe_tensor\w*_cycles_active")


def read_rows(text: str) -> list[dict]:
    """The CSV rows, whatever the profiled program printed around them."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER_START)), None)
    if start is None:
        raise ValueError('ncu_summary: no ncu CSV header (a line starting "ID","Process ID") in the input: '
                         "was it written with --csv --page details, and did ncu profile any kernel?")
    body = [lines[start]] + [line for line in lines[start + 1:] if line.startswith('"')]
    return list(csv.DictReader(io.StringIO("\n".join(body))))


def number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def per_launch(rows: list[dict], kernel: str) -> dict[str, dict]:
    """Launch ID -> {"kernel": name, metric name: (value, unit)} for kernels whose name matches `kernel`."""
    launches = collections.defaultdict(dict)
    for row in rows:
        name = row.get("Kernel Name", "")
        if not re.search(kernel, name):
            continue
        launch = launches[row["ID"]]
        launch["kernel"] = name
        launch[row.get("Metric Name", "")] = (row.get("Metric Value", ""), row.get("Metric Unit", ""))
    return launches


def summarize_launch(launch: dict) -> dict:
    out = {}
    for field, metric in FIELDS.items():
        value = launch.get(metric)
        out[field] = number(value[0]) if value else None
    duration = launch.get("Duration")
    out["duration_ms"] = number(duration[0]) * TIME_UNITS.get(duration[1], float("nan")) if duration else None
    tensor = [number(v) for m, (v, _) in _metrics(launch) if TENSOR_PIPE.match(m) and number(v) is not None]
    out["tensor_pipe_pct"] = max(tensor) if tensor else None
    out["stalls"] = {STALL.match(m).group(1): number(v) for m, (v, _) in _metrics(launch)
                     if STALL.match(m) and number(v) is not None}
    return out


def _metrics(launch: dict):
    return ((m, v) for m, v in launch.items() if m != "kernel")


def summarize(rows: list[dict], kernel: str = ".", top_stalls: int = 3) -> list[dict]:
    """One row per kernel name (launches averaged), stalls sorted, the top `top_stalls` kept."""
    by_kernel = collections.defaultdict(list)
    for launch in per_launch(rows, kernel).values():
        by_kernel[launch["kernel"]].append(summarize_launch(launch))
    out = []
    for name, launches in by_kernel.items():
        row = {"kernel": name, "launches": len(launches)}
        for field in ("duration_ms", "tensor_pipe_pct", *FIELDS):
            values = [launch[field] for launch in launches if launch[field] is not None]
            row[field] = statistics.fmean(values) if values else None
        stalls = collections.defaultdict(list)
        for launch in launches:
            for reason, value in launch["stalls"].items():
                stalls[reason].append(value)
        ranked = sorted(((statistics.fmean(v), r) for r, v in stalls.items()), reverse=True)
        row["top_stalls"] = [{"reason": r, "cycles_per_issue": v} for v, r in ranked[:top_stalls]]
        out.append(row)
    return sorted(out, key=lambda r: -(r["duration_ms"] or 0))


def pick_metrics(query_text: str) -> list[str]:
    """From `ncu --query-metrics` output: the tensor-pipe and warp-stall metrics this ncu knows, with suffixes."""
    names = set(re.findall(r"^\s*([a-z]\w+)\s", query_text, re.M))
    tensor = sorted(n + ".avg.pct_of_peak_sustained_active" for n in names if TENSOR_PIPE.fullmatch(n))
    stalls = sorted(n + ".ratio" for n in names if STALL.fullmatch(n))
    return tensor + stalls


def markdown(summary: list[dict]) -> str:
    fmt = lambda x, spec=".1f": "" if x is None else format(x, spec)  # noqa: E731
    lines = ["| kernel | launches | ms | SM % | memory % | tensor pipe % | registers | occupancy theor. / achieved % "
             "| warp cycles / issue | top stalls (cycles / issue) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        stalls = ", ".join(f"{s['reason']} {s['cycles_per_issue']:.2f}" for s in r["top_stalls"])
        lines.append(f"| `{r['kernel'][:60]}` | {r['launches']} | {fmt(r['duration_ms'], '.3f')} | "
                     f"{fmt(r['sm_throughput_pct'])} | {fmt(r['memory_throughput_pct'])} | "
                     f"{fmt(r['tensor_pipe_pct'])} | "
                     f"{fmt(r['registers_per_thread'], '.0f')} | {fmt(r['theoretical_occupancy_pct'])} / "
                     f"{fmt(r['achieved_occupancy_pct'])} | {fmt(r['warp_cycles_per_issued'], '.2f')} | {stalls} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, nargs="?", help="ncu --csv --page details output")
    parser.add_argument("--kernel", default=".", help="regex of the kernel names to keep")
    parser.add_argument("--out", type=Path, help="JSON path; the markdown table beside it (.md)")
    parser.add_argument("--pick-metrics", type=Path, metavar="QUERY",
                        help="print the --metrics list picked from `ncu --query-metrics` output, and exit")
    args = parser.parse_args(argv)
    if args.pick_metrics:
        print(",".join(pick_metrics(args.pick_metrics.read_text())))
        return 0
    if args.csv is None:
        parser.error("give the ncu CSV (or --pick-metrics QUERY)")
    try:
        summary = summarize(read_rows(args.csv.read_text(errors="replace")), args.kernel)
    except ValueError as e:
        print(f"{e} ({args.csv})", file=sys.stderr)
        return 1
    if not summary:
        print(f"ncu_summary: no kernel matching {args.kernel!r} in {args.csv}", file=sys.stderr)
        return 1
    text = markdown(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
        args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
