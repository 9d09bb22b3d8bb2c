"""Tuning sweep for impl="pallas_gpu" on a Hopper GPU, in one call: the differential dk/dv kernel's variants
(Tuning.dkdv) timed alone (the backward without dq, from saved forward residuals) and on forward+backward, then the
backward's settings (block_k_dq, block_q_bwd, stages) on forward+backward with the best variant, then the forward's
(block_k, stages, pingpong) on the forward with the best backward, then the two winners together, against cuDNN
standard attention (2H heads of d, the equal-parameter baseline) in the same run; the best forward+backward Tuning
of the shape class goes into the table `auto` reads (diffjax.ops.choice.swept_tuning, pallas_gpu.default_tuning).

    python benchmarks/pallas_gpu_sweep.py [--T 8192] [--d 128] [--dv 256] [--single] [--out sweep.json]
        [--table pallas_gpu_tuning.json]      (merged: one entry per shape class; copy it to diffjax/ops/ to use it)
    python benchmarks/pallas_gpu_sweep.py --dry-run   # CPU: the plumbing at T = 128, xla standing in for the kernels

FLOP convention as benchmarks/attention.py (nominal; causal halves; fwd+bwd = 3.5 x fwd); a dk/dv row counts the
kernel's nominal B*H*(8d + 4dv)*T*S (S^T and dK per map, dP and dV) plus the D = rowsum(dO * O) it needs, and is
compared with the baseline variant "exchange" timed in the same run. A Tuning that does not fit shared memory or
fails to compile is an error row, not a crash; the JSON and the table are rewritten after every row, so a run cut
off by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import flops_baseline, flops_diff, fwd_bwd, time_fn  # noqa: E402

from diffjax import ops  # noqa: E402
from diffjax.ops.choice import tuning_class  # noqa: E402
from diffjax.ops.pallas_gpu import Tuning, default_tuning, unsupported  # noqa: E402
from diffjax.ops.pallas_gpu.common import DKDV_VARIANTS  # noqa: E402

# The options each kernel's settings take; a new kernel variant behind a Tuning field adds its options here.
FORWARD_OPTIONS = {"block_k": (128, 64), "stages": (2, 3), "pingpong": (True, False)}
BACKWARD_OPTIONS = {"block_k_dq": (128, 64), "block_q_bwd": (128, 64), "stages": (2, 3)}
DKDV_OPTIONS = {"dkdv": DKDV_VARIANTS}  # differential only: the single-map dk/dv kernel has one schedule
DKDV_BASELINE = "exchange"


def candidates(base: Tuning, options: dict) -> list[Tuning]:
    """base first, then every combination of `options` (those equal to base skipped)."""
    out = [base]
    for values in itertools.product(*options.values()):
        tuning = base._replace(**dict(zip(options, values)))
        if tuning not in out:
            out.append(tuning)
    return out


class Sweep:
    """The shape's inputs, the cuDNN reference and the rows timed so far, saved after each."""

    def __init__(self, args):
        self.args, self.rows = args, []
        self.T, self.H, d, dv = args.T, args.H, args.d, args.dv
        self.B = 1 if args.dry_run else max(1, 16384 // self.T)
        self.kernel_impl, self.reference_impl = ("xla", "xla") if args.dry_run else ("pallas_gpu", "cudnn")
        bf, (B, T, H) = jnp.bfloat16, (self.B, self.T, self.H)
        ks = jax.random.split(jax.random.PRNGKey(0), 6)
        maps = () if args.single else (2,)
        self.q, self.k = (jax.random.normal(ks[i], (B, T, H, *maps, d), bf) for i in range(2))
        self.v = jax.random.normal(ks[2], (B, T, H, d if args.single else dv), bf)
        self.lam = jnp.full((B, T, H), 0.5, jnp.float32)
        self.qb, self.kb, self.vb = (jax.random.normal(ks[3 + i], (B, T, 2 * H, d), bf) for i in range(3))
        causal = not args.non_causal
        single_flops = B * H * 4 * T * T * d / (2 if causal else 1)  # H standard heads of d
        self.flops = single_flops if args.single else flops_diff(B, H, T, T, causal, d, dv)
        self.dkdv_flops = B * H * (8 * d + 4 * dv) * T * T / (2 if causal else 1)
        self.ct = jax.random.normal(ks[3], (B, T, H, d if args.single else dv), bf)  # the output's cotangent
        self.reference = self._reference()

    def _reference(self) -> dict:
        causal, out = not self.args.non_causal, {}

        def base(q, k, v):
            return ops.dot_product_attention(q, k, v, causal=causal, impl=self.reference_impl)

        base_flops = flops_baseline(self.B, self.H, self.T, self.T, causal, self.args.d)
        for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            fn = jax.jit(base) if mode == "fwd" else fwd_bwd(base, 3)
            seconds = time_fn(fn, (self.qb, self.kb, self.vb), *self.repeats)
            out[mode] = {"cudnn_s": seconds, "cudnn_tflops": mult * base_flops / seconds / 1e12}
        return out

    @property
    def repeats(self):
        return (1, 1) if self.args.dry_run else (2, 10)

    def time(self, tuning: Tuning, mode: str) -> dict:
        """One row: mode "fwd", "fwd+bwd", or "dkdv" (the backward from saved residuals, its dq output unused, so
        that jit drops the dq kernel: the dk/dv kernel and D). A tuning timed in this mode already is not rerun."""
        causal, single = not self.args.non_causal, self.args.single
        row = {"tuning": tuning._asdict(), "mode": mode}
        done = [r for r in self.rows if r["tuning"] == row["tuning"] and r["mode"] == mode]
        if done:
            return done[0]
        why_not = unsupported(self.q, self.k, self.v, tuning)
        if why_not and not self.args.dry_run:
            row["error"] = f"unsupported: {why_not}"
            return self._keep(row)

        def attend(q, k, v, lam):
            if single:
                return ops.dot_product_attention(q, k, v, causal=causal, impl=self.kernel_impl, block_sizes=tuning)
            return ops.diff_attention(q, k, v, lam, causal=causal, impl=self.kernel_impl, block_sizes=tuning)

        try:
            args = (self.q, self.k, self.v, self.lam)
            if mode == "dkdv":
                _, backward = jax.vjp(attend, *args)
                fn, args = jax.jit(lambda backward, ct: backward(ct)[1:3]), (backward, self.ct)
            else:
                fn = jax.jit(attend) if mode == "fwd" else fwd_bwd(attend, 3)
            row["s"] = time_fn(fn, args, *self.repeats)
        except Exception as e:  # noqa: BLE001 (a config that does not fit is a result)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            return self._keep(row)
        if mode == "dkdv":
            row["tflops"] = self.dkdv_flops / row["s"] / 1e12
            baseline = [r for r in self.rows if r["mode"] == "dkdv" and r["tuning"]["dkdv"] == DKDV_BASELINE and "s" in r]
            row["speedup_vs_exchange"] = baseline[0]["s"] / row["s"] if baseline else 1.0 if tuning.dkdv == DKDV_BASELINE else None
            return self._keep(row)
        row["tflops"] = (1.0 if mode == "fwd" else 3.5) * self.flops / row["s"] / 1e12
        row["tflops_vs_cudnn"] = row["tflops"] / self.reference[mode]["cudnn_tflops"]
        return self._keep(row)

    def _keep(self, row: dict) -> dict:
        self.rows.append(row)
        if "s" not in row:
            timing = f"error {row['error'][:90]}"
        elif row["mode"] == "dkdv":
            speedup = row["speedup_vs_exchange"]
            timing = f"{1e3 * row['s']:8.2f} ms {row['tflops']:6.0f} TFLOP/s " + \
                (f"{speedup:5.2f}x {DKDV_BASELINE}" if speedup else f"(no {DKDV_BASELINE} row)")
        else:
            timing = f"{1e3 * row['s']:8.2f} ms {row['tflops']:6.0f} TFLOP/s {row['tflops_vs_cudnn']:5.2f}x cuDNN"
        print(f"{str(Tuning(**row['tuning'])):<100} {row['mode']:>8} {timing}", flush=True)
        self.save()
        return row

    def best(self, mode: str) -> dict | None:
        timed = [r for r in self.rows if r["mode"] == mode and "s" in r]
        return min(timed, key=lambda r: r["s"]) if timed else None

    def result(self) -> dict:
        a = self.args
        return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dry_run": a.dry_run,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "T": self.T, "B": self.B, "H": self.H, "d": a.d, "dv": a.dv, "single": a.single,
                "causal": not a.non_causal, "reference": self.reference, "rows": self.rows,
                "flop_convention": "nominal: diff fwd = B*H*2*(2*T*S*d + 2*T*S*dv), cuDNN baseline fwd = "
                                   "B*2H*4*T*S*d; causal halves; fwd+bwd = 3.5 x fwd; dkdv = B*H*(8d + 4dv)*T*S"}

    def save(self):
        a = self.args
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(self.result(), indent=1, default=float))
        best = self.best("fwd+bwd")
        if a.table and best:
            update_table(Path(a.table), self.result(), best)


