"""The former home of the sharding rules and the mesh set-up, kept so that old imports still work:
the rules and activation constraints are diffjax.sharding, meshes and processes diffjax.train.mesh."""

from diffjax.sharding import (  # noqa: F401
    LOGICAL_AXIS_RULES, activation_sharding, active_mesh, batch_sharding, constrain, key_names, logical_spec,
    param_shardings, shard_map_by_logical_axes, shardings_like, unsharded_dims,
)
from diffjax.train.mesh import (  # noqa: F401
    MESH_AXES, ParallelConfig, allgather_json, check_model_fits_mesh, describe, initialize_distributed, make_mesh,
    mesh_shape, process_batch_shard,
)
