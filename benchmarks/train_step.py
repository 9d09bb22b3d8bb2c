"""Throughput and memory of the full train step (forward, backward, AdamW) of a DIFF model and its Transformer twin.

    python benchmarks/train_step.py                          # 1.4B DIFF + twin, seq 2048 and 4096 (GPU)
    python benchmarks/train_step.py --seq-lens 4096 --remat minimal,attention
    python benchmarks/train_step.py --memory-only --micro-batches 1,4,8 --seq-lens 4096   # compile only (CPU too)
    python benchmarks/train_step.py --tiny                   # tiny twins on CPU in seconds (CI runs this)

Synthetic tokens, one document per row: with `--rows packed` (default) the attention gets segment ids as in packed
training, so cuDNN, which takes none, cannot run it; `--rows unpacked` leaves them out (one document needs none), so
`auto` may take cuDNN where it measured it faster (the twin's attention trains faster on cuDNN without remat, and on
par with the fused kernel under remat=attention: diffjax.ops.HOPPER_MS). bf16 compute, fp32 params, the paper's
100,288 vocabulary, the attention impl `--impl` (auto: the fastest per model and pass, as the trainer picks it), the
loss in chunks as the trainer runs it (`--loss-chunk`, train.loss_chunk).
For every model, sequence length and remat policy:

  memory      XLA's compiled memory analysis of the step (arguments = the train state, temporaries,
              outputs not aliased to the donated state): on CPU this is XLA:CPU's buffer assignment, with
              the xla attention's T x T scores, not what a GPU allocates.
  micro-batch the largest that fits the device (`--micro-batches` given: exactly those, nothing searched):
              compiled at 1 and 2, the next sizes predicted from the growth per sequence and checked by
              compiling; on a GPU the budget is the device's memory limit, elsewhere `--budget-gib`.
  speed       (not with --memory-only) `--steps` timed steps after `--warmup` at that micro-batch:
              tokens/s, TFLOP/s per device by the trainer's FLOP convention (diffjax.train.metrics), MFU
              against the device's dense bf16 peak (989 TFLOP/s on H100) and against a bf16 matmul
              measured in the same run, and the device's peak memory in use.

Then the DIFF/Transformer throughput ratio per sequence length. JSON (device, date, jax version):
benchmarks/results/train_step_<platform>.json unless --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_time import int_list, write_json  # noqa: E402

from diffjax.config import ModelConfig  # noqa: E402
from diffjax.train.config import load_run_config  # noqa: E402
from diffjax.train.mesh import ParallelConfig, make_mesh  # noqa: E402
from diffjax.train.metrics import peak_flops_per_device, training_flops_per_token  # noqa: E402
from diffjax.train.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from diffjax.train.step import resolve_loss_chunk, sharded_init  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "paper"
TINY = dict(vocab_size=512, d_model=64, num_layers=2, num_heads=2, max_seq_len=64)
GiB = 2**30


def paper_twins(size: str) -> dict[str, ModelConfig]:
    return {kind: load_run_config(PAPER / f"{kind}-{size}.yaml").model for kind in ("diff", "transformer")}


class Bench:
    """One model on one device: its (abstract or real) train state and the jitted step, compiled per micro-batch."""

    def __init__(self, model_config: ModelConfig, loss_chunk: int | None, packed: bool = True):
        self.config, self.keys = model_config, ("tokens", "segment_ids", "positions") if packed else ("tokens", "positions")
        self.mesh = make_mesh(ParallelConfig(data=1), jax.devices()[:1])
        self.tx, self.schedule = make_optimizer(OptimizerConfig(), 1000)
        self.training, self.init = sharded_init(model_config, self.tx, self.mesh)
        abstract = jax.eval_shape(self.init, jax.random.key(0))
        self.abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                           abstract, self.training.state_shardings)
        self.loss_chunk = resolve_loss_chunk(loss_chunk, model_config.vocab_size)
        self.step = self.training.jit_train_step(self.tx, self.schedule, model_config, loss_chunk=self.loss_chunk)
        self.compiled = {}

    def compile(self, micro_batch: int, seq_len: int):
        """(compiled step, figures), compiled once per shape."""
        if (micro_batch, seq_len) not in self.compiled:
            self.compiled[micro_batch, seq_len] = self._compile(micro_batch, seq_len)
        return self.compiled[micro_batch, seq_len]

    def _compile(self, micro_batch: int, seq_len: int):
        tokens = jax.ShapeDtypeStruct((1, micro_batch, seq_len), np.int32, sharding=self.training.step_batch_sharding)
        start = time.perf_counter()
        compiled = self.step.lower(self.abstract_state, dict.fromkeys(self.keys, tokens)).compile()
        memory = compiled.memory_analysis()
        figures = {"compile_s": time.perf_counter() - start}
        if memory is not None:
            figures.update(argument_bytes=memory.argument_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
                           output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes)
            figures["total_bytes"] = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
                                      + memory.output_size_in_bytes - memory.alias_size_in_bytes)
        return compiled, figures

    def make_state(self, init: str):
        if init == "zeros":  # no random-init compile (seconds on CPU): for --tiny, where values do not matter
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), self.abstract_state)
        return self.init(jax.random.key(0))

    def batch(self, micro_batch: int, seq_len: int) -> dict:
        tokens = np.random.default_rng(0).integers(0, self.config.vocab_size, (1, micro_batch, seq_len), dtype=np.int32)
        arrays = {"tokens": tokens, "segment_ids": np.ones_like(tokens),
                  "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), tokens.shape)}
        return {key: jax.device_put(arrays[key], self.training.step_batch_sharding) for key in self.keys}


def budget_bytes(override_gib: float | None) -> float:
    stats = jax.devices()[0].memory_stats() or {}
    if override_gib is None and "bytes_limit" in stats:
        return float(stats["bytes_limit"])
    return (override_gib or 80.0) * GiB


def largest_fitting(bench: Bench, seq_len: int, budget: float, most: int, log) -> tuple[int, dict]:
    """(micro-batch, {micro-batch: compile figures}): grow from 1 and 2 by the per-sequence growth."""
    figures = {}

    def fits(micro_batch: int) -> bool:
        if micro_batch not in figures:
            figures[micro_batch] = bench.compile(micro_batch, seq_len)[1]
            log(f"    micro-batch {micro_batch:>3}: {describe(figures[micro_batch])}")
        return figures[micro_batch].get("total_bytes", 0) <= budget

    if not fits(1):
        return 0, figures
    best = 1
    while best < most and fits(best + 1):
        best += 1
        if best >= 2:
            per_sequence = figures[best]["total_bytes"] - figures[best - 1]["total_bytes"]
            guess = best + int((budget - figures[best]["total_bytes"]) // max(per_sequence, 1))
            guess = min(guess, most)
            while guess > best and not fits(guess):
                guess -= 1
            best = max(best, guess)
            if best < most and (best + 1 in figures or not fits(best + 1)):
                break
    return best, figures


def describe(figures: dict) -> str:
    if "total_bytes" not in figures:
        return f"compile {figures['compile_s']:.1f} s (no memory analysis)"
    unaliased = figures["output_bytes"] - figures["alias_bytes"]
    return (f"total {format_bytes(figures['total_bytes'])} = state {format_bytes(figures['argument_bytes'])} + temp "
            f"{format_bytes(figures['temp_bytes'])} + unaliased out {format_bytes(unaliased)}  (compile {figures['compile_s']:.1f} s)")


def format_bytes(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f} GiB" if num_bytes >= GiB else f"{num_bytes / 2**20:.1f} MiB"


def matmul_peak_tflops(n: int, repeats: int = 10) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    jax.block_until_ready(matmul(a, a))
    start = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a, a)
    jax.block_until_ready(out)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def time_steps(bench: Bench, compiled, state, micro_batch: int, seq_len: int, warmup: int, steps: int):
    """(seconds per step, state after)."""
    batch = bench.batch(micro_batch, seq_len)
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / steps, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.4b", help="paper config size: configs/paper/{diff,transformer}-<size>.yaml")
    parser.add_argument("--fallback-size", default="830m", help="the size to run when micro-batch 1 does not fit")
    parser.add_argument("--models", default="diff,transformer", help="which of the twins (comma-separated)")
    parser.add_argument("--seq-lens", type=int_list, default=[2048, 4096])
    parser.add_argument("--remat", default="minimal", help="comma-separated remat policies (model.remat)")
    parser.add_argument("--impl", default="auto", help="model.attention_impl")
    parser.add_argument("--rows", choices=("packed", "unpacked"), default="packed",
                        help="rows with segment ids (as the trainer's packed rows) or without (cuDNN can take them)")
    parser.add_argument("--loss-chunk", type=int, default=None, help="train.loss_chunk (default: the trainer's auto; 0: off)")
    parser.add_argument("--micro-batches", type=int_list, default=None, help="measure exactly these (no search)")
    parser.add_argument("--max-micro-batch", type=int, default=32)
    parser.add_argument("--budget-gib", type=float, default=None, help="memory budget (default: the device's limit; 80 on CPU)")
    parser.add_argument("--memory-only", action="store_true", help="compile and report memory; run nothing")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--init", choices=("random", "zeros"), default="random", help="train state values")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per device (default: by device kind)")
    parser.add_argument("--tiny", action="store_true", help="tiny twins, seq 64, micro-batch 2, 2 steps, zeros init (CPU, CI)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tiny:
        twins = {"diff": ModelConfig(**TINY), "transformer": ModelConfig(**{**TINY, "attention": "standard", "num_heads": 4})}
        args.seq_lens, args.micro_batches, args.steps, args.warmup, args.init = [64], [2], 2, 1, "zeros"
        args.loss_chunk = 32 if args.loss_chunk is None else args.loss_chunk  # the chunked loss, 4 chunks
        args.fallback_size = None
    else:
        twins = paper_twins(args.size)
    device = jax.devices()[0]
    platform = device.platform
    budget = budget_bytes(args.budget_gib)
    peak = peak_flops_per_device(device.device_kind, args.peak_tflops)
    matmul_tflops = None if args.memory_only else matmul_peak_tflops(256 if args.tiny or platform == "cpu" else 8192)
    print(f"{platform} ({device.device_kind}), jax {jax.__version__}; budget {budget / GiB:.1f} GiB; dense bf16 peak "
          f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s; measured bf16 matmul "
          f"{matmul_tflops if matmul_tflops else float('nan'):.1f} TFLOP/s", flush=True)
    out = args.out or REPO / "benchmarks" / "results" / f"train_step_{platform}.json"
    rows = []

    def save():  # after every row: a run cut off by a time limit keeps what it measured
        ratios = throughput_ratios(rows)
        write_json(out, {
            "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
            "budget_bytes": budget, "peak_flops_per_device": peak, "matmul_tflops_measured": matmul_tflops,
            "memory_note": "compiled memory analysis (XLA's buffer assignment for this platform); on CPU not the GPU's",
            "rows": rows, "ratios": ratios,
        })
        return ratios

    for remat in args.remat.split(","):
        for seq_len in args.seq_lens:
            size, models = args.size, twins
            for kind in args.models.split(","):
                rows.append(run_one(args, kind, size, models[kind], remat, seq_len, budget, peak, matmul_tflops))
                if rows[-1]["memory"].get("1", {}).get("total_bytes", 0) > budget and args.fallback_size:
                    size, models = args.fallback_size, paper_twins(args.fallback_size)
                    print(f"  {kind}-{args.size} does not fit at micro-batch 1: {size} instead", flush=True)
                    rows.append(run_one(args, kind, size, models[kind], remat, seq_len, budget, peak, matmul_tflops))
                save()
    for ratio in save():
        print(f"DIFF / Transformer tokens/s, {ratio['size']} seq {ratio['seq_len']} remat {ratio['remat']}: "
              f"{ratio['diff_over_transformer']:.3f}")


def run_one(args, kind: str, size: str, config: ModelConfig, remat: str, seq_len: int, budget: float, peak, matmul_tflops) -> dict:
    config = config.replace(remat=remat, scan_layers=True, attention_impl=args.impl, dtype="bfloat16",
                            max_seq_len=max(config.max_seq_len, seq_len))
    bench = Bench(config, args.loss_chunk, packed=args.rows == "packed")
    name = f"{kind}-{size}" if not args.tiny else f"{kind}-tiny"
    print(f"{name}: {config.param_count() / 1e6:,.1f}M params, seq {seq_len}, remat {remat}, impl {args.impl}, "
          f"{args.rows} rows, loss chunk {bench.loss_chunk}", flush=True)
    row = {"model": name, "params": config.param_count(), "seq_len": seq_len, "remat": remat, "impl": args.impl,
           "rows": args.rows, "loss_chunk": bench.loss_chunk, "model_config": config.to_dict()}
    if args.micro_batches:
        figures = {}
        for micro_batch in args.micro_batches:
            figures[micro_batch] = bench.compile(micro_batch, seq_len)[1]
            print(f"    micro-batch {micro_batch:>3}: {describe(figures[micro_batch])}", flush=True)
        fitting = [mb for mb in args.micro_batches if figures[mb].get("total_bytes", 0) <= budget]
        best = max(fitting, default=0)
    else:
        best, figures = largest_fitting(bench, seq_len, budget, args.max_micro_batch, lambda line: print(line, flush=True))
    row.update(memory={str(mb): f for mb, f in sorted(figures.items())}, micro_batch=best)
    if args.memory_only or best == 0:
        return row
    state = bench.make_state(args.init)
    while best > 0:
        try:
            seconds, state = time_steps(bench, bench.compile(best, seq_len)[0], state, best, seq_len, args.warmup, args.steps)
            break
        except jax.errors.JaxRuntimeError as error:  # the analysis said it fits, the allocator disagreed
            if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
                raise
            print(f"    micro-batch {best}: out of memory when run; trying {best - 1}", flush=True)
            best -= 1
            state = bench.make_state(args.init)
    row["micro_batch"] = best
    if best == 0:
        return row
    tokens_per_s = best * seq_len / seconds
    flops = training_flops_per_token(config, seq_len) * tokens_per_s  # one device
    stats = jax.devices()[0].memory_stats() or {}
    row.update(step_s=seconds, tokens_per_s=tokens_per_s, tflops_per_device=flops / 1e12,
               mfu=flops / peak if peak else None, mfu_vs_measured_matmul=flops / (matmul_tflops * 1e12),
               peak_bytes_in_use=stats.get("peak_bytes_in_use"))
    print(f"    micro-batch {best}: {tokens_per_s:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s"
          + (f", MFU {100 * flops / peak:.1f}%" if peak else "")
          + f", {100 * row['mfu_vs_measured_matmul']:.1f}% of the measured matmul"
          + (f", peak memory {format_bytes(stats['peak_bytes_in_use'])}" if "peak_bytes_in_use" in stats else ""), flush=True)
    return row


def throughput_ratios(rows: list[dict]) -> list[dict]:
    ratios = []
    for diff in rows:
        if not diff["model"].startswith("diff-") or "tokens_per_s" not in diff:
            continue
        twin_name = "transformer-" + diff["model"].removeprefix("diff-")
        for twin in rows:
            if (twin["model"], twin["seq_len"], twin["remat"]) == (twin_name, diff["seq_len"], diff["remat"]) and "tokens_per_s" in twin:
                ratios.append({"size": diff["model"].removeprefix("diff-"), "seq_len": diff["seq_len"], "remat": diff["remat"],
                               "micro_batches": [diff["micro_batch"], twin["micro_batch"]],
                               "diff_over_transformer": diff["tokens_per_s"] / twin["tokens_per_s"]})
    return ratios


if __name__ == "__main__":
    main()
