"""The mixture of experts' dispatch over an expert-sharded mesh, two ways, on simulated CPU devices:

  gspmd  diffjax.ops.expert_parallel.routed_on_one_device (the one-device sort + ragged_dot) under jit with the
         experts' weights split over "expert" and the rows over the batch axes: XLA partitions it as it can;
  a2a    routed_expert_parallel: shard_map, rows to their experts' devices and back by all-to-all (what the model
         runs when the mesh has an expert axis).

For each: time per forward + backward step, and from the compiled program (one device's HLO) the collectives by
kind (count, bytes of their results) and the temporary memory per device; then a2a / gspmd ratios from the same run.
On CPU the times say little (the devices share the host's cores); the collectives and the memory are the evidence.

    python benchmarks/moe_dispatch.py [--devices 8] [--mesh expert=8] [--tokens 4096] [--d-model 128]
                                      [--experts 16] [--top-k 2] [--inner 64] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--mesh", default="expert=8", help="axis=size items, comma-separated (parallel.* names)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--inner", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    return p.parse_args(argv)


COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes of results)} of one device's compiled HLO (async -start ops counted once)."""
    found = {kind: [0, 0] for kind in COLLECTIVES}
    for match in re.finditer(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\(", hlo):
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
        size = sum(BYTES.get(dtype, 4) * _product(dims) for dtype, dims in shapes)
        found[match.group(2)][0] += 1
        found[match.group(2)][1] += size
    return {kind: tuple(value) for kind, value in found.items()}


def _product(dims: str) -> int:
    out = 1
    for d in filter(None, dims.split(",")):
        out *= int(d)
    return out


def main(argv=None) -> None:
    args = _args(argv)
    devices = f" --xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + devices
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from diffjax.mlp_kinds import MoEOptions
    from diffjax.model.mlp.moe import run_experts
    from diffjax.ops import expert_parallel
    from diffjax.sharding import logical_spec
    from diffjax.train.mesh import ParallelConfig, make_mesh

    sizes = {axis: int(size) for axis, size in (item.split("=") for item in args.mesh.split(","))}
    mesh = make_mesh(ParallelConfig(**{"data": 1, **sizes}))
    N, D, E, K, I = args.tokens, args.d_model, args.experts, args.top_k, args.inner
    keys = jax.random.split(jax.random.key(0), 6)
    params = {"expert_gate_kernel": 0.1 * jax.random.normal(keys[0], (E, D, I)),
              "expert_up_kernel": 0.1 * jax.random.normal(keys[1], (E, D, I)),
              "expert_down_kernel": 0.1 * jax.random.normal(keys[2], (E, I, D)),
              "expert_polynorm_weight": jnp.full((E, 3), 1 / 3), "expert_polynorm_bias": jnp.zeros((E, 1))}
    axes = {"expert_gate_kernel": ("expert", "embed", "mlp"), "expert_up_kernel": ("expert", "embed", "mlp"),
            "expert_down_kernel": ("expert", "mlp", "embed"), "expert_polynorm_weight": ("expert", None),
            "expert_polynorm_bias": ("expert", None)}
    param_shardings = {k: NamedSharding(mesh, logical_spec(axes[k], v.shape, mesh)) for k, v in params.items()}
    x_ND = jax.random.normal(keys[3], (N, D))
    experts_NK = jax.lax.top_k(jax.random.normal(keys[4], (N, E)), K)[1]
    weights_NK = jax.random.uniform(keys[5], (N, K))
    rows = NamedSharding(mesh, P(expert_parallel.row_axes(mesh, N) or ("data", "fsdp", "expert"), None))
    run = functools.partial(run_experts, MoEOptions(num_experts=E, top_k=K, expert_inner=I))
    paths = {"gspmd": lambda x, e, w, p: expert_parallel.routed_on_one_device(run, x, e, w, p, E),
             "a2a": lambda x, e, w, p: expert_parallel.routed_expert_parallel(run, x, e, w, p, mesh)}
    inputs = (jax.device_put(x_ND, rows), jax.device_put(experts_NK, rows), jax.device_put(weights_NK, rows),
              jax.device_put(params, param_shardings))
    print(f"mesh {dict(mesh.shape)}; tokens {N}, d_model {D}, experts {E}, top_k {K}, expert_inner {I}; "
          f"forward + backward, {args.steps} steps; collectives of one device's compiled program")
    results, outputs = {}, {}
    for name, path in paths.items():
        def step(x, e, w, p, path=path):
            return jax.value_and_grad(lambda x, p: jnp.sum(path(x, e, w, p) ** 2), argnums=(0, 1))(x, p)
        compiled = jax.jit(step, in_shardings=(rows, rows, rows, param_shardings)).lower(*inputs).compile()
        outputs[name] = jax.block_until_ready(compiled(*inputs))
        start = time.perf_counter()
        for _ in range(args.steps):
            jax.block_until_ready(compiled(*inputs))
        seconds = (time.perf_counter() - start) / args.steps
        memory = compiled.memory_analysis()
        results[name] = (seconds, collectives(compiled.as_text()), getattr(memory, "temp_size_in_bytes", 0))
    _report(results)
    loss, diff = outputs["gspmd"][0], abs(float(outputs["a2a"][0]) - float(outputs["gspmd"][0]))
    print(f"loss: gspmd {float(loss):.6f}, |a2a - gspmd| {diff:.2e}")


def _report(results: dict) -> None:
    print(f"{'path':6} {'ms/step':>9} {'temp MB/device':>15}  collectives (count, MB)")
    for name, (seconds, found, temp) in results.items():
        used = ", ".join(f"{kind} {n} ({b / 2**20:.2f})" for kind, (n, b) in found.items() if n)
        print(f"{name:6} {1e3 * seconds:9.1f} {temp / 2**20:15.2f}  {used or 'none'}")
    (ts, _, ms), (ta, _, ma) = results["gspmd"], results["a2a"]
    total = {name: sum(b for _, b in found.values()) for name, (_, found, _) in results.items()}
    print(f"a2a / gspmd: time {ta / ts:.2f}, temp memory {ma / max(ms, 1):.2f}, "
          f"collective bytes {total['a2a'] / max(total['gspmd'], 1):.3f}")


if __name__ == "__main__":
    sys.exit(main())
