"""Generation speed with the KV cache: decode tokens/s, and a decode step against a full forward pass.

    python benchmarks/generate.py                      # configs/tiny.yaml's model, batch 1 and 16, 32 + 128 tokens
    python benchmarks/generate.py --batches 1,4 --prompt-len 64 --new-tokens 64 --config configs/paper/diff-830m.yaml

For each batch size: the jitted prefill over random prompts, then --new-tokens - 1 jitted decode steps
(greedy), timed after a warm-up run that compiles both; decode tokens/s = batch x steps / decode time. The
ratio is one decode step's time over one jitted forward pass of the model over [batch, prompt + new
tokens] (the cache's length): what generating a token cost before the cache (re-running the window),
measured the same way. Random weights (speed does not depend on them). Writes
benchmarks/results/generate_<platform>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform as py_platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffjax.generate import decode  # noqa: E402
from diffjax.model import TransformerLM  # noqa: E402
from diffjax.train.config import load_run_config  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(model: TransformerLM, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    prompts = np.random.RandomState(0).randint(0, model.config.vocab_size, (batch, prompt_len)).astype(np.int32)
    lengths = np.full((batch,), prompt_len, np.int32)
    max_len, key, choice = prompt_len + new_tokens, jax.random.key(0), decode.Choice(decode.Sampling(), (), 0)

    def prefill():
        return decode._prefill(graphdef, params, prompts, lengths, key, max_len=max_len, max_new_tokens=new_tokens,
                               choice=choice, mesh=None)

    def decode_all(state):
        for _ in range(new_tokens - 1):
            state = decode._decode_step(graphdef, params, state, key, choice=choice, mesh=None)
        return state

    jax.block_until_ready(decode_all(prefill()))  # compiles both
    prefill_s = median_seconds(prefill, repeats)
    decode_times = []
    for _ in range(repeats):
        state = jax.block_until_ready(prefill())
        start = time.perf_counter()
        jax.block_until_ready(decode_all(state))
        decode_times.append(time.perf_counter() - start)
    decode_s = float(np.median(decode_times))
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    sequences = np.random.RandomState(1).randint(0, model.config.vocab_size, (batch, max_len)).astype(np.int32)
    jax.block_until_ready(forward(params, sequences))
    forward_s = median_seconds(lambda: forward(params, sequences), max(repeats, 5))
    step_s = decode_s / (new_tokens - 1)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "prefill_s": prefill_s,
            "decode_step_s": step_s, "decode_tokens_per_s": batch / step_s, "full_forward_s": forward_s,
            "step_over_forward": step_s / forward_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                        help="a run config whose model section is measured (default configs/tiny.yaml)")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is reported")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = load_run_config(args.config).model
    model = nnx.jit(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))()
    platform = jax.devices()[0].platform
    print(f"{platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}: {args.config.name} model "
          f"({config.attention}, d_model {config.d_model}, {config.num_layers} layers, {model.num_params() / 1e6:.2f}M params, "
          f"{config.dtype}), prompt {args.prompt_len} + {args.new_tokens} new tokens, greedy")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = measure(model, batch, args.prompt_len, args.new_tokens, args.repeats)
        rows.append(row)
        print(f"  batch {batch:>3}: decode {row['decode_tokens_per_s']:9.1f} tokens/s ({row['decode_step_s'] * 1e3:7.2f} ms/step)"
              f"  prefill {row['prefill_s'] * 1e3:7.1f} ms  full forward over {args.prompt_len + args.new_tokens} tokens "
              f"{row['full_forward_s'] * 1e3:7.2f} ms  step / forward {row['step_over_forward']:.3f}", flush=True)
    out = args.out or Path(__file__).resolve().parent / "results" / f"generate_{platform}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": jax.devices()[0].device_kind, "platform": platform, "jax": jax.__version__,
        "python": py_platform.python_version(), "date": datetime.date.today().isoformat(),
        "config": str(args.config.name), "model": config.to_dict(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
