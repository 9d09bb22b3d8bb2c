"""The CPU train step against PyTorch eager: transformers' DiffLlama + torch.optim.AdamW vs diffjax's jitted step.

    python benchmarks/peers.py                        # everything: both layouts, timings, JSON + markdown
    python benchmarks/peers.py --profile DIR          # also XLA's optimized HLO, a jax trace and a torch profile
    python benchmarks/peers.py --repeats 9 --busy 1   # longer; one busy-looping process beside it ("under load")

The model: a random DiffLlama of ~57M parameters (MODEL: d_model 768, 8 layers, 12 HF heads = 6 differential
heads of 2 x 64, MLP 2048, vocab 512), fp32, batch 4 x 256 tokens, one document per row. transformers makes it
(its own init) and saves it; diffjax loads the same weights with diffjax.load_hf. Both train with AdamW (lr 3e-4
constant, betas 0.9 / 0.95, eps 1e-8, weight decay 0.1 except norms and lambdas, gradients clipped to norm 1):
PyTorch in eager mode (no torch.compile; transformers' default attention, `--torch-attention`), diffjax's
`jit_train_step` as the trainer runs it (state donated, the loss over the whole logits: train.loss_chunk 0 at
this vocabulary), once per layout (model.scan_layers false = "unrolled", true = "scanned").

Checks: the first step's losses agree to LOSS_RTOL (relative), and so do the second's (one AdamW update later:
the optimizers are the same algorithm); a disagreement exits 1 before any timing.

Timing: warm-up steps first (diffjax's first call compiles: lower + compile time and time to the first step are
reported apart), then --repeats rounds, each timing one step of every runner back to back, the order rotated
each round, so that load from other processes falls on all of them alike. Figures: the median step time of each
runner, steps/s, and the ratio to PyTorch (the median of the per-round ratios: robust to load that changes from
round to round), with the load average (1 min) before, during and after, torch's intra-op threads and XLA's
thread settings. Idle-core figures need a quiet machine: rerun this command there.

Writes benchmarks/results/peers_cpu.json and peers_cpu.md (--out; benchmarks/results/peers.md reads them). With
--profile DIR: DIR/hlo_<layout>.txt (XLA's optimized HLO of each layout's step), DIR/trace_<layout>/ (a
jax.profiler trace of 2 steps, reduced to DIR/profile_<layout>.md by benchmarks/profile_table.py --by-source) and
DIR/torch_profile.txt (torch.profiler's op table of 2 steps).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform as py_platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "peers_cpu.json"
MODEL = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
             intermediate_size=2048, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5)
BATCH, SEQ_LEN = 4, 256
OPTIM = dict(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0)
# --tiny: the same path in seconds (tests/test_peers.py)
TINY = dict(model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=96, vocab_size=97, max_position_embeddings=32, rms_norm_eps=1e-5),
            batch=2, seq_len=32)
LOSS_RTOL = 1e-5
LAYOUTS = {"unrolled": False, "scanned": True}


# ------------------------------------------------------------------------------------------------ PyTorch


def torch_model(seed: int, attention: str, model: dict = MODEL):
    import torch
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(seed)
    config = DiffLlamaConfig(**model)
    config._attn_implementation = attention
    return DiffLlamaForCausalLM(config).train()


class TorchRunner:
    """transformers' DiffLlama and torch.optim.AdamW, eager; the same clipping and weight-decay mask as diffjax."""

    name = "pytorch"

    def __init__(self, model, tokens):
        import torch

        self.torch, self.model = torch, model
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        no_decay = [p for n, p in model.named_parameters() if "norm" in n or "lambda" in n]
        decay = [p for n, p in model.named_parameters() if not ("norm" in n or "lambda" in n)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": OPTIM["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=OPTIM["lr"], betas=(OPTIM["b1"], OPTIM["b2"]), eps=OPTIM["eps"])

    def step(self) -> float:
        torch = self.torch
        logits = self.model(self.tokens).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 self.tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPTIM["clip_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


# ------------------------------------------------------------------------------------------------ diffjax


class JaxRunner:
    """diffjax's jitted train step (the trainer's) on the converted weights, in one layout."""

    def __init__(self, name: str, model, scan_layers: bool, tokens, compiler_options: dict | None = None):
        import jax
        import numpy as np
        from flax import nnx

        from diffjax.train.mesh import ParallelConfig, make_mesh
        from diffjax.train.optimizer import OptimizerConfig, make_optimizer
        from diffjax.train.step import fresh_state, sharded_init

        self.name, self.jax = name, jax
        config = model.config.replace(scan_layers=scan_layers)
        optim = OptimizerConfig(lr=OPTIM["lr"], warmup_steps=0, decay="constant", min_lr=OPTIM["lr"], b1=OPTIM["b1"],
                                b2=OPTIM["b2"], eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"],
                                clip_norm=OPTIM["clip_norm"])
        tx, schedule = make_optimizer(optim, 1000, config)
        mesh = make_mesh(ParallelConfig(data=1), jax.devices()[:1])
        training, _ = sharded_init(config, tx, mesh)
        params = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))  # own buffers: donated
        self.state = jax.device_put(fresh_state(params, tx, jax.random.key(0)), training.state_shardings)
        batch = {"tokens": tokens[None], "positions": np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32),
                                                                      tokens.shape)[None]}
        self.batch = jax.device_put(batch, training.step_batch_sharding)
        step = training.jit_train_step(tx, schedule, config, loss_chunk=0)
        start = time.perf_counter()
        lowered = step.lower(self.state, self.batch)
        self.lower_s = time.perf_counter() - start
        start = time.perf_counter()
        self.compiled = lowered.compile(compiler_options=compiler_options)
        self.compile_s = time.perf_counter() - start

    def step(self) -> float:
        self.state, metrics = self.compiled(self.state, self.batch)
        return float(self.jax.block_until_ready(metrics["loss"]))


