"""Differential attention kernels side by side, on whatever device is present.

    python benchmarks/attention.py            # GPU/TPU: T in 2k..16k;  CPU: T in 256..1024
    python benchmarks/attention.py --quick    # fewer lengths and repeats

For every available impl (cpu: xla, pallas_tpu in interpret mode for small T; gpu: xla, cudnn,
triton, pallas_gpu, mgpu; tpu: xla, pallas_tpu, splash), d = 128, dv = 256, bfloat16, causal and not, forward and
forward+backward:

  diff      ops.diff_attention (H differential heads)
  baseline  ops.dot_product_attention, 2H heads of width d (dv = d): the paper's equal-parameter
            Transformer, same impl family (flash vs flash)
  two-call  two ops.dot_product_attention calls with dv = 2d (one per map) and o1 - lam o2: what
            diff costs without a fused kernel
  mgpu: jax's own Mosaic GPU flash attention (jax.experimental.pallas.ops.gpu.attention_mgpu), baseline rows
  only: the single-map peer of cuDNN and pallas_gpu's single-map mode, in float16 (its shared-memory buffers
  are float16 whatever the inputs, jax 0.10-0.11: bf16 inputs fail to lower; fp16 and bf16 have the same Hopper
  tensor-core rate); its causal backward is not implemented upstream (a "skipped" row), nor is it run where jax
  lacks the module or no GPU runs (one "skipped" line).
  (pallas_gpu's baseline rows run its single-map mode; its two-call rows run cudnn: their dv = 2d,
  256 at d 128, is past the single-map mode's 192. Targets, against the cudnn rows of the same run: diff fwd TFLOP/s
  >= 1.1x the cuDNN baseline's, fwd+bwd >= 1.0x, and >= 1.3x faster than two-call cuDNN)

FLOP convention (nominal, FlashAttention-style): a matmul (m x k)(k x n) is 2mkn.
  diff forward     = B H (2 maps) (2 T S d + 2 T S dv) = 12 B H T S d for dv = 2d
  baseline forward = B (2H) (2 T S d + 2 T S d)        =  8 B H T S d
  causal halves both; backward = 2.5 x forward; forward+backward = 3.5 x forward.
Ratios are wall-time ratios measured in this run (time(diff) / time(other)); > 1 means diff is slower.

Memory: compiled temp bytes of forward+backward per impl and T (memory_analysis of the compiled
executable), extrapolated to where xla's T x S scores exceed a stated device-memory budget; on a GPU
also a real out-of-memory probe of xla at growing T.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform as py_platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffjax import ops  # noqa: E402

D, DV = 128, 256


def impls_for(platform: str) -> list[str]:
    return {"cpu": ["xla", "pallas_tpu"], "gpu": ["xla", "cudnn", "triton", "pallas_gpu", "mgpu"], "tpu": ["xla", "pallas_tpu", "splash"]}.get(platform, ["xla"])


def flops_diff(B, H, T, S, causal, d=D, dv=DV):
    f = B * H * 2 * (2 * T * S * d + 2 * T * S * dv)
    return f / 2 if causal else f


def flops_baseline(B, H, T, S, causal, d=D):
    f = B * (2 * H) * (2 * T * S * d + 2 * T * S * d)
    return f / 2 if causal else f


def fwd_bwd(fn, nargs):
    """jitted gradient of sum(fn(...)) with respect to its first nargs arguments."""

    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=tuple(range(nargs))))


def make_fns(impl, causal, B, T, H):
    """jitted forward and forward+backward callables plus their inputs for diff, baseline, two-call."""
    key = jax.random.PRNGKey(0)
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (B, T, H, 2, D), bf)
    k = jax.random.normal(ks[1], (B, T, H, 2, D), bf)
    v = jax.random.normal(ks[2], (B, T, H, DV), bf)
    lam = jnp.full((B, T, H), 0.5, jnp.float32)
    qb = jax.random.normal(ks[3], (B, T, 2 * H, D), bf)
    kb = jax.random.normal(ks[4], (B, T, 2 * H, D), bf)
    vb = jax.random.normal(ks[5], (B, T, 2 * H, D), bf)

    def diff(q, k, v, lam):
        return ops.diff_attention(q, k, v, lam, causal=causal, impl=impl)

    two_call_impl = "cudnn" if impl == "pallas_gpu" else impl  # dv = 2d: past the single-map mode's 192 at d 128

    def baseline(q, k, v):
        return ops.dot_product_attention(q, k, v, causal=causal, impl=impl)

    def two_call(q, k, v, lam):
        o1 = ops.dot_product_attention(q[:, :, :, 0], k[:, :, :, 0], v, causal=causal, impl=two_call_impl)
        o2 = ops.dot_product_attention(q[:, :, :, 1], k[:, :, :, 1], v, causal=causal, impl=two_call_impl)
        return o1 - lam[..., None].astype(o1.dtype) * o2

    variants = {
        "diff": (diff, (q, k, v, lam)),
        "baseline": (baseline, (qb, kb, vb)),
        "two-call": (two_call, (q, k, v, lam)),
    }
    out = {}
    for name, (fn, args) in variants.items():
        out[name, "fwd"] = (jax.jit(fn), args)
        out[name, "fwd+bwd"] = (fwd_bwd(fn, 3 if name == "baseline" else 4), args)
    return out


def mgpu_module():
    """(jax's Mosaic GPU flash attention module, None) or (None, the one line why impl "mgpu" cannot run here)."""
    if jax.default_backend() != "gpu":
        return None, f"mgpu: skipped: jax's Mosaic GPU attention needs a GPU (running on {jax.default_backend()})"
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except ImportError as e:
        return None, f"mgpu: skipped: jax {jax.__version__} has no pallas.ops.gpu.attention_mgpu ({e})"
    return attention_mgpu, None


MGPU_DTYPE = jnp.float16  # attention_mgpu stages q, k, v in float16 shared memory (jax 0.10-0.11): bf16 cannot load


def mgpu_fns(module, causal, B, T, H):
    """The single-map peer: jax's attention_mgpu on the baseline's shapes (2H heads of D) in MGPU_DTYPE, forward
    and forward+backward (the causal backward raises NotImplementedError upstream: a "skipped" row)."""
    config = module.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
                                 block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    args = tuple(jax.random.normal(key, (B, T, 2 * H, D), MGPU_DTYPE) for key in ks)

    def attend(q, k, v):
        return module.attention(q, k, v, config)

    return {"fwd": (jax.jit(attend), args), "fwd+bwd": (fwd_bwd(attend, 3), args)}


def time_mgpu(module, rec: dict, warmup: int, repeats: int) -> dict:
    """rec (T, causal, pass) with the single-map peer's time and TFLOP/s (the baseline columns)."""
    T, causal, mode, B, H = rec["T"], rec["causal"], rec["pass"], rec["B"], rec["H"]
    rec["dtype"] = jnp.dtype(MGPU_DTYPE).name
    try:
        fn, fargs = mgpu_fns(module, causal, B, T, H)[mode]
        rec["baseline_s"] = time_fn(fn, fargs, warmup, repeats)
    except Exception as e:  # noqa: BLE001 (an upstream failure is a result row, not the end of the run)
        key = "skipped" if isinstance(e, NotImplementedError) else "error"  # the causal backward (jax 0.10-0.11)
        rec[key] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"{'mgpu':<11}{T:>6} {str(causal):>6} {mode:>8} | {key} {rec[key][:80]}")
        return rec
    rec["baseline_tflops"] = (1.0 if mode == "fwd" else 3.5) * flops_baseline(B, H, T, T, causal) / rec["baseline_s"] / 1e12
    print(f"{'mgpu':<11}{T:>6} {str(causal):>6} {mode:>8} | {'':>9} {'':>8} | {1e3 * rec['baseline_s']:>9.2f} "
          f"{rec['baseline_tflops']:>8.3f} |   (jax's Mosaic GPU flash attention, single map, {rec['dtype']})")
    return rec


