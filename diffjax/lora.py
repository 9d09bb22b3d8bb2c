"""LoRA over the params pytree: low-rank adapters on chosen projections of any model diffjax builds.

For each targeted kernel W [L, *in_dims, *out_dims] (the decoder blocks' params are stacked over depth) an
adapter pair A [L, prod(in_dims), r] and B [L, r, prod(out_dims)]; the model runs with the effective

    W' = W + (alpha / r) * reshape(A @ B, W.shape)

(`merge`). A starts random (normal, std 1 / sqrt(prod(in_dims)), Kaiming-style), B zeros: step 0 is the base
model exactly. Besides the adapters, base params whose dotted path matches one of `LoraConfig.trainable` (e.g.
"lambda_": differential attention's lambda vectors) train too; everything else is frozen: it is not an argument
of the differentiated loss and has no optimizer state.

Why not `nnx.LoRA` / `nnx.LoRAParam`: nnx.LoRA wraps a 2-D `x @ W` Linear, and diffjax's projections are not
Linears. They are raw nnx.Param kernels used in einsums with the head structure in their shapes (DIFF V1's
q_kernel is [D, H, 2, d], o_kernel [H, 2d, D]), stacked over depth and applied by a lax.scan. An nnx.LoRA per
projection would mean editing every attention kind's module (and a kind registered by a user would get no
LoRA). Working on the params pytree instead needs no module edits: the loss merges the effective params and
calls the model unchanged, so every attention kind, the layer scan, remat and the sharding rules work as they
are. The adapters are a plain pytree in the train state (they never live in the module graph, so no nnx
variable type such as nnx.LoRAParam is needed to tell them apart: the trainable tree *is* the filter).
The merged forward materializes W' for the targeted kernels (one transient copy of them, and their full-size
gradient in the backward pass before it is contracted into A's and B's); the usual x @ A @ B side path
would avoid that but needs the module edits above.

Which dims of a kernel are its input comes from its logical axes: the "embed" axis, or a latent's "rank" axis,
when it comes first (q, k, v, gate, up; GDLA's q_down / q_up / kv_down / kv_up), else every axis before a final
"embed" (o: heads x head_dim; down: mlp). A takes the sharding of the first input axis (on the flattened input
dim), B that of the first output axis; "rank" is never split (`adapter_shardings`).

A model whose layers are not all built alike (Motif 3: dense first layers, then MoE layers; diffjax.kinds.
layer_segments) stacks each segment apart ("blocks", "blocks_from_<start>"; the MTP depths are "blocks_mtp"): every
stack gets its own adapters, on the targeted kernels it has (the dense MLP's gate / up / down in one, the MoE's
shared expert's in the other).
Routed experts (target "experts": W [L, E, in, out]) get one adapter pair per expert, A [L, E, in, r] and
B [L, E, r, out]: E times a dense projection's adapter, and the merged W' is a transient copy of all of them
(for a large E, adapt the shared expert and attention only). GDLA's output gate (attn.gate_kernel) is no target.

A LoRA run directory names its settings and its base in config.yaml (`run_settings`); reading its weights merged
is diffjax.params_checkpoint's (lora_run, merged_lora_params) and diffjax.convert.lora_merge's (LazyMergedParams:
one base leaf at a time), which import this module: this one imports no checkpoint code
nor the run directory's layout, nor anything of the trainer (the model and the sharding rules only where a function
needs them).

Precision: `merge` adds in float32 and casts W' to W's dtype, so with a bfloat16 base an update smaller than
W's rounding step does not show in the forward until it grows (the gradient still reaches A and B). Adapters
are float32 whatever the base dtype.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.config_values import build_config, read_yaml_mapping
from diffjax.kinds import param_stacks
from diffjax.lora_config import (  # noqa: F401 (lora.LoraConfig: the users' path)
    PART_MODULES, LoraConfig, target_groups, target_kernels, target_names,
)

ADAPTERS, BASE = "lora", "base"  # the trainable tree's keys: the adapters and the base params that train too
A, B = "lora_a", "lora_b"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One adapted kernel: its params path, shape, how many leading dims are batch (1: the layers axis; 2: layers
    and the routed experts) and how many after those are its input."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    in_ndim: int
    logical_axes: tuple[str | None, ...]
    batch_ndim: int = 1

    @property
    def in_size(self) -> int:
        return math.prod(self.shape[self.batch_ndim:self.batch_ndim + self.in_ndim])

    @property
    def out_size(self) -> int:
        return math.prod(self.shape[self.batch_ndim + self.in_ndim:])

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.shape[:self.batch_ndim]


def _input_ndim(path: tuple[str, ...], rest: tuple) -> int:
    """How many of a kernel's axes (after its batch axes) are its input: the first when it is "embed" or a
    low-rank latent's "rank" (q, k, v, gate, up; GDLA's q_up, kv_up), else every axis before a final "embed"."""
    if rest and rest[0] in ("embed", "rank"):
        return 1
    if len(rest) >= 2 and rest[-1] == "embed":
        return len(rest) - 1
    raise ValueError(f"LoRA: cannot tell the input dims of {'.'.join(path)} from its logical axes {tuple(rest)}")


def _kernel_spec(path: tuple[str, ...], variable) -> KernelSpec:
    axes = tuple(getattr(variable, "logical_axes", None) or (None,) * len(variable.shape))
    if axes[0] != "layers":
        raise ValueError(f"LoRA: {'.'.join(path)} is not stacked over layers (logical axes {axes})")
    batch_ndim = 2 if axes[1:2] == ("expert",) else 1
    return KernelSpec(path, tuple(variable.shape), _input_ndim(path, axes[batch_ndim:]), axes, batch_ndim)


def kernel_specs(model_config, config: LoraConfig) -> dict[tuple[str, ...], KernelSpec]:
    """The kernels `config` adapts in the model `model_config` builds, in every layer segment (a model whose layers
    differ, e.g. Motif 3's dense first layers then MoE layers, stacks each segment apart: adapters per stack), from
    their params' logical axes. Raises ValueError naming a target that matches no kernel of this model."""
    from flax import nnx

    from diffjax.model import TransformerLM

    stacks = {segment.name for segment in param_stacks(model_config)}  # (the MTP depths' too)
    targets, groups = target_kernels(), target_groups()
    modules_of = {kernel: modules for modules, kernels in targets.values() for kernel in kernels}
    abstract = nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0)))
    specs, found = {}, set()
    for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        path = tuple(map(str, path))
        if path[0] in stacks and path[1] in modules_of.get(path[-1], ()):  # (an attention's output gate is no MLP gate)
            found.add(path[-1])
            if path[-1] in config.kernel_names:
                specs[path] = _kernel_spec(path, variable)
    has = {p: any(k in found for k in targets[p][1]) for p in targets}
    missing = [t for t in config.targets if t in targets and not has[t]]
    missing += [t for t in config.targets if t in groups and not any(has[p] for p in groups[t])]
    if missing:
        raise ValueError(f"lora.targets: model.attention {model_config.attention!r} / model.mlp {model_config.mlp!r} "
                         f"has no {', '.join(missing)} projection (its adaptable ones: "
                         f"{', '.join(p for p in targets if has[p]) or 'none'})")
    return specs


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _flat(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, prefix + (str(key),))
        else:
            yield prefix + (str(key),), value