# ------------------------------------------------------------------------------------------------ measuring


def busy_loop():  # --busy: a process that only burns a core
    while True:
        pass


def timed(runner) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process's threads, loss) of one step."""
    start, cpu = time.perf_counter(), time.process_time()
    loss = runner.step()
    return time.perf_counter() - start, time.process_time() - cpu, loss


def check_losses(losses: dict[str, list[float]]) -> list[str]:
    """Each diffjax runner's first two losses against PyTorch's: problems (empty: agree to LOSS_RTOL)."""
    reference = losses["pytorch"]
    problems = []
    for name, values in losses.items():
        for i, (ours, theirs) in enumerate(zip(values, reference)):
            if abs(ours - theirs) > LOSS_RTOL * abs(theirs):
                problems.append(f"{name} step {i + 1}: loss {ours:.7f} vs PyTorch {theirs:.7f} "
                                f"(relative {abs(ours - theirs) / abs(theirs):.1e} > {LOSS_RTOL:g})")
    return problems


def measure(runners: list, warmup: int, repeats: int) -> dict:
    """Warm-up (the first two steps' losses compared), then `repeats` rounds of one timed step per runner."""
    losses = {r.name: [] for r in runners}
    first_step_s = {}
    for i in range(max(warmup, 2)):
        for r in runners:
            seconds, _, loss = timed(r)
            losses[r.name].append(loss)
            first_step_s.setdefault(r.name, seconds)
    problems = check_losses({name: values[:2] for name, values in losses.items()})
    if problems:
        raise SystemExit("peers.py: the frameworks disagree:\n  " + "\n  ".join(problems))
    times, cpu_times = {r.name: [] for r in runners}, {r.name: [] for r in runners}
    loads = [os.getloadavg()[0]]
    for round_ in range(repeats):
        order = runners[round_ % len(runners):] + runners[:round_ % len(runners)]
        for r in order:
            wall, cpu, _ = timed(r)
            times[r.name].append(wall)
            cpu_times[r.name].append(cpu)
        loads.append(os.getloadavg()[0])
    return {"losses": losses, "first_step_s": first_step_s, "times_s": times, "cpu_s": cpu_times, "load_1min": loads}


def summary(result: dict) -> dict:
    times = result["times_s"]
    rows = {}
    for name, values in times.items():
        ratios = [t / s for t, s in zip(times["pytorch"], values)]  # >1: faster than PyTorch
        rows[name] = {"median_step_s": statistics.median(values), "steps_per_s": 1 / statistics.median(values),
                      "min_step_s": min(values), "ratio_vs_pytorch": statistics.median(ratios),
                      "ratio_of_medians": statistics.median(times["pytorch"]) / statistics.median(values),
                      "median_cpu_s": statistics.median(result["cpu_s"][name])}
    return rows


