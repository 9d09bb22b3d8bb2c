"""Sliding-window attention: does its cost grow as T x W rather than T^2?

    python benchmarks/sliding_window.py                      # W = 512, T = 2048 .. 16384, the XLA path on this device
    python benchmarks/sliding_window.py --window 1024 --impl pallas_tpu --seq-lens 8192,32768   # on a TPU

For each T: the attention FLOPs the kernels run (the blocks they do not skip, counted from the same skip rule the
kernels use, x 2 matmuls x 2 FLOPs per multiply-add x block area x d, summed over the maps: DIFF V1 at the
paper's 3B head shape), as a ratio to causal attention without a window; and the measured time of one
forward + backward of `diffjax.ops.diff_attention` (impl as given; "xla" attends blockwise and skips the blocks
outside the window) with and without the window, timed in the same run, as a ratio. The FLOP ratio should fall
as ~2W / T; the time ratio follows it where attention dominates.

Writes benchmarks/results/sliding_window_<platform>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform as py_platform
import time
from pathlib import Path


def blocks_run(T: int, window: int | None, block: int) -> int:
    """(q block, kv block) pairs the kernels run: the Pallas TPU kernel's skip rule at square blocks."""
    from diffjax.ops import pallas_tpu

    st = pallas_tpu._Static(M=1, G=1, R=1, T=T, S=T, bq=block, bk=block, causal=True, window=window, scale=1.0,
                            has_seg=False, has_lam=False, interpret=True)
    n = -(-T // block)
    return sum(bool(pallas_tpu._block_needed(st, i, j, 0)) for i in range(n) for j in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--seq-lens", default="2048,4096,8192,16384")
    parser.add_argument("--impl", default="xla")
    parser.add_argument("--heads", type=int, default=2, help="differential heads (the 3B config has 12; 2 keeps a CPU run short)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=512, help="key block of the skip count (the XLA path's)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from diffjax import ops

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    H, d, W = args.heads, args.head_dim, args.window
    rows = []
    for T in map(int, args.seq_lens.split(",")):
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (1, T, H, 2, d), dtype)
        k = jax.random.normal(keys[1], (1, T, H, 2, d), dtype)
        v = jax.random.normal(keys[2], (1, T, H, 2 * d), dtype)

        def step(window):
            loss = lambda q, k, v: ops.diff_attention(q, k, v, 0.5, impl=args.impl, window=window).astype(jnp.float32).sum()  # noqa: E731
            return jax.jit(jax.grad(loss, (0, 1, 2)))

        seconds = {}
        for name, window in (("causal", None), ("window", W)):
            f = step(window)
            jax.block_until_ready(f(q, k, v))  # compile
            start = time.perf_counter()
            for _ in range(args.repeats):
                jax.block_until_ready(f(q, k, v))
            seconds[name] = (time.perf_counter() - start) / args.repeats
        flops = {name: blocks_run(T, window, args.block) for name, window in (("causal", None), ("window", W))}
        row = dict(seq_len=T, window=W, blocks_causal=flops["causal"], blocks_window=flops["window"],
                   flop_ratio=flops["window"] / flops["causal"], seconds_causal=seconds["causal"],
                   seconds_window=seconds["window"], time_ratio=seconds["window"] / seconds["causal"])
        rows.append(row)
        print(f"T={T:6d} W={W}: attention FLOPs window / causal {row['flop_ratio']:.3f} (blocks {flops['window']} / "
              f"{flops['causal']}); fwd+bwd {seconds['window'] * 1e3:8.1f} ms / {seconds['causal'] * 1e3:8.1f} ms = "
              f"{row['time_ratio']:.3f}", flush=True)
    device = jax.devices()[0]
    out = Path(__file__).parent / "results" / f"sliding_window_{jax.default_backend()}.json"
    out.write_text(json.dumps(dict(
        date=datetime.date.today().isoformat(), device=device.device_kind, platform=jax.default_backend(),
        jax=jax.__version__, host=py_platform.node(), impl=args.impl, heads=H, head_dim=d, dtype=jnp.dtype(dtype).name,
        flop_convention="blocks run x block^2 x (4 d + 4 dv) per map pair: both maps' q k^T and P V, 2 FLOPs per "
                        "multiply-add; the ratio is independent of the per-block constant",
        rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