def init_adapters(specs: dict[tuple[str, ...], KernelSpec], config: LoraConfig, key: jax.Array) -> dict:
    """{path...: {"lora_a": [L, in, r], "lora_b": [L, r, out]}} (float32; routed experts' [L, E, in, r] and
    [L, E, r, out]): A normal with std 1/sqrt(in), B zeros."""
    adapters = {}
    for i, (path, spec) in enumerate(sorted(specs.items())):
        a = jax.random.normal(jax.random.fold_in(key, i), spec.batch_shape + (spec.in_size, config.rank), jnp.float32)
        _set(adapters, path, {A: a * spec.in_size ** -0.5,
                              B: jnp.zeros(spec.batch_shape + (config.rank, spec.out_size), jnp.float32)})
    return adapters


def delta(a: jax.Array, b: jax.Array, shape, scale: float) -> jax.Array:
    """(alpha / r) * A @ B in float32, shaped like the kernel [L, (E,) *in, *out]."""
    return (scale * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))).reshape(shape)


def merge(params: dict, adapters: dict, config: LoraConfig) -> dict:
    """The effective params: each adapted kernel W -> W + (alpha/r) A @ B (added in float32, W's dtype);
    every other leaf as it is. `params` is not modified."""
    merged = jax.tree.map(lambda x: x, params)  # new dict nodes, same leaves
    for path, pair in _adapter_pairs(adapters):
        w = _get(params, path)
        _set(merged, path, (w.astype(jnp.float32) + delta(pair[A], pair[B], w.shape, config.scale)).astype(w.dtype))
    return merged


def _adapter_pairs(adapters: dict):
    """(kernel path, {"lora_a", "lora_b"}) of every adapter in the tree."""
    def walk(tree, prefix):
        if A in tree:
            yield prefix, tree
            return
        for key, value in tree.items():
            yield from walk(value, prefix + (str(key),))

    yield from walk(adapters, ())


def split_base(params: dict, config: LoraConfig) -> tuple[dict, dict]:
    """(the base params that train too, the frozen rest): two disjoint nested dicts covering `params`."""
    chosen, frozen = {}, {}
    for path, value in _flat(params):
        _set(chosen if config.is_trainable(".".join(path)) else frozen, path, value)
    return chosen, frozen


def check_trainable(params: dict, config: LoraConfig) -> None:
    """Raise ValueError naming a lora.trainable pattern that matches no parameter (a typo would train nothing)."""
    paths = [".".join(path) for path, _ in _flat(params)]
    for pattern in config.trainable:
        if not any(re.search(pattern, path) for path in paths):
            raise ValueError(f"lora.trainable: {pattern!r} matches no parameter of this model; its parameters are "
                             f"{', '.join(paths)}")