def thread_settings() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "cores": len(os.sched_getaffinity(0)),
            "torch_intra_op_threads": torch.get_num_threads(),
            "torch_inter_op_threads": torch.get_num_interop_threads(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "xla_threads": "XLA:CPU's default: an intra-op pool of one thread per core it may run on"}


def markdown(out: dict) -> str:
    s = out["settings"]
    lines = [f"## {out['date']}: {out['machine']}, jax {out['jax']}, torch {out['torch']}, transformers "
             f"{out['transformers']}", "",
             f"DiffLlama {out['params'] / 1e6:.1f}M params ({', '.join(f'{k} {v}' for k, v in out['model'].items())}), "
             f"fp32, batch {out['batch']} x {out['seq_len']}, AdamW; PyTorch eager, attention `{out['torch_attention']}`; "
             f"torch threads {s['torch_intra_op_threads']} (inter-op {s['torch_inter_op_threads']}), XLA: "
             f"{s['xla_flags'] or 'default flags'}, a thread per core ({s['cores']} of {s['cpu_count']} CPUs); busy processes beside it: {out['busy']}. "
             f"Load average (1 min) over the timed rounds: {min(out['load_1min']):.2f} - {max(out['load_1min']):.2f}.",
             "", "First losses: " + ", ".join(f"{name} {v[0]:.7f}" for name, v in out["losses"].items())
             + f" (agree to {LOSS_RTOL:g}; second step too).", "",
             "| runner | steps/s | median step s | min step s | ratio vs PyTorch | CPU s / step | lower + compile s "
             "| first step s |", "|---|---|---|---|---|---|---|---|"]
    for name, row in out["rows"].items():
        compile_s = out["compile_s"].get(name)
        lines.append(f"| {name} | {row['steps_per_s']:.3f} | {row['median_step_s']:.3f} | {row['min_step_s']:.3f} | "
                     f"{row['ratio_vs_pytorch']:.3f} | {row['median_cpu_s']:.2f} | {'' if compile_s is None else f'{compile_s:.1f}'} | "
                     f"{out['first_step_s'][name]:.2f} |")
    if "startup" in out:
        tiny, figures = out["startup"]["diffjax_train_tiny"], out["startup"]
        lines += ["", f"Start-up: `diffjax-train` (config tiny, one step) reached its first step {tiny['first_step_s']:.1f} s "
                  f"after the process started (exit at {tiny['process_s']:.1f} s, with checkpoint, eval and sample); "
                  "train step lower + compile alone: " + "; ".join(
                      f"{f['config']} ({f['params'] / 1e6:,.1f}M params, micro-batch {f['micro_batch']} x {f['seq_len']}) "
                      f"{f['lower_compile_s']:.1f} s" for key, f in figures.items() if key != "diffjax_train_tiny") + "."]
    lines += ["", f"Ratio: PyTorch's step time / the runner's, the median over {out['repeats']} rounds (>1: faster "
              "than PyTorch). Idle-core figures must be re-run when the machine is quiet (`python "
              "benchmarks/peers.py`); on a shared machine only the same-run ratios mean anything."]
    return "\n".join(lines) + "\n"


def time_to_first_step(directory: Path) -> dict:
    """`diffjax-train` (train.py) with the shipped config tiny, for one step into a scratch run directory: seconds
    from the process's start to its first step's log line (imports, data, init, compiles, the step) and to its exit
    (checkpoint, final eval and sample too)."""
    command = [sys.executable, str(REPO / "train.py"), f"train.run_dir={directory / 'tiny'}", "train.steps=1",
               "train.log_every=1"]
    start, first = time.perf_counter(), None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=directory,
                          env=env) as process:
        for line in process.stdout:
            if first is None and re.match(r"\s*step\s+1/1\b", line):
                first = time.perf_counter() - start
    if process.returncode:
        raise SystemExit(f"peers.py: {' '.join(command)} exited {process.returncode}")
    return {"first_step_s": first, "process_s": time.perf_counter() - start}


def step_compile_s(config_name: str, micro_batch: int) -> dict:
    """Lower + compile of a shipped config's train step on this CPU (abstract state: nothing allocated), at
    `micro_batch` x the config's data.seq_len, as the trainer builds it."""
    from train_step import Bench

    from diffjax.train.config import load_run_config

    config = load_run_config(config_name)
    start = time.perf_counter()
    _, figures = Bench(config.model, config.train.loss_chunk).compile(micro_batch, config.data.seq_len)
    return {"config": config_name, "micro_batch": micro_batch, "seq_len": config.data.seq_len,
            "lower_compile_s": time.perf_counter() - start, "params": config.model.param_count()}


