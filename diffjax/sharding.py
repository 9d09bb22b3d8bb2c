"""Logical axis names -> mesh axes: the rule table, shardings of params and batches, activation constraints.

Parameters and activations name their axes logically ("embed", "heads", "batch", ...); LOGICAL_AXIS_RULES maps
those names onto the mesh axes, read from their one table (diffjax.mesh_axes.AXES):

  data    splits the batch; params replicated (data parallel)
  fsdp    splits the batch and every parameter's "embed" axis, optimizer state included (ZeRO-3 /
          FSDP: the compiler all-gathers a layer's weights where it is used)
  context splits the sequence of every activation (context parallelism: diffjax.ops.context_parallel, whose
          layout the train and eval steps put batches in) and, as fsdp does, every parameter's "embed" axis, so
          params and optimizer state shrink with it too (MaxText shards them the same way)
  tensor  splits heads, kv heads, the MLP width and the vocabulary (Megatron-style tensor parallel)
  expert  splits the MoE's routed experts (their leading "expert" axis) and, as fsdp does, the batch and every
          other parameter's "embed" axis (MaxText's rules): no device idles outside the experts, and attention,
          embeddings and their optimizer state shrink with it too. The MoE layer sends each token's rows to the
          devices owning its experts by all-to-all (diffjax.ops.expert_parallel); the experts' own embed and MLP
          axes stay split by fsdp / context / tensor (an array uses a mesh axis once), gathered per layer.

"layers" (the stacked depth axis of the decoder blocks' params) is never split: a scan over layers
slices it, and a split depth axis would make every step gather it.

The model never mentions mesh axes: it calls `constrain(x, logical_axes)`, which is a no-op unless
the caller traces it inside `activation_sharding(mesh)` (the train and eval steps do). Imports jax only
(meshes and process start-up live in diffjax.train.mesh).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax.mesh_axes import splitting

# Every logical axis name the model uses; the mesh axes each maps to are diffjax.mesh_axes.AXES's (mesh order). The
# routed experts' own "embed" axis stays whole over expert: logical_spec uses a mesh axis once per array, and their
# leading "expert" axis takes it first.
LOGICAL_AXES = ("layers", "embed", "vocab", "heads", "kv_heads", "mlp", "head_dim", "expert",
                "rank",  # Shared DIFF's low-rank factors: small, split by their heads axis only
                "batch", "length", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab")  # (activations)
LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = tuple((name, splitting(name)) for name in LOGICAL_AXES)
_RULES = dict(LOGICAL_AXIS_RULES)


def _mesh_axes(logical_name: str | None, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the rules give a logical axis name."""
    if logical_name is None:
        return ()
    if logical_name not in _RULES:
        raise KeyError(f"no sharding rule for the logical axis {logical_name!r}; rules exist for {sorted(_RULES)}")
    return tuple(axis for axis in _RULES[logical_name] if dict(mesh.shape).get(axis, 1) > 1)  # a mesh may lack an axis


