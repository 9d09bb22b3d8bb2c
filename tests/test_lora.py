"""LoRA (diffjax.lora): merged params equal the base at B = 0 and W + (alpha/r) A @ B otherwise, for every
attention kind; gradients reach only the trainable leaves; in the trainer, the optimizer state covers only the
adapters and the chosen base params, checkpoints hold only those, resume is exact and refuses a changed base;
the merged export loads in transformers and computes what the LoRA model does."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import lora
from diffjax.config import ModelConfig
from diffjax.model import TransformerLM

KINDS = {  # tiny, GQA where the kind allows it
    "diff": dict(num_heads=4, num_kv_heads=2),
    "standard": dict(num_heads=4, num_kv_heads=2),
    "diff_v2": dict(num_heads=4, num_kv_heads=2),
    "shared_diff": dict(num_heads=4, num_kv_heads=2),
}


def _model(kind: str):
    config = ModelConfig(attention=kind, d_model=32, num_layers=2, vocab_size=64, max_seq_len=16, **KINDS[kind])
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    return config, graphdef, nnx.to_pure_dict(state)


def _logits(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def _numpy_merged(params, adapters, config: lora.LoraConfig):
    """W + (alpha / r) A @ B written out in numpy, one layer (and one routed expert) at a time."""
    merged = jax.tree.map(np.asarray, params)
    for path, pair in lora._adapter_pairs(adapters):
        node = merged
        for key in path[:-1]:
            node = node[key]
        w = node[path[-1]]
        a, b = np.asarray(pair["lora_a"], np.float64), np.asarray(pair["lora_b"], np.float64)
        update = np.stack([a[i] @ b[i] if a.ndim == 3 else np.stack([a[i, e] @ b[i, e] for e in range(a.shape[1])])
                           for i in range(w.shape[0])]).reshape(w.shape)
        node[path[-1]] = (w.astype(np.float64) + config.alpha / config.rank * update).astype(w.dtype)
    return merged


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "diff" else k for k in KINDS])
def test_merge_is_the_base_at_zero_and_w_plus_ab_otherwise(kind):
    model_config, graphdef, params = _model(kind)
    config = lora.LoraConfig(rank=4, alpha=8.0, targets=("attention", "mlp"))
    specs = lora.kernel_specs(model_config, config)
    names = {path[-1] for path in specs}
    assert {"o_kernel", "v_kernel", "gate_kernel", "up_kernel", "down_kernel"} <= names
    assert ({"q_base", "k_base"} if kind == "shared_diff" else {"q_kernel", "k_kernel"}) <= names
    adapters = lora.init_adapters(specs, config, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, model_config.vocab_size)
    run = jax.jit(_logits, static_argnums=0)

    base = run(graphdef, params, tokens)
    np.testing.assert_array_equal(np.asarray(run(graphdef, lora.merge(params, adapters, config), tokens)), np.asarray(base))

    # random B: the merged model is the model with W + (alpha / r) A @ B computed independently
    keys = iter(jax.random.split(jax.random.key(3), 64))
    adapters = jax.tree.map(lambda x: x if x.any() else 0.05 * jax.random.normal(next(keys), x.shape), adapters)
    merged = lora.merge(params, adapters, config)
    assert jax.tree.map(lambda x: x.dtype, merged) == jax.tree.map(lambda x: x.dtype, params)
    expected = run(graphdef, _numpy_merged(params, adapters, config), tokens)
    got = run(graphdef, merged, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got) - np.asarray(base)).max() > 1e-3  # the adapters do change the model


def test_gradients_reach_only_the_trainable_leaves():
    model_config, graphdef, params = _model("diff")
    config = lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down"), trainable=("lambda_",))
    specs = lora.kernel_specs(model_config, config)
    assert sorted(path[-1] for path in specs) == ["down_kernel", "q_kernel", "v_kernel"]
    adapters = lora.init_adapters(specs, config, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B != 0, else A's gradient is 0
    chosen, frozen = lora.split_base(params, config)
    assert sorted(chosen["blocks"]["attn"]) == ["lambda_k1", "lambda_k2", "lambda_q1", "lambda_q2"]
    assert "lambda_q1" not in frozen["blocks"]["attn"] and "q_kernel" in frozen["blocks"]["attn"]
    trainable = lora.trainable_params(adapters, chosen)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, model_config.vocab_size)

    def loss(trainable, frozen):
        logits = nnx.merge(graphdef, lora.model_params(trainable, frozen, config))(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    grads = jax.jit(jax.grad(loss))(trainable, frozen)  # only the first argument is differentiated
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)
    assert lora.join(frozen, chosen).keys() == params.keys()
    assert jax.tree.structure(lora.join(frozen, chosen)) == jax.tree.structure(params)


def test_config_errors_name_the_field_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"lora.targets .*q, k, v, o, q_down, q_up, kv_down, kv_up, gate, up, down, "
                                         r"experts, attention, mlp.*'qkv' unknown"):
        lora.LoraConfig(rank=4, targets=("qkv",))
    with pytest.raises(ValueError, match="lora.rank must be an integer >= 0"):
        lora.LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="lora.alpha must be a number > 0"):
        lora.LoraConfig(rank=4, alpha=0)
    with pytest.raises(ValueError, match="lora.trainable: '\\(' is not a regular expression"):
        lora.LoraConfig(rank=4, trainable=("(",))
    assert lora.LoraConfig(rank=4, targets=("attention", "q")).kernel_names == (
        "q_kernel", "q_base", "k_kernel", "k_base", "v_kernel", "o_kernel", "q_down_kernel", "q_up_kernel",
        "kv_down_kernel", "kv_up_kernel")


def test_a_run_directory_names_its_lora_settings_and_base_in_config_yaml(tmp_path):
    """lora.run_settings reads a run's config.yaml (what load_model and the export need to merge a LoRA run)."""
    config_file = tmp_path / "config.yaml"
    assert lora.run_settings(config_file) is None  # no config.yaml: not a LoRA run
    config_file.write_text("model: {}\nlora: {rank: 0}\n")
    assert lora.run_settings(config_file) is None
    config_file.write_text("lora: {rank: 2, alpha: 4.0, targets: [q, v]}\ntrain: {init_from: /base}\n")
    assert lora.run_settings(config_file) == (lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "v")), "/base")
    config_file.write_text("lora: {rank: 2, alpha: 4.0, rnak: 3}\ntrain: {init_from: /base}\n")
    with pytest.raises(ValueError, match=rf"^{config_file}: unknown config key lora.rnak \(did you mean lora.rank\?\); valid keys under lora: alpha, "
                                         "rank, targets, trainable$"):
        lora.run_settings(config_file)
    config_file.write_text("lora: {rank: 2}\n")
    with pytest.raises(ValueError, match=rf"^{config_file}: a LoRA run \(lora.rank 2\) without train.init_from"):
        lora.run_settings(config_file)


