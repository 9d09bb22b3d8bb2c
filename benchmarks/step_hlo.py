"""The train step's attention kernels as compiled: Mosaic GPU custom calls per kernel name and pass, per layer.

    python benchmarks/step_hlo.py [--out step_hlo.json]      # GPU: compile the 1.4B DIFF step, count its kernels
    python benchmarks/step_hlo.py --hlo hlo_diff-1.4b.txt.gz  # count in a kept optimized HLO (a GPU session's)
    python benchmarks/step_hlo.py --tiny                      # CPU: the same path on the tiny DIFF, impl xla

Compiles the step as benchmarks/train_step.py and the capture phase run it (the paper's 1.4B DIFF, micro-batch 8,
seq 4096, remat attention, bf16, impl auto, the chunked loss) and reads XLA's optimized HLO: each custom call (also
inside XLA's dynamic-slice fusions) whose jax provenance names one of our kernels (diffjax_mgpu[_single]_fwd,
_bwd_dq, _bwd_dkdv), by pass (fwd, bwd, bwd remat: the backward's recomputation of the forward), with its launches
per step (the layer scan's trip count applied) and per layer. The check: the forward kernel launches at most twice
per layer (the forward, and once more where remat recomputes it); the 2026-11-27 capture's step launched it three
times (twice in the forward pass). Exit status 1 when the check fails. Writes the JSON, a markdown table beside it
and the optimized HLO gzipped (`--keep-hlo`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_table import _read_bytes, kernel_launches  # noqa: E402

MAX_FORWARD_PER_LAYER = 2


def compiled_step_hlo(size: str, micro_batch: int, seq_len: int, remat: str, impl: str, tiny: bool) -> tuple[str, int]:
    """(the optimized HLO text of the DIFF model's train step, its layers)."""
    from diffjax.config import ModelConfig
    from train_step import TINY, Bench, paper_twins

    config = ModelConfig(**TINY) if tiny else paper_twins(size)["diff"]
    config = config.replace(remat=remat, scan_layers=True, attention_impl=impl, dtype="bfloat16",
                            max_seq_len=max(config.max_seq_len, seq_len))
    compiled, figures = Bench(config, 32 if tiny else None).compile(micro_batch, seq_len)
    print(f"compiled the {'tiny' if tiny else size} DIFF step (micro-batch {micro_batch}, seq {seq_len}, "
          f"remat {remat}, impl {impl}) in {figures['compile_s']:.1f} s", flush=True)
    return compiled.as_text(), config.num_layers


def check(rows: list[dict], layers: int) -> dict:
    """Launches per layer of each kernel and pass, and the forward kernel's total against MAX_FORWARD_PER_LAYER."""
    for row in rows:
        row["per_layer"] = row["launches"] / layers
    forward = sum(r["per_layer"] for r in rows if r["kernel"].endswith("_fwd"))
    return {"layers": layers, "kernels": rows, "forward_per_layer": forward,
            "max_forward_per_layer": MAX_FORWARD_PER_LAYER, "ok": forward <= MAX_FORWARD_PER_LAYER}


def markdown(result: dict) -> str:
    lines = ["| kernel | pass | HLO ops | launches / step | per layer |", "|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['pass'] or '-'} | {', '.join(r['ops'])} | {r['launches']:g} | {r['per_layer']:g} |"
              for r in result["kernels"]]
    verdict = "ok" if result["ok"] else "FAILS"
    lines += ["", f"forward kernel launches per layer: {result['forward_per_layer']:g} (at most "
                  f"{result['max_forward_per_layer']}): {verdict}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hlo", type=Path, help="count in this optimized HLO text (.txt or .txt.gz) instead")
    parser.add_argument("--layers", type=int, default=24, help="with --hlo: the model's layers (1.4B: 24)")
    parser.add_argument("--size", default="1.4b")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--remat", default="attention")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--tiny", action="store_true", help="CPU: the tiny DIFF, micro-batch 2, seq 64, impl xla")
    parser.add_argument("--keep-hlo", type=Path, help="write the compiled step's optimized HLO here (gzipped)")
    parser.add_argument("--out", type=Path, default=Path("step_hlo.json"))
    args = parser.parse_args(argv)
    if args.hlo:
        text, layers = _read_bytes(args.hlo).decode(), args.layers
    elif args.tiny:
        text, layers = compiled_step_hlo(args.size, 2, 64, args.remat, "xla", tiny=True)
    else:
        text, layers = compiled_step_hlo(args.size, args.micro_batch, args.seq_len, args.remat, args.impl, tiny=False)
    if args.keep_hlo and not args.hlo:
        args.keep_hlo.write_bytes(gzip.compress(text.encode()))
    result = check(kernel_launches(text), layers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
