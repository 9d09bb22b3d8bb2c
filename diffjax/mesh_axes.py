"""The device mesh's axes, one table (AXES) that every other list of them is read from: the mesh's axis order
(diffjax.train.mesh), the sharding rules (diffjax.sharding: which logical axes each mesh axis splits), the batch axes
(batches, data loading, the expert-parallel row split in diffjax.ops.expert_parallel), and the `parallel` config
section that sizes them (ParallelConfig, here so that a new axis is a row and a field in one file). No jax: the run
config imports it.

A new mesh axis: a row in AXES (where in the device grid, which logical axes it splits: "batch" makes it a batch axis)
and a ParallelConfig field of the same name. An axis only some kinds give a meaning to (the MoE's "expert") is also
named in those kinds' rows (`kinds.Training.mesh_axes`), which the mesh checks read.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    name: str
    splits: tuple[str, ...]  # the logical axes (diffjax.sharding's names) this mesh axis splits


# In device-grid order, slowest links first: expert last (beside tensor): the MoE's all-to-all, like tensor's
# all-reduces, wants the fastest links (MaxText's order).
AXES = (
    MeshAxis("data", splits=("batch",)),  # data parallel: params replicated
    MeshAxis("fsdp", splits=("batch", "embed")),  # ZeRO-3: params and optimizer state split too
    MeshAxis("context", splits=("length", "embed")),  # the sequence; params split as over fsdp
    MeshAxis("tensor", splits=("vocab", "heads", "kv_heads", "mlp", "act_heads", "act_kv_heads", "act_mlp",
                               "act_vocab")),  # Megatron style
    MeshAxis("expert", splits=("expert", "batch", "embed")),  # the routed experts; elsewhere as fsdp
)
MESH_AXES = tuple(axis.name for axis in AXES)
DISTRIBUTED_MODES = ("auto", "on", "off")


def splitting(logical: str, axes: tuple[MeshAxis, ...] = AXES) -> tuple[str, ...]:
    """The mesh axes that split a logical axis, in mesh order (the order a dimension split over several is laid out)."""
    return tuple(axis.name for axis in axes if logical in axis.splits)


BATCH_AXES = splitting("batch")  # the axes that split a batch's rows


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (axes data x fsdp x context x tensor x expert; one of them may be -1: what the devices leave)
    and multi-process start-up. See diffjax/sharding.py for which tensors each axis splits."""

    data: int = -1
    """Mesh axis that splits the batch, params replicated (-1: the devices the other axes leave)."""
    fsdp: int = 1
    """Mesh axis that splits the batch and the params / optimizer state too (gathered per layer; ZeRO-3 style)."""
    context: int = 1
    """Mesh axis that splits the sequence (context parallelism); params / optimizer state split as over fsdp."""
    tensor: int = 1
    """Mesh axis that splits heads, kv heads, the MLP width and the vocabulary (Megatron style)."""
    expert: int = 1
    """Expert parallelism: the MoE's routed experts split over this many devices (model.mlp_options.num_experts must
    be a multiple), tokens sent to their experts' devices by an all-to-all; the batch splits over it too (a data axis
    for everything but the routed experts)."""
    distributed: str = "auto"
    """jax.distributed: "auto" starts it when coordinator_address is set or a cluster environment
    (JAX_COORDINATOR_ADDRESS, SLURM, Open MPI, a multi-host TPU slice) is detected; "on" always; "off" never."""
    coordinator_address: str | None = None
    """host:port of process 0 (without a cluster environment to read it from)."""
    num_processes: int | None = None
    """Processes in the job (with coordinator_address); None: from the cluster environment."""
    process_id: int | None = None
    """This process's index, 0 .. num_processes - 1 (with coordinator_address); None: from the cluster environment."""

    def __post_init__(self):
        sizes = {name: getattr(self, name) for name in MESH_AXES}
        for name, size in sizes.items():
            if not (isinstance(size, int) and not isinstance(size, bool) and (size >= 1 or size == -1)):
                raise ValueError(f"parallel.{name} must be a positive integer or -1 (fill), got {size!r}")
        if list(sizes.values()).count(-1) > 1:
            filled = [f"parallel.{name}" for name, size in sizes.items() if size == -1]
            raise ValueError(f"only one mesh axis may be -1 (fill the remaining devices); got {', '.join(filled)}")
        if self.distributed not in DISTRIBUTED_MODES:
            raise ValueError(f"parallel.distributed must be one of {DISTRIBUTED_MODES}, got {self.distributed!r}")
        for name in ("num_processes", "process_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= (1 if name == "num_processes" else 0)):
                raise ValueError(f"parallel.{name} must be {'>= 1' if name == 'num_processes' else '>= 0'} or None, got {value!r}")