def update_table(path: Path, result: dict, best: dict):
    """Merge this sweep's best fwd+bwd Tuning into the table under its shape class."""
    table = json.loads(path.read_text()) if path.exists() else {"best": {}}
    key = tuning_class(result["d"], result["d"] if result["single"] else result["dv"], result["single"], "bfloat16")
    entry = {"tuning": best["tuning"], "T": result["T"], "causal": result["causal"], "fwd_bwd_ms": 1e3 * best["s"],
             "tflops": best["tflops"], "tflops_vs_cudnn": best["tflops_vs_cudnn"], "date": result["date"]}
    table.update(device=result["device"], jax=result["jax"], dry_run=result["dry_run"],
                 source="benchmarks/pallas_gpu_sweep.py")
    table["best"][key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, default=float))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--dv", type=int, default=256)
    parser.add_argument("--H", type=int, default=8)
    parser.add_argument("--single", action="store_true", help="the single-map mode (standard attention, dv = d)")
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--table", default=None, help="merge the best fwd+bwd Tuning into this JSON table")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: B 1, T 128, H 2, xla stands in for pallas_gpu and cuDNN, two tunings per kernel")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.T, args.H = 128, 2
    args.out = args.out or str(Path(__file__).resolve().parent / "results" /
                               f"pallas_gpu_sweep_T{args.T}_d{args.d}_dv{args.dv}{'_single' * args.single}.json")
    return args


