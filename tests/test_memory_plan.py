"""benchmarks/memory_plan.py's per-device figures are what jax places and compiles: its shard sizes against the real
NamedShardings' shard shapes on 8 devices, and (slow) its params + moments against the compiled train step's
argument bytes."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import jax
import pytest

from diffjax.train.config import load_run_config

PLAN = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_plan.py"


@pytest.fixture(scope="module")
def memory_plan():
    spec = importlib.util.spec_from_file_location("memory_plan", PLAN)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclass looks itself up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sizes", [{"expert": 8}, {"expert": 2, "fsdp": 2, "tensor": 2}, {"expert": 4, "context": 2}])
def test_shard_sizes_are_the_real_shardings(memory_plan, sizes):
    from flax import nnx

    from diffjax.model import TransformerLM
    from diffjax.sharding import param_shardings
    from diffjax.train.mesh import ParallelConfig, make_mesh

    config = load_run_config("motif3/small", memory_plan.CHECK_OVERRIDES).model
    mesh = make_mesh(ParallelConfig(**{"data": 1, **sizes}), jax.devices()[:math.prod(sizes.values())])
    abstract = nnx.state(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
    real = {".".join(map(str, path)): math.prod(sharding.shard_shape(variable.shape))
            for (path, variable), sharding in zip(nnx.to_flat_state(abstract),
                                                 jax.tree.leaves(param_shardings(abstract, mesh)), strict=True)}
    planned = {path: memory_plan.shard_elements(axes, shape, {"data": 1, **sizes})
               for path, axes, shape, _ in memory_plan.abstract_params(config)}
    assert planned == real
    assert any(real[path] < math.prod(shape) for path, axes, shape, _ in memory_plan.abstract_params(config)
               if "expert" in axes)  # the experts are split, or the comparison would say little


@pytest.mark.slow
def test_params_and_moments_are_the_compiled_train_states_bytes(memory_plan):
    sizes = {"expert": 2, "fsdp": 2, "tensor": 2}
    run_config = load_run_config("motif3/small", memory_plan.CHECK_OVERRIDES)
    params = memory_plan.abstract_params(run_config.model)
    formula = 3 * memory_plan.params_bytes(params, {"data": 1, **sizes})  # params, mu and nu
    compiled, batch = memory_plan.compiled_state_bytes(run_config, sizes)
    assert 0 <= compiled - batch - formula <= 64  # the step counter and the rng key
