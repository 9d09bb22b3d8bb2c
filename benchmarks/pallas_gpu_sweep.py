"""Tuning sweep for impl="pallas_gpu" on a Hopper GPU, in one call: the differential dk/dv kernel's variants
(Tuning.dkdv) timed alone (the backward without dq, from saved forward residuals) and on forward+backward, then the
backward's settings (block_k_dq, block_q_bwd, stages) on forward+backward with the best variant, then the forward's
(block_k, stages, pingpong) on the forward with the best backward, then the two winners together, against cuDNN
standard attention (2H heads of d, the equal-parameter baseline) in the same run; the best forward+backward Tuning
of the shape class goes into the table `auto` reads (diffjax.ops.pallas_gpu.tuning_table, default_tuning).

    python benchmarks/pallas_gpu_sweep.py [--T 8192] [--d 128] [--dv 256] [--single] [--out sweep.json]
        [--table pallas_gpu_tuning.json]      (merged: one entry per shape class; copy it to diffjax/ops/ to use it)
    python benchmarks/pallas_gpu_sweep.py --dry-run   # CPU: the plumbing at T = 128, xla standing in for the kernels

    python benchmarks/pallas_gpu_sweep.py --list      # the candidates the options below give, nothing timed

FLOP convention as benchmarks/attention.py (nominal; causal halves; fwd+bwd = 3.5 x fwd); a dk/dv row counts the
kernel's nominal B*H*(8d + 4dv)*T*S (S^T and dK per map, dP and dV) plus the D = rowsum(dO * O) it needs, and is
compared with the baseline variant "exchange" timed in the same run. A Tuning that does not
fit shared memory or fails to compile is an error row, not a crash; the JSON and the table are rewritten after
every row, so a run cut off by its time limit keeps what it measured.

Correctness at the swept shape: every timed Tuning's output (fwd) or gradients (fwd+bwd) against those of the first
Tuning timed in that pass, the default (for the forward: the best backward's) (`rel_diff_vs_default`, `agrees`:
within AGREE; only Tunings that agree can be the best), and that first Tuning's against XLA in float32
(`reference_check`: each within 2x the error XLA makes in the inputs' dtype plus AGREE, the gpu tests' rule), so the
sweep proves the kernels at T 8192, not only their speed.
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
from diffjax.ops.pallas_gpu import Tuning, default_tuning, unsupported  # noqa: E402
from diffjax.ops.pallas_gpu.tuning_table import tuning_class  # noqa: E402
from diffjax.ops.pallas_gpu.common import DKDV_VARIANTS  # noqa: E402

# The options each kernel's settings take; a new kernel variant behind a Tuning field adds its options here (the
# session's sweep phase runs what these give; tests/test_capture.py fails while a Tuning field has none).
FORWARD_OPTIONS = {"block_k": (128, 64), "stages": (2, 3), "pingpong": (True, False)}
BACKWARD_OPTIONS = {"block_k_dq": (128, 64), "block_q_bwd": (128, 64), "stages": (2, 3)}
DKDV_OPTIONS = {"dkdv": DKDV_VARIANTS}  # differential only: the single-map dk/dv kernel has one schedule
DKDV_BASELINE = "exchange"
FIXED_FIELDS = ("block_q",)  # one wgmma row tile per consumer: not a choice
AGREE = 4 * 2.0**-8  # two Tunings compute the same sums in another order: 4 bf16 ulps of the largest value


def rel_diff(a, b) -> float:
    """max |a - b| over max |b| (the gpu tests' measure), in float32."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def unswept_fields() -> list[str]:
    """Tuning fields with no options here: a kernel variant the sweep would never try."""
    swept = {**FORWARD_OPTIONS, **BACKWARD_OPTIONS, **DKDV_OPTIONS}
    return [f for f in Tuning._fields if f not in swept and f not in FIXED_FIELDS]


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
        self.args, self.rows, self.default_outputs, self.reference_check = args, [], {}, None
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

    @staticmethod
    def shapes(args) -> tuple:
        """q, k, v of the swept op (shapes and dtype only)."""
        B, maps, dv = (1 if args.dry_run else max(1, 16384 // args.T)), (() if args.single else (2,)), args.dv
        q = jax.ShapeDtypeStruct((B, args.T, args.H, *maps, args.d), jnp.bfloat16)
        return q, q, jax.ShapeDtypeStruct((B, args.T, args.H, args.d if args.single else dv), jnp.bfloat16)

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
        row = {"tuning": tuning._asdict(), "mode": mode}
        done = [r for r in self.rows if r["tuning"] == row["tuning"] and r["mode"] == mode]
        if done:
            return done[0]
        why_not = unsupported(self.q, self.k, self.v, tuning)
        if why_not and not self.args.dry_run:
            row["error"] = f"unsupported: {why_not}"
            return self._keep(row)

        try:
            fn, args = self.function(self.kernel_impl, tuning, mode)
            row["s"] = time_fn(fn, args, *self.repeats)
            outputs = jax.tree.leaves(fn(*args))
        except Exception as e:  # noqa: BLE001 (a config that does not fit is a result)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            return self._keep(row)
        if mode == "dkdv":
            row["tflops"] = self.dkdv_flops / row["s"] / 1e12
            baseline = [r for r in self.rows if r["mode"] == "dkdv" and r["tuning"]["dkdv"] == DKDV_BASELINE and "s" in r]
            row["speedup_vs_exchange"] = baseline[0]["s"] / row["s"] if baseline else 1.0 if tuning.dkdv == DKDV_BASELINE else None
        else:
            row["tflops"] = (1.0 if mode == "fwd" else 3.5) * self.flops / row["s"] / 1e12
            row["tflops_vs_cudnn"] = row["tflops"] / self.reference[mode]["cudnn_tflops"]
        default = self.default_outputs.setdefault(mode, outputs)  # the first timed Tuning of a mode: the default
        row["rel_diff_vs_default"] = max(rel_diff(a, b) for a, b in zip(outputs, default))
        row["agrees"] = row["rel_diff_vs_default"] <= AGREE
        return self._keep(row)

    def inputs(self) -> tuple:
        return (self.q, self.k, self.v) if self.args.single else (self.q, self.k, self.v, self.lam)

    def function(self, impl: str, tuning: Tuning | None, mode: str):
        """(jitted function, its arguments) of the swept op: the forward (its output), forward+backward (the
        gradients of sum(o)), or "dkdv" (dk and dv from the saved residuals and the cotangent `ct`)."""
        causal, single = not self.args.non_causal, self.args.single

        def attend(q, k, v, lam=None):
            if single:
                return ops.dot_product_attention(q, k, v, causal=causal, impl=impl, block_sizes=tuning)
            return ops.diff_attention(q, k, v, lam, causal=causal, impl=impl, block_sizes=tuning)

        if mode == "dkdv":
            _, backward = jax.vjp(attend, *self.inputs())
            return jax.jit(lambda backward, ct: backward(ct)[1:3]), (backward, self.ct)
        return (jax.jit(attend) if mode == "fwd" else fwd_bwd(attend, 3 if single else 4)), self.inputs()

    def check_reference(self, mode: str) -> dict | None:
        """The first timed Tuning's output (fwd) or gradients (fwd+bwd) against XLA's in float32, each within 2x
        the error XLA makes in the inputs' dtype plus AGREE (the gpu tests' rule)."""
        if mode not in self.default_outputs:
            return None
        xla, inputs = self.function("xla", None, mode)
        exact = jax.tree.leaves(xla(*(x.astype(jnp.float32) for x in inputs)))
        low = jax.tree.leaves(xla(*inputs))
        rows = []
        for got, e, r in zip(self.default_outputs[mode], exact, low):
            err, tol = rel_diff(got, e), 2 * rel_diff(r, e) + AGREE
            rows.append({"rel_err": err, "tol": tol, "ok": err <= tol})
        check = {"ok": all(r["ok"] for r in rows), "outputs": rows}
        self.reference_check = {**(self.reference_check or {}), mode: check}
        print(f"  {mode} against XLA in float32: " + ", ".join(f"{r['rel_err']:.2e} (tol {r['tol']:.2e})" for r in rows)
              + (" ok" if self.reference_check[mode]["ok"] else " FAILS"), flush=True)
        self.save()
        return self.reference_check[mode]

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
        """The fastest timed Tuning of `mode` among those that agree with the default."""
        timed = [r for r in self.rows if r["mode"] == mode and "s" in r and r["agrees"]]
        return min(timed, key=lambda r: r["s"]) if timed else None

    def result(self) -> dict:
        a = self.args
        return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dry_run": a.dry_run,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "T": self.T, "B": self.B, "H": self.H, "d": a.d, "dv": a.dv, "single": a.single,
                "causal": not a.non_causal, "reference": self.reference, "rows": self.rows,
                "reference_check": self.reference_check, "agree": AGREE,
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
    parser.add_argument("--list", action="store_true", help="print the candidates and which fit, time nothing")
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
    if unswept_fields():
        print(f"note: Tuning fields without options here, not swept: {', '.join(unswept_fields())}")
    if args.list:
        base = default_tuning(args.d, args.d if args.single else args.dv, 1 if args.single else 2, jnp.bfloat16,
                              args.single, swept=False)
        for mode, options in (("fwd+bwd", BACKWARD_OPTIONS), ("fwd (on the best backward)", FORWARD_OPTIONS)):
            for tuning in candidates(base, options):
                why_not = unsupported(*Sweep.shapes(args), tuning)
                print(f"{mode:>26}: {tuning}" + (f"  (unsupported: {why_not[:60]})" if why_not else ""))
        return
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
    sweep.check_reference("fwd+bwd")
    backward = Tuning(**(sweep.best("fwd+bwd") or {"tuning": base._asdict()})["tuning"])
    for tuning in candidates(backward, FORWARD_OPTIONS)[:limit]:
        sweep.time(tuning, "fwd")
    sweep.check_reference("fwd")
    forward = sweep.best("fwd")
    if forward and Tuning(**forward["tuning"]) != backward:  # the two winners together, measured as a whole
        sweep.time(Tuning(**forward["tuning"]), "fwd+bwd")
    best = sweep.best("fwd+bwd")
    print(f"best fwd+bwd: {Tuning(**best['tuning']) if best else None}; wrote {args.out}"
          + (f" and {args.table}" if args.table and best else ""))


if __name__ == "__main__":
    main()