def join(frozen: dict, chosen: dict) -> dict:
    """`frozen` with `chosen`'s leaves put back in place (split_base's inverse)."""
    joined = jax.tree.map(lambda x: x, frozen)
    for path, value in _flat(chosen):
        _set(joined, path, value)
    return joined


def trainable_params(adapters: dict, chosen: dict) -> dict:
    """The train state's params: {"lora": adapters} plus {"base": chosen} when any base param trains."""
    return {ADAPTERS: adapters, **({BASE: chosen} if chosen else {})}


def model_params(trainable: dict, frozen: dict, config: LoraConfig) -> dict:
    """The full effective params the model runs with, from the train state's params and the frozen base."""
    return merge(join(frozen, trainable.get(BASE, {})), trainable[ADAPTERS], config)


def adapter_shardings(specs: dict[tuple[str, ...], KernelSpec], config: LoraConfig, mesh) -> dict:
    """NamedShardings of init_adapters' tree: A [L, in, r] split like W's first input axis, B [L, r, out] like
    its first output axis (where the mesh divides the flattened size), the layers and rank axes whole; routed
    experts' adapters split on their expert axis as the kernel is."""
    from jax.sharding import NamedSharding

    from diffjax.sharding import logical_spec

    shardings = {}
    for path, spec in specs.items():
        batch_axes = spec.logical_axes[:spec.batch_ndim]
        first_in, first_out = spec.logical_axes[spec.batch_ndim], spec.logical_axes[spec.batch_ndim + spec.in_ndim]
        a_shape = spec.batch_shape + (spec.in_size, config.rank)
        b_shape = spec.batch_shape + (config.rank, spec.out_size)
        _set(shardings, path, {
            A: NamedSharding(mesh, logical_spec(batch_axes + (first_in, "rank"), a_shape, mesh)),
            B: NamedSharding(mesh, logical_spec(batch_axes + ("rank", first_out), b_shape, mesh)),
        })
    return shardings


def checksum(x: jax.Array) -> jax.Array:
    """One leaf's exact fingerprint (checksums): a uint32 scalar."""
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize])
    bits = bits.reshape(-1).astype(jnp.uint32)
    weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32) * jnp.uint32(2654435761)
    return jnp.sum(bits * weights + (bits ^ jnp.uint32(0x9E3779B9)), dtype=jnp.uint32)


def host_checksum(x: np.ndarray, chunk: int = 2**20) -> np.uint32:
    """checksum computed by numpy, bit for bit the same (its uint32 products and sums wrap modulo 2**32 alike), a
    chunk of elements at a time: a leaf read from disk is fingerprinted without a device, a compilation per shape,
    or temporaries the size of the leaf."""
    x = np.ascontiguousarray(x)
    bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]).reshape(-1)
    total = 0
    for start in range(0, bits.size, chunk):
        part = bits[start:start + chunk].astype(np.uint32)
        weights = np.arange(start + 1, start + 1 + part.size, dtype=np.uint32) * np.uint32(2654435761)
        total += int(np.sum(part * weights + (part ^ np.uint32(0x9E3779B9)), dtype=np.uint32))
    return np.uint32(total % 2**32)


def checksums(params: dict) -> dict:
    """{dotted path: uint32 scalar} per leaf: an exact fingerprint of the values (their bits, position-weighted,
    summed modulo 2**32: integer sums do not depend on the mesh or the order of the reduction). A resumed LoRA
    run compares the base it re-reads with the one it started from."""
    return {".".join(path): checksum(value) for path, value in _flat(params)}


def changed_leaves(saved: dict, current: dict) -> list[str]:
    """The dotted paths whose checksums differ (or that only one side has)."""
    keys = sorted(set(saved) | set(current))
    return [k for k in keys if k not in saved or k not in current or int(saved[k]) != int(current[k])]


def check_same_base(saved: dict, current: dict, step_dir, init_from, advice: str) -> None:
    """A LoRA checkpoint's adapters fit the base they were trained on: ValueError naming the leaves whose checksums
    differ between the base it was saved with (`saved`) and the one train.init_from holds now (`current`)."""
    changed = changed_leaves(saved, current)
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ValueError(f"the base model changed since the LoRA checkpoint {step_dir} was saved: train.init_from "
                         f"{init_from} now holds different {', '.join(changed[:3])}{more}; {advice}")


# --- a LoRA run directory: its config.yaml names the settings and the base ---------------------------------------------

def run_settings(config_file) -> tuple[LoraConfig, str] | None:
    """(LoraConfig, train.init_from) of a LoRA run directory from its config.yaml (a pathlib or epath path; its lora
    section has rank > 0); None for any other run directory."""
    saved = read_yaml_mapping(config_file) if config_file.exists() else {}
    section = saved.get("lora") or {}
    if not isinstance(section, dict) or not section.get("rank"):
        return None
    try:
        config = build_config(LoraConfig, section, prefix="lora")
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from None
    init_from = (saved.get("train") or {}).get("init_from")
    if not init_from:
        raise ValueError(f"{config_file}: a LoRA run (lora.rank {config.rank}) without train.init_from (its base)")
    return config, init_from