def main(argv=None):
    args = parse_args(argv)
    sweep = Sweep(args)
    print(f"{jax.devices()[0].device_kind}, T={sweep.T} B={sweep.B} H={sweep.H} d={args.d} dv={args.dv} "
          f"{'single-map' if args.single else 'diff'} causal={not args.non_causal} bf16"
          + (" (dry run: xla stands in for the kernels; the figures mean nothing)" if args.dry_run else ""))
    for mode, ref in sweep.reference.items():
        print(f"  cuDNN standard {mode}: {ref['cudnn_tflops']:.1f} TFLOP/s")
    base = default_tuning(args.d, args.d if args.single else args.dv, 1 if args.single else 2, jnp.bfloat16,
                          args.single, swept=False)
    limit = 2 if args.dry_run else None
    # the backward first (the gap to cuDNN is there; a run cut short keeps it): the dk/dv variants, the baseline
    # first, alone and in fwd+bwd; then the backward's settings with the best; then the forward on the best backward
    if not args.single:
        for tuning in candidates(base._replace(dkdv=DKDV_BASELINE), DKDV_OPTIONS)[:limit]:
            sweep.time(tuning, "dkdv")
            sweep.time(tuning, "fwd+bwd")
        base = Tuning(**(sweep.best("fwd+bwd") or {"tuning": base._asdict()})["tuning"])
    for tuning in candidates(base, BACKWARD_OPTIONS)[:limit]:
        sweep.time(tuning, "fwd+bwd")
    backward = Tuning(**(sweep.best("fwd+bwd") or {"tuning": base._asdict()})["tuning"])
    for tuning in candidates(backward, FORWARD_OPTIONS)[:limit]:
        sweep.time(tuning, "fwd")
    forward = sweep.best("fwd")
    if forward and Tuning(**forward["tuning"]) != backward:  # the two winners together, measured as a whole
        sweep.time(Tuning(**forward["tuning"]), "fwd+bwd")
    best = sweep.best("fwd+bwd")
    print(f"best fwd+bwd: {Tuning(**best['tuning']) if best else None}; wrote {args.out}"
          + (f" and {args.table}" if args.table and best else ""))


if __name__ == "__main__":
    main()
