"""The device mesh and multi-process set-up: meshes from a ParallelConfig, which batch rows a process loads, an
all-gather of JSON values, and jax.distributed start-up. The axes and ParallelConfig: diffjax.mesh_axes; which
tensors each mesh axis splits: diffjax.sharding."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from diffjax.config import BLOCK_PARTS, ModelConfig, block_rows
from diffjax.mesh_axes import DISTRIBUTED_MODES, MESH_AXES, ParallelConfig  # noqa: F401 (read from here too)

log = logging.getLogger(__name__)

# --- meshes ------------------------------------------------------------------------------------


def mesh_shape(config: ParallelConfig, num_devices: int) -> dict[str, int]:
    """{axis: size} with a -1 axis filled; errors name the axes and the device count."""
    sizes = {axis: getattr(config, axis) for axis in MESH_AXES}
    fixed = math.prod(size for size in sizes.values() if size != -1)
    described = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
    if num_devices % fixed:
        raise ValueError(
            f"the mesh {described} needs a multiple of {fixed} devices, but there are {num_devices}; "
            f"choose {' / '.join(f'parallel.{axis}' for axis in MESH_AXES)} whose product divides {num_devices}"
        )
    for axis, size in sizes.items():
        if size == -1:
            sizes[axis] = num_devices // fixed
    return sizes


def make_mesh(config: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh, its axes in MESH_AXES order. With one process the mesh may use fewer devices than exist
    (the first ones); across processes it must use them all (every process takes part in each step)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(config, len(devices))
    count = math.prod(sizes.values())
    if count < len(devices):
        if jax.process_count() > 1:
            raise ValueError(
                f"the mesh {sizes} uses {count} of {len(devices)} devices; a multi-process run must use all of "
                f"them: set one of {' / '.join(f'parallel.{axis}' for axis in MESH_AXES)} to -1"
            )
        log.warning("the mesh %s uses %d of the %d devices", sizes, count, len(devices))
        devices = devices[:count]
    return Mesh(_device_grid(tuple(sizes[axis] for axis in MESH_AXES), devices), MESH_AXES)


def _device_grid(shape: tuple[int, ...], devices: list) -> np.ndarray:
    """Devices arranged as the mesh: topology-aware on TPU / GPU (ICI rings, NVLink islands); on CPU
    (no topology) in the given, process-major order."""
    if devices[0].platform != "cpu":
        from jax.experimental import mesh_utils

        try:
            return mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            pass
    return np.asarray(devices).reshape(shape)


def check_model_fits_mesh(config: ModelConfig, mesh: Mesh) -> None:
    """Tensor parallelism splits whole heads: parallel.tensor must divide the (kv) head counts. A mesh axis that only
    some kinds give a meaning to (their rows' training.mesh_axes: expert parallelism splits a mixture of experts)
    needs such a kind in the model, and each kind's facet checks the mesh fits it (parallel.expert must divide the
    experts)."""
    _check_kind_axes(config, mesh)
    tensor = mesh.shape["tensor"]
    for name in ("num_heads", "num_kv_heads"):
        heads = getattr(config, name)
        if heads % tensor:
            divisors = [n for n in range(1, heads + 1) if heads % n == 0]
            raise ValueError(
                f"parallel.tensor ({tensor}) must divide model.{name} ({heads}): tensor parallelism splits whole "
                f"heads; use parallel.tensor in {divisors}"
            )


def _check_kind_axes(config: ModelConfig, mesh: Mesh) -> None:
    from diffjax.model.facets import model_facets  # (the model's modules load only when a mesh is checked)

    rows = block_rows(config)
    used = {axis for block in rows for axis in block.row.training.mesh_axes}
    for axis, size in mesh.shape.items():
        if size > 1 and axis not in used:
            offered = [f"{part}={row.name}" for part, table in BLOCK_PARTS.items() for row in table.rows()
                       if axis in row.training.mesh_axes]
            if offered:
                parts = ", ".join(f"{block.part} {block.row.name!r}" for block in rows if block.part in BLOCK_PARTS)
                raise ValueError(f"parallel.{axis} ({size}) has nothing to split in this model ({parts}); use "
                                 f"parallel.{axis}=1 (or parallel.data), or a kind it splits: "
                                 + ", ".join(f"model.{kind}" for kind in offered))
    problems = [line for facet in model_facets(config) for line in facet.mesh_problems(dict(mesh.shape))]
    if problems:
        raise ValueError("; ".join(problems))


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items()) + f" ({mesh.size} devices)"



def process_batch_shard(sharding: NamedSharding, global_shape: Sequence[int], batch_axis: int = 0) -> tuple[int, int]:
    """(shard index, shard count): which contiguous block of the global batch rows this process's
    devices hold, so that each process loads only those rows (processes holding the same rows, as
    when a tensor axis spans processes, get the same index and load the same data)."""
    rows = global_shape[batch_axis]
    ranges = sorted({
        (index[batch_axis].start or 0, rows if index[batch_axis].stop is None else index[batch_axis].stop)
        for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values()
    })
    start, stop = ranges[0][0], ranges[-1][1]
    contiguous = all(previous[1] == following[0] for previous, following in zip(ranges, ranges[1:]))
    if not contiguous or rows % (stop - start) or start % (stop - start):
        raise ValueError(f"this process's devices hold batch rows {ranges}, not one aligned contiguous block")
    return start // (stop - start), rows // (stop - start)



# --- multi-process ---------------------------------------------------------------------------------


def allgather_json(value: Any) -> list:
    """Every process's JSON-serialisable `value`, in process order (a collective: all processes call it)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(encoded))))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(encoded)] = encoded
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:length]).decode()) for row, length in zip(rows, lengths)]


# --- multi-process start-up ------------------------------------------------------------------------


def _cluster_detected() -> str | None:
    """The environment that announces a multi-process job, if any (jax.distributed reads it)."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and env.get("SLURM_JOB_ID"):
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return "multi-host TPU"
    return None


def initialize_distributed(config: ParallelConfig) -> bool:
    """Start jax.distributed when the config or the environment asks for it; True if it is running.

    Must run before anything touches a JAX backend. Explicit fields win over what jax detects.
    """
    if config.distributed == "off" or jax.distributed.is_initialized():
        return jax.distributed.is_initialized()
    detected = _cluster_detected()
    if config.distributed == "auto" and config.coordinator_address is None and detected is None:
        return False
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
    )
    log.info("jax.distributed: process %d of %d (%s)", jax.process_index(), jax.process_count(),
             detected or "parallel.coordinator_address")
    return True