def test_adapters_are_sharded_like_their_kernels_input_and_output_axes():
    from diffjax.train.mesh import ParallelConfig, make_mesh

    mesh = make_mesh(ParallelConfig(data=1, fsdp=2, tensor=2))
    model_config, _, _ = _model("diff")
    config = lora.LoraConfig(rank=4, targets=("q", "o", "down"))
    shardings = lora.adapter_shardings(lora.kernel_specs(model_config, config), config, mesh)
    specs = {path: tuple(s.spec) for path, s in lora._flat(shardings)}
    assert specs == {
        ("blocks", "attn", "q_kernel", "lora_a"): (None, "fsdp", None),  # [L, embed, r]
        ("blocks", "attn", "q_kernel", "lora_b"): (None, None, "tensor"),  # [L, r, heads x 2 x head_dim]
        ("blocks", "attn", "o_kernel", "lora_a"): (None, "tensor", None),  # [L, heads x 2 head_dim, r]
        ("blocks", "attn", "o_kernel", "lora_b"): (None, None, "fsdp"),  # [L, r, embed]
        ("blocks", "mlp", "down_kernel", "lora_a"): (None, "tensor", None),  # [L, mlp, r]
        ("blocks", "mlp", "down_kernel", "lora_b"): (None, None, "fsdp"),
    }