def time_fn(fn, args, warmup, repeats):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def temp_bytes(fn, args):
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def memory_section(platform, impls, lengths, budget_bytes, B, H):
    """Compiled temp bytes of diff fwd+bwd per impl and T (compile only, no run)."""
    rows = []
    for T in lengths:
        args = (
            jax.ShapeDtypeStruct((B, T, H, 2, D), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, H, 2, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, T, H, DV), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, H), jnp.float32),
        )
        row = {"T": T}
        for impl in impls:
            def loss(q, k, v, lam, impl=impl):
                return jnp.sum(ops.diff_attention(q, k, v, lam, causal=True, impl=impl).astype(jnp.float32))

            try:
                row[impl] = temp_bytes(jax.grad(loss, argnums=(0, 1, 2, 3)), args)
            except Exception as e:  # noqa: BLE001 (a compile-time OOM is a result)
                row[impl] = f"error: {type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
    # Extrapolate: xla temp ~ a T^2 + b T, fused ~ c T; first T (doubling) over the budget.
    verdict = {}
    for impl in impls:
        pts = [(r["T"], r[impl]) for r in rows if isinstance(r.get(impl), int)]
        if len(pts) < 2:
            continue
        (t1, m1), (t2, m2) = pts[-2], pts[-1]
        exponent = math.log(m2 / m1) / math.log(t2 / t1) if m1 > 0 and m2 > 0 else float("nan")
        T, m = t2, m2
        while m < budget_bytes and T < 2**24:
            T *= 2
            m *= 2**exponent
        verdict[impl] = {"growth_exponent": exponent, "first_T_over_budget": T if m >= budget_bytes else None}
    return {"budget_bytes": budget_bytes, "batch": B, "heads": H, "rows": rows, "extrapolation": verdict}