def logical_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """The PartitionSpec the rules give an array of `shape`; a dimension its mesh axes do not divide
    stays whole (e.g. a vocabulary of 257 over tensor=2) rather than failing."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match the shape {tuple(shape)}")
    spec, used = [], set()
    for name, size in zip(logical_axes, shape):
        axes = tuple(axis for axis in _mesh_axes(name, mesh) if axis not in used)
        if not axes or size % math.prod(mesh.shape[axis] for axis in axes):
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def _params_axes(abstract_params_state):
    """(path, logical axes, shape) of every parameter in an nnx State carrying `logical_axes` metadata."""
    from flax import nnx  # only for nnx States

    for path, variable in nnx.to_flat_state(abstract_params_state):
        axes = getattr(variable, "logical_axes", None) or (None,) * len(variable.shape)
        yield path, axes, variable.shape


def param_shardings(abstract_params_state, mesh: Mesh) -> dict:
    """NamedShardings (as an nnx pure dict) for an nnx State of Params carrying `logical_axes`."""
    shardings = {}
    for path, axes, shape in _params_axes(abstract_params_state):
        node = shardings
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = NamedSharding(mesh, logical_spec(axes, shape, mesh))
    return shardings


def unsharded_dims(abstract_params_state, mesh: Mesh) -> list[str]:
    """Parameter dimensions the rules would split but whose size the mesh axes do not divide (for a log note)."""
    notes = []
    for path, axes, shape in _params_axes(abstract_params_state):
        for name, size in zip(axes, shape):
            split = math.prod(mesh.shape[axis] for axis in _mesh_axes(name, mesh))
            if size % split:
                notes.append(f"{'.'.join(map(str, path))} ({name} = {size}, {'x'.join(_mesh_axes(name, mesh))} = {split})")
    return notes


def key_names(key_path) -> tuple[str, ...]:
    """('blocks', '3', 'attn', 'q_kernel') for a pytree key path (dict keys, attributes, sequence indices)."""
    names = []
    for key in key_path:
        attribute = next((a for a in ("key", "name", "idx") if hasattr(key, a)), None)
        names.append(str(getattr(key, attribute)) if attribute else str(key))
    return tuple(names)


def shardings_like(tree: Any, params: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a tree holding copies of the params (optimizer moments): a leaf whose key path ends
    with a parameter's path and has its shape is sharded like it; everything else is replicated."""
    flat_params = jax.tree_util.tree_leaves_with_path(params)
    by_path = {key_names(path): (tuple(param.shape), sharding)
               for (path, param), sharding in zip(flat_params, jax.tree.leaves(params_shardings), strict=True)}
    replicated = NamedSharding(mesh, P())

    def pick(key_path, leaf):
        names = key_names(key_path)
        for start in range(len(names)):
            match = by_path.get(names[start:])
            if match is not None and match[0] == tuple(np.shape(leaf)):
                return match[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch rows split: the product of the rules' "batch" mesh axes (data x fsdp x expert)."""
    return math.prod(dict(mesh.shape).get(axis, 1) for axis in _RULES["batch"])


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Batch rows split over the rules' "batch" mesh axes; every other dimension whole."""
    spec = [None] * ndim
    spec[batch_axis] = _RULES["batch"]
    return NamedSharding(mesh, P(*spec))



# --- activation sharding constraints ---------------------------------------------------------------

_ACTIVE_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("diffjax_activation_mesh", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None) -> Iterator[None]:
    """Within this context, functions traced apply `constrain` (model activations) on `mesh` (None: not at all)."""
    token = _ACTIVE_MESH.set(mesh)
    try:
        yield
    finally:
        _ACTIVE_MESH.reset(token)


def active_mesh(*, single_device: bool = False) -> Mesh | None:
    """The mesh of the enclosing `activation_sharding` context (None outside one, or for one device unless
    `single_device`)."""
    mesh = _ACTIVE_MESH.get()
    return mesh if mesh is not None and (mesh.size > 1 or single_device) else None


def shard_map_by_logical_axes(f, mesh: Mesh, arrays_and_axes: Sequence[tuple[Any, Sequence[str | None]]], out_axes,
                              out_shape=None):
    """f(*arrays) run per device under jax.shard_map, each array split as its logical axes say (() for a
    scalar). For kernels the compiler cannot partition (Pallas): each device runs on its rows and heads.
    out_shape: the global output's shape (default: f evaluated abstractly on the global arrays, which an f
    using collectives cannot be)."""
    arrays = [array for array, _ in arrays_and_axes]
    in_specs = tuple(logical_spec(axes, array.shape, mesh) for array, axes in arrays_and_axes)
    out_shape = jax.eval_shape(f, *arrays) if out_shape is None else out_shape
    out_spec = logical_spec(out_axes, out_shape.shape, mesh)
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*arrays)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical axis names (a no-op outside `activation_sharding`)."""
    mesh = _ACTIVE_MESH.get()
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(logical_axes, x.shape, mesh)))

