"""Expert parallelism (parallel.expert, diffjax.ops.expert_parallel) on 8 simulated CPU devices: a small Motif 3-style
mixture of experts trains the same step (loss, gradient norm, gradients) as on one device for expert=8, expert=4 x
data=2, expert=2 x fsdp=2 x tensor=2 and expert=2 x context=2 x data=2; the experts and the router are split as the
rules say; the dispatch runs as all-to-alls; the small Motif 3 config trains the same losses through the real CLI;
a bad parallel.expert is one clear line."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parallel import _batch

from diffjax import parallel
from diffjax.config import ModelConfig
from diffjax.train.mesh import ParallelConfig
from diffjax.train.step import setup_sharded_state

REPO_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

# Motif 3's MoE choices (sigmoid scores, route_norm, route_scale, a selection bias, a shared expert, a dense first
# layer) at a test's size; 8 experts so that expert=8 holds one per device. Vocabulary 64: test_parallel's batch.
MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32,
                    mlp_dim=48, mlp="moe", mlp_options=dict(
                        num_experts=8, top_k=3, expert_inner=16, num_shared_experts=1, score_func="sigmoid",
                        route_norm=True, route_scale=2.0, expert_bias=True, output_scale=0.5, bias_clamp=0.5,
                        dense_first_layers=1))
MESHES = {
    "expert=8": ParallelConfig(data=1, expert=8),
    "expert=4,data=2": ParallelConfig(data=2, expert=4),
    "expert=2,fsdp=2,tensor=2": ParallelConfig(data=1, expert=2, fsdp=2, tensor=2),
    "expert=2,context=2,data=2": ParallelConfig(data=2, expert=2, context=2),  # the rows split over context too
}
# As the rules split the routed experts' [layers, E, D, I] gate kernel (expert -> expert, embed -> fsdp and
# context, mlp -> tensor) and the router's [layers, D, E] (embed -> fsdp, context and expert, as every parameter
# outside the experts).
SPECS = {"expert=8": (P(None, "expert"), P(None, "expert")),
         "expert=4,data=2": (P(None, "expert"), P(None, "expert")),
         "expert=2,fsdp=2,tensor=2": (P(None, "expert", "fsdp", "tensor"), P(None, ("fsdp", "expert"))),
         "expert=2,context=2,data=2": (P(None, "expert", "context"), P(None, ("context", "expert")))}

# Large, so that the params after the step are mostly the update: (before - after) / rate then carries the gradient
# to float32's precision (with 0.5 the params' own rounding, ~1e-9, would be 1e-5 of a small gradient).
LEARNING_RATE = 1e4


def _one_step(parallel_config: ParallelConfig):
    """(mesh, gradients, params after, metrics, the compiled program's HLO) of one SGD step of the trainer's train
    step: the gradient is (params before - params after) / learning rate."""
    mesh = parallel.make_mesh(parallel_config)
    tx = optax.sgd(LEARNING_RATE)
    training, state = setup_sharded_state(MODEL, tx, 0, mesh)
    before = jax.device_get(state["params"])
    step = training.jit_train_step(tx, lambda _: LEARNING_RATE, MODEL)
    batch = {k: jax.device_put(v, training.step_batch_sharding) for k, v in _batch().items()}
    compiled = step.lower(state, batch).compile()
    new_state, metrics = compiled(state, batch)
    grads = jax.tree.map(lambda x, y: (np.asarray(x, np.float64) - np.asarray(y, np.float64)) / LEARNING_RATE,
                         before, jax.device_get(new_state["params"]))
    return mesh, grads, new_state["params"], jax.device_get(metrics), compiled.as_text()


def _relative(x, y) -> float:
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


@pytest.fixture(scope="module")
def single_device_step():
    _, grads, _, metrics, _ = _one_step(ParallelConfig(data=1))
    return grads, metrics


def _routed_experts(params):
    (moe,) = [layer["mlp"] for name, layer in params.items()
              if name.startswith("blocks") and "router_kernel" in layer["mlp"]]
    return moe


@pytest.mark.parametrize("mesh_name", [m if m == "expert=2,fsdp=2,tensor=2" else pytest.param(m, marks=pytest.mark.slow)
                                       for m in MESHES])
def test_an_expert_parallel_step_equals_one_device(mesh_name, single_device_step, measured):
    mesh, grads, params, metrics, program = _one_step(MESHES[mesh_name])
    # diffjax.ops.expert_parallel's shard_map ran, not XLA's partitioning of the one-device sort
    assert "all-to-all" in program, f"no all-to-all in the {mesh_name} train step"
    reference_grads, reference_metrics = single_device_step
    np.testing.assert_allclose(metrics["loss"], reference_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], reference_metrics["grad_norm"], rtol=1e-5)
    # Every gradient to 1e-5 of the largest one; the MoE's own (router, experts, shared expert) to 1e-5 of their
    # tensor's largest. (Not every tensor to its own: the lambdas' gradients are small sums of large cancelling
    # terms, whose reduction order alone moves them by ~5e-4 of themselves on a dense model's data=2,fsdp=2,tensor=2.)
    scale = max(float(np.max(np.abs(y))) for y in jax.tree.leaves(reference_grads))
    worst_overall = worst_moe = 0.0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference_grads), strict=True):
        name = jax.tree_util.keystr(path)
        if not np.any(y):  # expert_bias: chooses experts, never trained
            assert not np.any(x), name
            continue
        overall = float(np.max(np.abs(x - y))) / scale
        worst_overall = max(worst_overall, overall)
        assert overall < 1e-5, f"{name}'s gradient differs by {overall} of the largest gradient on {mesh_name}"
        if "expert" in name or "router" in name:
            own = _relative(x, y)
            worst_moe = max(worst_moe, own)
            assert own < 1e-5, f"{name}'s gradient differs by {own} of its largest on {mesh_name}"
    measured(f"gradients max |{mesh_name} - one device| / max gradient", worst_overall, 1e-5)
    measured(f"MoE gradients max rel |{mesh_name} - one device|", worst_moe, 1e-5)
    moe = _routed_experts(params)
    for array, spec in zip((moe["expert_gate_kernel"], moe["router_kernel"]), SPECS[mesh_name], strict=True):
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (mesh_name, array.sharding.spec)


def test_a_bad_parallel_expert_is_one_clear_line():
    mesh = parallel.make_mesh(ParallelConfig(data=1, expert=8))
    twelve = MODEL.replace(mlp_options=dataclasses.replace(MODEL.mlp_options, num_experts=12))
    with pytest.raises(ValueError, match=r"^parallel.expert \(8\) must divide model.mlp_options.num_experts \(12\): "
                                         r"expert parallelism places whole experts; use parallel.expert in "
                                         r"\[1, 2, 3, 4, 6, 12\]$"):
        parallel.check_model_fits_mesh(twelve, mesh)
    with pytest.raises(ValueError, match=r"^parallel.expert \(8\) has nothing to split in this model \(attention "
                                         r"'diff', mlp 'gated', residual 'plain'\); use parallel.expert=1 \(or "
                                         r"parallel.data\), or a kind it splits: model.mlp=moe$"):
        parallel.check_model_fits_mesh(MODEL.replace(mlp="gated", mlp_options=None), mesh)
    with pytest.raises(ValueError, match=r"^parallel.expert must be a positive integer or -1 \(fill\), got 0$"):
        ParallelConfig(expert=0)


def test_eval_refuses_a_mesh_the_experts_do_not_split_over_in_one_line(tmp_path):
    """diffjax-eval --mesh expert=4 of a 6-expert model: the trainer's check, before loading. Before: 18 lines of
    shard_map's error when the first batch was scored (issue 55 item 10)."""
    pytest.importorskip("lm_eval")
    from flax import nnx

    from diffjax.checkpoint import save_params
    from diffjax.eval.lm_eval_adapter import load_for_eval, parse_mesh
    from diffjax.model import TransformerLM

    six = MODEL.replace(vocab_size=257, mlp_options=dataclasses.replace(MODEL.mlp_options, num_experts=6))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(TransformerLM(six, rngs=nnx.Rngs(0)), nnx.Param)))
    save_params(tmp_path / "run", params, six)
    with pytest.raises(ValueError, match=r"^mesh expert=4: expert \(4\) must divide model.mlp_options.num_experts "
                                         r"\(6\): expert parallelism places whole experts; use expert in \[1, 2, 3, 6\]$"):
        load_for_eval(tmp_path / "run", mesh=parse_mesh("expert=4"), tokenizer="byte")