def oom_probe(impl, lengths, B, H):
    """GPU: run diff fwd+bwd at growing T until a real RESOURCE_EXHAUSTED."""
    results = []
    for T in lengths:
        fns = make_fns(impl, True, B, T, H)
        fn, args = fns["diff", "fwd+bwd"]
        try:
            jax.block_until_ready(fn(*args))
            results.append({"T": T, "ok": True})
        except Exception as e:  # noqa: BLE001
            results.append({"T": T, "ok": False, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            break
    return results


def kernel_targets(records, T=8192):
    """The fused GPU kernel against cuDNN in the same run (causal, T = 8192): diff TFLOP/s >= 1.1x the
    cuDNN baseline's forward and >= 1.0x forward+backward, and >= 1.3x faster than two-call cuDNN."""
    def rows(impl):
        return {r["pass"]: r for r in records if r["impl"] == impl and r["T"] == T and r["causal"] and "diff_s" in r}

    fused, cudnn = rows("pallas_gpu"), rows("cudnn")
    peer = {r["pass"]: r for r in records if r["impl"] == "mgpu" and r["T"] == T and r["causal"] and "baseline_s" in r}
    out = {"lines": []}
    for mode, need in (("fwd", 1.1), ("fwd+bwd", 1.0)):
        if mode in fused and mode in cudnn:
            r, c = fused[mode], cudnn[mode]
            ratio = r["diff_tflops"] / c["baseline_tflops"]
            speedup = r["two-call_s"] / r["diff_s"]
            out[mode] = {"tflops_ratio_vs_cudnn": ratio, "need": need, "speedup_vs_two_call": speedup, "need_speedup": 1.3,
                         "single_map_over_cudnn_baseline": r["baseline_tflops"] / c["baseline_tflops"]}
            out["lines"].append(
                f"{mode:>8}: {r['diff_tflops']:.0f} vs cuDNN baseline {c['baseline_tflops']:.0f} TFLOP/s = {ratio:.2f}x "
                f"(target >= {need}), {speedup:.2f}x faster than two-call cuDNN (target >= 1.3); single-map mode "
                f"{r['baseline_tflops']:.0f} TFLOP/s"
                + (f" (jax's Mosaic GPU attention {peer[mode]['baseline_tflops']:.0f})" if mode in peer else "")
            )
    return out if out["lines"] else None


def route_table(paths) -> dict:
    """diffjax.ops.choice.HOPPER_MS from result files of this benchmark on Hopper GPUs: per (op, d, dv, causal) and
    pass, each impl's milliseconds at T = 8192, the mean over the files (diff rows: diff_attention; baseline rows:
    dot_product_attention, dv = d), rounded to 0.01 ms. Rows with an error or run interpreted are left out."""
    from diffjax.hardware import HOPPER_KINDS

    times: dict = {}
    for path in paths:
        content = json.loads(Path(path).read_text())
        if not any(kind in content["device"]["kind"] for kind in HOPPER_KINDS):
            raise ValueError(f"{path}: measured on {content['device']['kind']}, not a Hopper GPU ({HOPPER_KINDS})")
        for r in content["records"]:
            if r.get("error") or r.get("interpret") or r["T"] != 8192:
                continue
            for op, dv, key in (("diff_attention", r["dv"], "diff_s"), ("dot_product_attention", r["d"], "baseline_s")):
                if key in r:
                    cell = times.setdefault((op, r["d"], dv, r["causal"]), {}).setdefault(r["pass"], {})
                    cell.setdefault(r["impl"], []).append(r[key])
    return {call: {pass_: {impl: round(1e3 * statistics.mean(ts), 2) for impl, ts in sorted(impls.items())}
                   for pass_, impls in sorted(passes.items())} for call, passes in sorted(times.items())}


def run_memory_section(platform, device):
    """Memory against T (compiles per impl and T; on a GPU also real out-of-memory probes)."""
    if platform == "gpu":
        budget = int(device.memory_stats().get("bytes_limit", 80 * 2**30)) if hasattr(device, "memory_stats") and device.memory_stats() else 80 * 2**30
        mem_impls = ["xla", "cudnn", "pallas_gpu"]
        mem_lengths = [4096, 8192, 16384, 32768]
        mem_B, mem_H = 1, 8
    elif platform == "tpu":
        budget, mem_impls, mem_lengths, mem_B, mem_H = 16 * 2**30, ["xla", "pallas_tpu"], [4096, 8192, 16384, 32768], 1, 8
    else:
        budget, mem_impls, mem_lengths, mem_B, mem_H = 16 * 2**30, ["xla", "pallas_tpu"], [1024, 2048, 4096, 8192], 1, 8
    memory = memory_section(platform, mem_impls, mem_lengths, budget, mem_B, mem_H)
    print(f"\npeak compiled temp memory, diff fwd+bwd causal, B={mem_B}, H={mem_H}, bf16 (budget {budget / 2**30:.0f} GiB):")
    for row in memory["rows"]:
        print(f"  T={row['T']:>6}  " + "  ".join(f"{i}: {row[i] / 2**20:9.1f} MiB" if isinstance(row[i], int) else f"{i}: {row[i]}" for i in mem_impls))
    for impl, v in memory["extrapolation"].items():
        print(f"  {impl}: temp ~ T^{v['growth_exponent']:.2f}; first T (doubling) over budget: {v['first_T_over_budget']}")
    if platform == "gpu":
        memory["oom_probe_xla"] = oom_probe("xla", [16384, 32768, 65536, 131072], 1, 8)
        memory["oom_probe_cudnn"] = oom_probe("cudnn", [16384, 32768, 65536, 131072], 1, 8)
        print("  real OOM probe (xla):", memory["oom_probe_xla"])
        print("  real OOM probe (cudnn):", memory["oom_probe_cudnn"])

    return memory


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repeats")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention_<platform>.json)")
    parser.add_argument("--impls", default=None, help="comma-separated subset of impls")
    parser.add_argument("--lengths", default=None, help="comma-separated T values")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory section (compiles and OOM probes)")
    parser.add_argument("--route-table", nargs="+", metavar="JSON", default=None,
                        help="print diffjax.ops.choice.HOPPER_MS from these result files (Hopper runs) and exit")
    return parser.parse_args()


def lengths_for(args, accel: bool) -> list[int]:
    if args.lengths:
        return [int(t) for t in args.lengths.split(",")]
    if accel:
        return [2048, 4096] if args.quick else [2048, 4096, 8192, 16384]
    return [256, 512] if args.quick else [256, 512, 1024]


def time_record(fns, rec: dict, warmup: int, repeats: int) -> dict:
    """rec (one impl, T, causal and pass) with the three variants' times, TFLOP/s and ratios, printed as one row;
    an error (OOM, an unsupported shape) is a result too."""
    impl, T, causal, mode, B, H = rec["impl"], rec["T"], rec["causal"], rec["pass"], rec["B"], rec["H"]
    try:
        for name in ("diff", "baseline", "two-call"):
            fn, fargs = fns[name, mode]
            rec[f"{name}_s"] = time_fn(fn, fargs, warmup, repeats)
    except Exception as e:  # noqa: BLE001 (OOM or an unsupported shape is a result)
        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"{impl:<11}{T:>6} {str(causal):>6} {mode:>8} | error {rec['error'][:80]}")
        return rec
    mult = 1.0 if mode == "fwd" else 3.5
    rec["diff_tflops"] = mult * flops_diff(B, H, T, T, causal) / rec["diff_s"] / 1e12
    rec["baseline_tflops"] = mult * flops_baseline(B, H, T, T, causal) / rec["baseline_s"] / 1e12
    rec["two-call_tflops"] = mult * flops_diff(B, H, T, T, causal) / rec["two-call_s"] / 1e12
    rec["diff_over_baseline"] = rec["diff_s"] / rec["baseline_s"]
    rec["diff_over_two_call"] = rec["diff_s"] / rec["two-call_s"]
    print(
        f"{impl:<11}{T:>6} {str(causal):>6} {mode:>8} | {1e3 * rec['diff_s']:>9.2f} {rec['diff_tflops']:>8.3f} | "
        f"{1e3 * rec['baseline_s']:>9.2f} {rec['baseline_tflops']:>8.3f} | {1e3 * rec['two-call_s']:>9.2f} | "
        f"{rec['diff_over_baseline']:>9.2f} {rec['diff_over_two_call']:>10.2f}"
        + ("   (interpret mode)" if rec["interpret"] else "")
    )
    return rec