def startup() -> dict:
    """Compile time and time to the first step: diffjax-train tiny end to end, tiny's and paper/diff-1.4b's step."""
    with tempfile.TemporaryDirectory() as directory:
        figures = {"diffjax_train_tiny": time_to_first_step(Path(directory))}
    for name, micro_batch in (("tiny", 16), ("paper/diff-1.4b", 1)):
        figures[name] = step_compile_s(name, micro_batch)
    return figures


def profile(runners: list, directory: Path) -> None:
    """A jax trace of 2 steps of each diffjax runner (reduced with profile_table.py) and torch.profiler's table."""
    import jax
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import profile_table

    for r in runners:
        if r.name == "pytorch":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    r.step()
            (directory / "torch_profile.txt").write_text(
                prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
            continue
        layout = r.name.split()[-1]
        trace, hlo = directory / f"trace_{layout}", directory / f"hlo_{layout}.txt"
        hlo.write_text(r.compiled.as_text())  # XLA's optimized HLO of the step
        with jax.profiler.trace(str(trace)):
            for _ in range(2):
                r.step()
        profile_table.main([str(trace), "--hlo", str(hlo), "--steps", "2", "--top", "40", "--by-source", "--title",
                            f"{r.name}: the CPU step", "--out", str(directory / f"profile_{layout}.json")])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, batch 2 x 32: the path in seconds")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (one step of each runner per round)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each runner first (at least 2)")
    parser.add_argument("--layouts", default="unrolled,scanned", help="comma-separated: unrolled, scanned")
    parser.add_argument("--torch-attention", default="sdpa", choices=("sdpa", "eager"),
                        help="transformers' attention implementation (sdpa: its default)")
    parser.add_argument("--cores", type=int,
                        help="run on the first N CPUs only (affinity set before either framework starts: both size "
                             "their thread pools to it)")
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes to run beside the timing")
    parser.add_argument("--skip-startup", action="store_true",
                        help="leave out diffjax-train tiny's time to its first step and the steps' compile times")
    parser.add_argument("--profile", type=Path, help="also dump XLA's HLO and profile both frameworks into DIR")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON path; the markdown beside it (peers.md)")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts: unknown {sorted(unknown)}; allowed: {', '.join(LAYOUTS)}")
    if args.cores:  # before jax and torch start their thread pools
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    import jax
    import numpy as np
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    import diffjax

    if args.cores:
        torch.set_num_threads(args.cores)
    model, batch, seq_len = (TINY["model"], TINY["batch"], TINY["seq_len"]) if args.tiny else (MODEL, BATCH, SEQ_LEN)
    hf = torch_model(0, args.torch_attention, model)
    params = sum(p.numel() for p in hf.parameters())
    tokens = np.random.default_rng(0).integers(0, model["vocab_size"], (batch, seq_len), dtype=np.int32)
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        converted = diffjax.load_hf(directory)
    runners = [TorchRunner(hf, tokens)]
    for layout in layouts:
        runners.append(JaxRunner(f"diffjax {layout}", converted, LAYOUTS[layout], tokens))
        print(f"{runners[-1].name}: lower {runners[-1].lower_s:.1f} s, compile {runners[-1].compile_s:.1f} s",
              flush=True)
    busy = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    try:
        result = measure(runners, args.warmup, args.repeats)
    finally:
        for process in busy:
            process.terminate()
    out = {"date": datetime.date.today().isoformat(), "machine": f"{py_platform.machine()} {os.cpu_count()} CPUs",
           "python": py_platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
           "transformers": transformers.__version__, "model": model, "params": params, "batch": batch,
           "seq_len": seq_len, "optim": OPTIM, "torch_attention": args.torch_attention, "busy": args.busy,
           "repeats": args.repeats, "settings": thread_settings(),
           "compile_s": {r.name: r.lower_s + r.compile_s for r in runners if r.name != "pytorch"},
           **result, "rows": summary(result)}
    if not args.skip_startup:
        out["startup"] = startup()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    args.out.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))
    if args.profile:
        profile(runners, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