def _train_small(run_dir, *mesh: str):
    """The real trainer CLI on the shipped motif3/small (GDLA, mHC, 6 experts top 2 + a shared one), 2 steps."""
    command = [sys.executable, "train.py", "--config", "motif3/small",
               "train.steps=2", f"train.run_dir={run_dir}", "train.eval_every=0", "train.sample_tokens=0", *mesh]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


@pytest.mark.slow
def test_the_small_motif3_trains_the_same_losses_with_experts_split_and_refuses_a_bad_split(tmp_path):
    def losses(done):
        assert done.returncode == 0, done.stdout + done.stderr
        return re.findall(r"^step\s+\d+/\d+ \| loss ([\d.]+) \| grad norm ([\d.]+)", done.stdout, flags=re.M)

    one = losses(_train_small(tmp_path / "one", "parallel.data=1"))
    split = _train_small(tmp_path / "split", "parallel.expert=2", "parallel.data=2", "parallel.tensor=2")
    assert "mesh: data=2 x fsdp=1 x context=1 x tensor=2 x expert=2 (8 devices)" in split.stdout, split.stdout
    assert len(one) == 2 and losses(split) == one
    bad = _train_small(tmp_path / "bad", "parallel.expert=4", "parallel.data=2")
    assert bad.returncode != 0
    assert (bad.stdout + bad.stderr).strip().splitlines()[-1] == (
        "error: parallel.expert (4) must divide model.mlp_options.num_experts (6): expert parallelism places whole "
        "experts; use parallel.expert in [1, 2, 3, 6]"), bad.stdout + bad.stderr