def test_checksums_see_any_change():
    params = {"a": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": {"c": jnp.ones((4,), jnp.bfloat16)}}
    same = lora.checksums(jax.tree.map(lambda x: x + 0, params))
    assert lora.changed_leaves(lora.checksums(params), same) == []
    swapped = {"a": params["a"][:, ::-1], "b": params["b"]}
    assert lora.changed_leaves(lora.checksums(params), lora.checksums(swapped)) == ["a"]
    nudged = {"a": params["a"], "b": {"c": params["b"]["c"].at[3].set(1.0078125)}}
    assert lora.changed_leaves(lora.checksums(params), lora.checksums(nudged)) == ["b.c"]


# ------------------------------------------------------------------------------------------------
# the trainer: lora.rank > 0 fine-tunes train.init_from


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A base model (params-only, as a conversion writes it), then LoRA runs from it: 2N steps straight
    (a checkpoint every step) and N steps, stop, N more."""
    from diffjax.params_checkpoint import save_params
    from diffjax.train import train
    from test_trainer import _config

    root = tmp_path_factory.mktemp("lora")
    model_config = _config(root / "unused").model
    params = nnx.to_pure_dict(nnx.state(TransformerLM(model_config, rngs=nnx.Rngs(7)), nnx.Param))
    save_params(root / "base", params, model_config)
    n = 3
    common = [f"train.init_from={root / 'base'}", "lora.rank=4", "lora.alpha=8", "lora.targets=[attention, down]",
              "lora.trainable=[lambda_]", "optim.decay_steps=6", "optim.lr=1e-2"]

    def config(name, *overrides):
        return _config(root / name, *common, *overrides)

    logs = {name: [] for name in ("straight", "first", "second")}
    results = {
        "straight": train(config("straight", f"train.steps={2 * n}", "checkpoint.every=1", "checkpoint.keep=10"),
                          log=logs["straight"].append),
        "first": train(config("resumed", f"train.steps={n}", "checkpoint.every=100", "train.sample_tokens=0"),
                       log=logs["first"].append),
        "second": train(config("resumed", f"train.steps={2 * n}", "checkpoint.every=100"), log=logs["second"].append),
    }
    base_model = TransformerLM(model_config, rngs=nnx.Rngs(7))
    return dict(root=root, n=n, config=config, results=results, logs=logs, base_params=params, model_config=model_config,
                base_logits=lambda tokens: base_model(tokens))


@pytest.mark.slow
@pytest.mark.both_legs
def test_lora_training_state_checkpoints_and_exact_resume(lora_runs):
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer

    root, n, results, logs = lora_runs["root"], lora_runs["n"], lora_runs["results"], lora_runs["logs"]
    assert any(line.startswith("LoRA: rank 4, alpha 8 on down_kernel, k_kernel, o_kernel, q_kernel, v_kernel")
               for line in logs["straight"]), logs["straight"]
    assert any(f"(step {n})" in line and line.startswith("resumed from") for line in logs["second"]), logs["second"]
    straight, first, second = results["straight"], results["first"], results["second"]
    assert {**first.losses, **second.losses} == straight.losses  # exact, step by step
    assert straight.losses[2 * n] < straight.losses[1]  # it learns
    assert second.eval_losses[2 * n] == straight.eval_losses[2 * n] and second.sample == straight.sample

    saved = Checkpointer(root / "straight", CheckpointConfig()).read(2 * n)["state"]
    other = Checkpointer(root / "resumed", CheckpointConfig()).read(2 * n)["state"]
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # only the trainable part is saved and optimized: the adapters and the lambda vectors
    params = saved["params"]
    assert sorted(params) == ["base", "lora"]
    assert sorted(params["lora"]["blocks"]["attn"]) == ["k_kernel", "o_kernel", "q_kernel", "v_kernel"]
    assert sorted(params["lora"]["blocks"]["mlp"]) == ["down_kernel"]
    assert sorted(params["base"]["blocks"]["attn"]) == ["lambda_k1", "lambda_k2", "lambda_q1", "lambda_q2"]
    assert list(params["base"]) == ["blocks"]
    trainable = sum(np.size(x) for x in jax.tree.leaves(params))
    adapters = sum(np.size(x) for x in jax.tree.leaves(params["lora"]))
    assert adapters == 2 * 4 * (4 * (32 + 32) + (64 + 32))  # L x r x (in + out): q, k, v, o 32 -> 32, down 64 -> 32
    moments = [x for x in jax.tree.leaves(saved["opt_state"]) if np.ndim(x) > 0]
    assert sum(np.size(x) for x in moments) == 2 * trainable  # AdamW's mu and nu; the rest are scalar counts
    base = lora_runs["base_params"]
    np.testing.assert_array_equal(params["base"]["blocks"]["attn"]["lambda_q1"].shape,
                                  base["blocks"]["attn"]["lambda_q1"].shape)
    assert not np.array_equal(params["base"]["blocks"]["attn"]["lambda_q1"], base["blocks"]["attn"]["lambda_q1"])
    assert np.abs(params["lora"]["blocks"]["attn"]["q_kernel"]["lora_b"]).max() > 0


@pytest.mark.slow
def test_lora_resume_refuses_a_changed_base_or_changed_lora_settings(lora_runs, tmp_path):
    import shutil

    from diffjax.params_checkpoint import save_params
    from diffjax.train import train
    from test_trainer import _config

    root, n, config = lora_runs["root"], lora_runs["n"], lora_runs["config"]
    with pytest.raises(ValueError, match="lora.rank > 0 fine-tunes a base model: set train.init_from"):
        _config(tmp_path / "x", "lora.rank=4")
    with pytest.raises(ValueError, match=r"lora.trainable: 'lamda_' matches no parameter of this model; its "
                                         r"parameters are .*blocks.attn.lambda_q1"):
        train(config("typo", "lora.trainable=[lamda_]"), log=lambda _: None)
    with pytest.raises(ValueError, match=r"different LoRA settings \(lora.alpha differ"):
        train(config("resumed", f"train.steps={3 * n}", "lora.alpha=4"), log=lambda _: None)

    shutil.copytree(root / "resumed", tmp_path / "resumed")
    changed = jax.tree.map(np.asarray, lora_runs["base_params"])
    changed["blocks"]["mlp"]["up_kernel"] = changed["blocks"]["mlp"]["up_kernel"] + np.float32(1e-3)
    save_params(tmp_path / "base", changed, lora_runs["model_config"])
    moved = config("resumed", f"train.steps={3 * n}", f"train.init_from={tmp_path / 'base'}",
                   f"train.run_dir={tmp_path / 'resumed'}")
    with pytest.raises(ValueError, match=rf"the base model changed .*train.init_from {tmp_path / 'base'} now holds "
                                         r"different blocks.mlp.up_kernel; resume with the base"):
        train(moved, log=lambda _: None)


# ------------------------------------------------------------------------------------------------
# export: the adapters merged into the base


@pytest.mark.slow
def test_merged_export_loads_in_transformers_and_equals_the_lora_model(lora_runs, tmp_path):
    from diffjax.convert.__main__ import main
    from diffjax.convert.hf_directories import diffjax_to_hf
    from diffjax.params_checkpoint import load_model
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer, restore_params

    root, n, model_config = lora_runs["root"], lora_runs["n"], lora_runs["model_config"]
    trained = Checkpointer(root / "straight", CheckpointConfig()).read(2 * n)["state"]["params"]
    config = lora.LoraConfig(rank=4, alpha=8.0, targets=("attention", "down"), trainable=("lambda_",))
    # the LoRA model: the base with the trained lambda vectors, W + (alpha / r) A @ B written out in numpy
    base = jax.tree.map(np.asarray, lora_runs["base_params"])
    base = lora.join(base, trained["base"])
    expected_params = _numpy_merged(base, trained["lora"], config)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0))))
    tokens = np.random.RandomState(0).randint(0, model_config.vocab_size, (2, 24)).astype(np.int32)
    expected = np.asarray(nnx.merge(graphdef, expected_params)(tokens))

    assert main(["merge-lora", str(root / "straight"), str(tmp_path / "merged")]) == 0
    base_files = sorted(p for p in (root / "base").rglob("*"))
    assert main(["merge-lora", str(root / "straight"), str(root / "base"), "--overwrite"]) == 2  # into its base
    assert sorted(p for p in (root / "base").rglob("*")) == base_files
    merged = np.asarray(load_model(tmp_path / "merged")(tokens))
    np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-5)
    # load_model (generate, the analyses) and train.init_from of the LoRA run itself: merged the same way
    np.testing.assert_array_equal(np.asarray(load_model(root / "straight")(tokens)), merged)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0])), expected_params)
    init_params = restore_params(root / "straight", {"params": target})
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, init_params)(tokens)), merged)

    torch = pytest.importorskip("torch")
    import transformers
    from hf_models import max_relative_error

    diffjax_to_hf(root / "straight", tmp_path / "hf")  # a LoRA run: merged on the way
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(hf).__name__ == "DiffLlamaForCausalLM"
    with torch.no_grad():
        hf_logits = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert max_relative_error(hf_logits, expected) < 1e-5
    assert max_relative_error(hf_logits, np.asarray(lora_runs["base_logits"](tokens))) > 1e-3  # not the base


def test_merge_lora_refuses_a_run_that_is_not_a_lora_run(tmp_path, capsys):
    """`python -m diffjax.convert merge-lora` of a params-only run directory: exit 2, one line, nothing written."""
    from diffjax.convert.__main__ import main
    from diffjax.params_checkpoint import save_params

    model_config, _, params = _model("standard")
    save_params(tmp_path / "base", params, model_config)
    assert main(["merge-lora", str(tmp_path / "base"), str(tmp_path / "merged")]) == 2
    assert f"error: {tmp_path / 'base'} is not a LoRA run" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()
