"""A mixture of experts' dispatch: each token's top_k (token, expert) rows through their experts, one device or
split over the mesh's `expert` axis (expert parallelism).

`routed_on_one_device`: the rows sorted by expert, each expert's rows one group of jax.lax.ragged_dot (dropless, the
same program whatever the routing). Also what runs when the mesh has no expert axis (XLA partitions it then).

`routed_expert_parallel` (mesh axis "expert" of size S > 1, experts E = S x E_local): under jax.shard_map every
device takes its own rows (tokens split over every mesh axis: the batch axes, then the others, ROW_AXES, so no device
repeats another's expert work) and
  1. sorts its rows by expert and packs them into a send buffer [S, C, D], slot s holding the rows for the
     experts of expert-shard s (C = n x min(top_k, E_local) for n local tokens: the most one shard can get, as a
     token's top_k experts are distinct, so no row is ever dropped and nothing needs counting);
  2. all-to-all over "expert": each device receives [S, C, D], the rows every peer sends its E_local experts;
  3. runs them through its experts (ragged_dot over E_local groups; empty slots are masked out);
  4. all-to-all back, and sums each token's top_k outputs times their routing weights.
The experts' weights enter split over "expert" only: fsdp / context / tensor, which split them at rest, are gathered
by XLA before the layer as fsdp gathers any weight (and their gradients reduce-scattered after).

Why not let XLA partition `routed_on_one_device` over an expert-sharded weight (GSPMD): its argsort and the
gathers by sorted position are over the global rows, so XLA all-gathers every token's rows and the routing onto
every device and runs all experts' groups on all of them: benchmarks/moe_dispatch.py measures the collectives of
both. The buffer's static size is the price of a dropless dense all-to-all: S x C rows per device, S x the rows
sent on average. jax.lax.ragged_all_to_all would send only the rows routed (counts exchanged first), but XLA:CPU
cannot run it (UNIMPLEMENTED), so it is not the path tested here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diffjax.mesh_axes import AXES, MeshAxis, splitting

EXPERT_AXIS = "expert"


def row_order(axes: tuple[MeshAxis, ...] = AXES) -> tuple[str, ...]:
    """Every mesh axis, the batch axes first (the rows' existing split), then the rest in mesh order."""
    batch = splitting("batch", axes)
    return batch + tuple(axis.name for axis in axes if axis.name not in batch)


ROW_AXES = row_order()

# run_experts(params, x_RD, expert_R, group_sizes_E) -> out_RD: the experts on rows sorted by expert (params: the
# experts' arrays, leading axis E; rows past sum(group_sizes) may hold anything, they are discarded)
RunExperts = Callable[[dict, jax.Array, jax.Array, jax.Array], jax.Array]


def routed_on_one_device(run_experts: RunExperts, x_ND, experts_NK, weights_NK, params: dict, num_experts: int):
    """sum_k weights[n, k] expert_{experts[n, k]}(x[n]) [N, D]: the (token, expert) rows sorted by expert, each
    expert's rows one group of ragged_dot."""
    dtype, (N, K) = x_ND.dtype, experts_NK.shape
    expert_R = experts_NK.reshape(N * K)  # R = N K rows, token-major
    order_R = jnp.argsort(expert_R, stable=True)
    token_R, expert_R = order_R // K, expert_R[order_R]
    group_sizes_E = jnp.bincount(expert_R, length=num_experts).astype(jnp.int32)
    out_RD = run_experts(params, x_ND[token_R], expert_R, group_sizes_E)
    out_RD = out_RD * weights_NK.reshape(N * K)[order_R][:, None].astype(dtype)
    return jnp.zeros_like(x_ND).at[token_R].add(out_RD)


def row_axes(mesh: Mesh | None, rows: int) -> tuple[str, ...] | None:
    """The mesh axes splitting the rows in `routed_expert_parallel`, or None where it does not apply: no mesh, an
    expert axis of 1, or rows that the axes (of size > 1) do not divide."""
    sizes = dict(mesh.shape) if mesh is not None else {}
    if sizes.get(EXPERT_AXIS, 1) == 1:
        return None
    axes = tuple(axis for axis in ROW_AXES if sizes.get(axis, 1) > 1)
    return None if rows % math.prod(sizes[axis] for axis in axes) else axes


def routed_expert_parallel(run_experts: RunExperts, x_ND, experts_NK, weights_NK, params: dict, mesh: Mesh):
    """`routed_on_one_device`'s result with the experts split over the mesh's expert axis (the module docstring);
    needs `row_axes(mesh, N)`."""
    axes = row_axes(mesh, x_ND.shape[0])
    shards, num_experts = mesh.shape[EXPERT_AXIS], jax.tree.leaves(params)[0].shape[0]
    rows = P(axes, None)
    param_specs = jax.tree.map(lambda a: P(EXPERT_AXIS, *(None,) * (a.ndim - 1)), params)
    local = functools.partial(_dispatch_combine, run_experts=run_experts, shards=shards,
                              local_experts=num_experts // shards)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, param_specs), out_specs=rows,
                         check_vma=False)(x_ND, experts_NK, weights_NK, params)


def _dispatch_combine(x_nD, experts_nK, weights_nK, params, *, run_experts, shards: int, local_experts: int):
    """One device's rows: to their experts' shards [S, C, D], through them there, back, weighted and summed."""
    dtype, (n, K), D = x_nD.dtype, experts_nK.shape, x_nD.shape[1]
    expert_R = experts_nK.reshape(n * K)
    order_R = jnp.argsort(expert_R, stable=True)  # by expert, hence by shard
    token_R, expert_R = order_R // K, expert_R[order_R]
    shard_R = expert_R // local_experts
    count_S = jnp.bincount(shard_R, length=shards)
    slot_R = jnp.arange(n * K) - (jnp.cumsum(count_S) - count_S)[shard_R]  # the row's place in its shard's slot
    capacity = n * min(K, local_experts)  # dropless: a token's top_k experts are distinct
    send_SCD = jnp.zeros((shards, capacity, D), dtype).at[shard_R, slot_R].set(x_nD[token_R])
    send_SC = jnp.full((shards, capacity), local_experts, jnp.int32).at[shard_R, slot_R].set(
        expert_R - shard_R * local_experts)  # local expert ids; local_experts marks an empty slot
    recv_SCD = jax.lax.all_to_all(send_SCD, EXPERT_AXIS, 0, 0, tiled=True)
    recv_SC = jax.lax.all_to_all(send_SC, EXPERT_AXIS, 0, 0, tiled=True)
    done_SCD = _run_received(run_experts, recv_SCD, recv_SC, params, local_experts)
    back_SCD = jax.lax.all_to_all(done_SCD, EXPERT_AXIS, 0, 0, tiled=True)
    out_RD = back_SCD[shard_R, slot_R] * weights_nK.reshape(n * K)[order_R][:, None].astype(dtype)
    return jnp.zeros_like(x_nD).at[token_R].add(out_RD)


def _run_received(run_experts: RunExperts, x_SCD, local_SC, params: dict, local_experts: int):
    """The received rows through this device's experts, in place; empty slots give zeros."""
    S, C, D = x_SCD.shape
    local_Q = local_SC.reshape(S * C)
    order_Q = jnp.argsort(local_Q, stable=True)  # empty slots (id local_experts) last, in no group
    local_Q = local_Q[order_Q]
    group_sizes_E = jnp.bincount(local_Q, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    out_QD = run_experts(params, x_SCD.reshape(S * C, D)[order_Q], jnp.minimum(local_Q, local_experts - 1),
                         group_sizes_E)
    out_QD = jnp.where((local_Q < local_experts)[:, None], out_QD, 0)
    return jnp.zeros_like(out_QD).at[order_Q].set(out_QD).reshape(S, C, D)
