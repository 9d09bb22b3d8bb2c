"""Tuning sweep for impl="pallas_gpu" on a Hopper GPU: each Tuning's forward and forward+backward at
one shape against cuDNN standard attention (2H heads of d, the equal-parameter baseline) and the
two-call cuDNN composition, measured in the same run.

    python benchmarks/pallas_gpu_sweep.py [--T 8192] [--d 128] [--dv 256] [--out results/sweep.json]

FLOP convention as benchmarks/attention.py (nominal; causal halves; fwd+bwd = 3.5 x fwd).
A Tuning that does not fit or fails to compile is reported as an error row, not a crash.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import flops_baseline, flops_diff, fwd_bwd, time_fn  # noqa: E402

from diffjax import ops  # noqa: E402
from diffjax.ops.pallas_gpu import default_tuning  # noqa: E402


def candidates(d, dv, dtype):
    base = default_tuning(d, dv, 2, dtype)
    out = [base, base._replace(pingpong=False)]
    for field in ("block_k", "block_k_dq", "block_q_bwd"):
        for size in (64, 128):
            if getattr(base, field) != size:
                out.append(base._replace(**{field: size}))
    out.append(base._replace(stages=3, block_k=64, block_k_dq=64, block_q_bwd=64))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--dv", type=int, default=256)
    parser.add_argument("--H", type=int, default=8)
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    T, d, dv, H, causal = args.T, args.d, args.dv, args.H, not args.non_causal
    B = max(1, 16384 // T)
    bf = jnp.bfloat16
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(ks[0], (B, T, H, 2, d), bf)
    k = jax.random.normal(ks[1], (B, T, H, 2, d), bf)
    v = jax.random.normal(ks[2], (B, T, H, dv), bf)
    lam = jnp.full((B, T, H), 0.5, jnp.float32)
    qb, kb, vb = (jax.random.normal(ks[3 + i], (B, T, 2 * H, d), bf) for i in range(3))
    diff_flops = flops_diff(B, H, T, T, causal, d, dv)
    base_flops = flops_baseline(B, H, T, T, causal, d)

    def two_call(q, k, v, lam):
        o1 = ops.dot_product_attention(q[:, :, :, 0], k[:, :, :, 0], v, causal=causal, impl="cudnn")
        o2 = ops.dot_product_attention(q[:, :, :, 1], k[:, :, :, 1], v, causal=causal, impl="cudnn")
        return o1 - lam[..., None].astype(o1.dtype) * o2

    def base(q, k, v):
        return ops.dot_product_attention(q, k, v, causal=causal, impl="cudnn")

    ref = {}
    for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        b_fn = jax.jit(base) if mode == "fwd" else fwd_bwd(base, 3)
        t_fn = jax.jit(two_call) if mode == "fwd" else fwd_bwd(two_call, 4)
        ref[mode] = {"cudnn_s": time_fn(b_fn, (qb, kb, vb), 2, 10), "two_call_s": time_fn(t_fn, (q, k, v, lam), 2, 10)}
        ref[mode]["cudnn_tflops"] = mult * base_flops / ref[mode]["cudnn_s"] / 1e12
    print(f"{jax.devices()[0].device_kind}, T={T} B={B} H={H} d={d} dv={dv} causal={causal} bf16")
    for mode in ref:
        print(f"  cuDNN standard {mode}: {ref[mode]['cudnn_tflops']:.0f} TFLOP/s; two-call cuDNN {1e3 * ref[mode]['two_call_s']:.2f} ms")
    rows = []
    print(f"{'tuning':<72} {'mode':>8} {'ms':>8} {'TFLOP/s':>8} {'vs cuDNN':>9} {'vs 2call':>9}")
    for tuning in candidates(d, dv, bf):
        for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            def diff(q, k, v, lam, tuning=tuning):
                return ops.diff_attention(q, k, v, lam, causal=causal, impl="pallas_gpu", block_sizes=tuning)

            row = {"tuning": tuning._asdict(), "mode": mode}
            try:
                fn = jax.jit(diff) if mode == "fwd" else fwd_bwd(diff, 4)
                row["s"] = time_fn(fn, (q, k, v, lam), 2, 10)
            except Exception as e:  # noqa: BLE001 (a config that does not fit is a result)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"{str(tuning):<72} {mode:>8} error {row['error'][:60]}")
                rows.append(row)
                continue
            row["tflops"] = mult * diff_flops / row["s"] / 1e12
            row["tflops_vs_cudnn"] = row["tflops"] / ref[mode]["cudnn_tflops"]
            row["speedup_vs_two_call"] = ref[mode]["two_call_s"] / row["s"]
            rows.append(row)
            print(f"{str(tuning):<72} {mode:>8} {1e3 * row['s']:>8.2f} {row['tflops']:>8.0f} {row['tflops_vs_cudnn']:>9.2f} {row['speedup_vs_two_call']:>9.2f}")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "T": T, "B": B, "H": H, "d": d, "dv": dv,
              "causal": causal, "reference": ref, "rows": rows,
              "flop_convention": "nominal: diff fwd = B*H*2*(2*T*S*d + 2*T*S*dv), cuDNN baseline fwd = B*2H*4*T*S*d; causal halves; fwd+bwd = 3.5 x fwd"}
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"pallas_gpu_sweep_T{T}_d{d}_dv{dv}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