def time_section(platform: str, impls: list[str], lengths: list[int], H: int, warmup: int, repeats: int) -> list[dict]:
    """One record per impl, T, causal and pass (time_record's), under a printed header."""
    accel = platform in ("gpu", "tpu")
    interpret_max_T = 512  # pallas kernels off-TPU run interpreted: only small T, figures are not kernel speed
    header = f"{'impl':<11}{'T':>6} {'causal':>6} {'pass':>8} | {'diff ms':>9} {'TFLOP/s':>8} | {'base ms':>9} {'TFLOP/s':>8} | {'2call ms':>9} | {'diff/base':>9} {'diff/2call':>10}"
    print(header)
    print("-" * len(header))
    records = []
    for impl in impls:
        if impl == "mgpu":
            records += mgpu_section(lengths, H, accel, warmup, repeats)
            continue
        interpret = impl in ("pallas_tpu", "splash") and platform != "tpu"
        for T in lengths:
            if interpret and T > interpret_max_T:
                continue
            B = max(1, 16384 // T) if accel else 1
            for causal in (False, True):
                try:
                    fns = make_fns(impl, causal, B, T, H)
                except ValueError as e:
                    print(f"{impl:<11}{T:>6} skipped: {e}")
                    continue
                for mode in ("fwd", "fwd+bwd"):
                    records.append(time_record(fns, {
                        "impl": impl, "T": T, "B": B, "H": H, "d": D, "dv": DV, "causal": causal, "pass": mode,
                        "interpret": interpret}, warmup, repeats))
    return records


def mgpu_section(lengths, H, accel, warmup, repeats) -> list[dict]:
    module, why_not = mgpu_module()
    if module is None:
        print(why_not)
        return []
    return [time_mgpu(module, {"impl": "mgpu", "T": T, "B": max(1, 16384 // T) if accel else 1, "H": H, "d": D, "dv": D,
                               "causal": causal, "pass": mode, "interpret": False}, warmup, repeats)
            for T in lengths for causal in (False, True) for mode in ("fwd", "fwd+bwd")]


def main():
    args = parse_args()
    if args.route_table:
        for call, passes in route_table(args.route_table).items():
            print(f"    {call}: {passes},")
        return
    platform = jax.default_backend()
    device = jax.devices()[0]
    impls = args.impls.split(",") if args.impls else impls_for(platform)
    accel = platform in ("gpu", "tpu")
    lengths = lengths_for(args, accel)
    H = 8 if accel else 2  # diff heads (baseline 2H); GPU: 16k tokens per batch like the FA3 figures
    warmup, repeats = (1, 3) if args.quick else (2, 5)

    print(f"device: {device.device_kind} ({platform}), jax {jax.__version__}, impls {impls}, d={D}, dv={DV}, bf16")
    print("TFLOP/s nominal: diff fwd 12 B H T S d, baseline fwd 8 B H T S d (2H heads of d); causal /2; fwd+bwd 3.5 x fwd")
    records = time_section(platform, impls, lengths, H, warmup, repeats)

    targets = kernel_targets(records)
    if targets:
        print("\npallas_gpu against the issue's targets (T = 8192, causal, d = 128, dv = 256, bf16):")
        for line in targets["lines"]:
            print("  " + line)

    memory = None if args.no_memory else run_memory_section(platform, device)

    result = {
        "device": {"platform": platform, "kind": device.device_kind, "count": jax.device_count()},
        "jax_version": jax.__version__,
        "python": py_platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "bfloat16",
        "quick": args.quick,
        "flop_convention": "nominal; a matmul (m x k)(k x n) = 2mkn; diff fwd = B*H*2*(2*T*S*d + 2*T*S*dv) = 12*B*H*T*S*d "
        "for dv=2d; baseline fwd = B*2H*(4*T*S*d) = 8*B*H*T*S*d; causal halves; fwd+bwd = 3.5 x fwd",
        "ratios": "wall-time ratios in this run: diff_s / baseline_s and diff_s / two-call_s (>1: diff slower)",
        "timing": f"median of {repeats} after {warmup} warmup calls, jax.block_until_ready",
        "records": records,
        "targets": targets,
        "memory": memory,
    }
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"attention_{platform}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
