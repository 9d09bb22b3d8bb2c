"""LoRA on Motif 3 (diffjax.lora over a model of two layer segments): adapters per stack on GDLA's projections, the
shared expert and the routed experts; a converted Motif 3 fine-tuned by the real trainer (train.py) resumes bitwise,
exports merged to the Hugging Face format (diffjax-to-hf), and that export loads in the PyTorch re-statement
(tests/motif3_reference.py) with the LoRA model's logits; HF -> diffjax -> HF keeps every tensor's bits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from diffjax import lora
from diffjax.config import ModelConfig
from diffjax.config_values import build_config

from motif3_published import small_config
from test_lora import _numpy_merged

REPO_ROOT = Path(__file__).resolve().parents[1]
ALL_TARGETS = ("attention", "mlp", "experts")
ATTENTION = ["kv_down_kernel", "kv_up_kernel", "o_kernel", "q_down_kernel", "q_up_kernel"]


def _small_model_config() -> ModelConfig:
    model = yaml.safe_load((REPO_ROOT / "configs" / "motif3" / "small.yaml").read_text())["model"]
    return build_config(ModelConfig, {**model, "vocab_size": 97}, prefix="model")


def test_adapters_cover_both_segments_gdla_the_shared_and_the_routed_experts():
    """Motif 3's dense first layer and its MoE layers are two stacks: each gets its own adapters (attention's five
    GDLA projections in both; the dense MLP in the first, the shared expert and per-expert adapters in the rest);
    the attention's output gate is no MLP gate."""
    model_config = _small_model_config()
    config = lora.LoraConfig(rank=3, alpha=6.0, targets=ALL_TARGETS)
    specs = lora.kernel_specs(model_config, config)
    by_stack = {}
    for path in specs:
        by_stack.setdefault(path[0], []).append(".".join(path[1:]))
    assert sorted(by_stack) == ["blocks", "blocks_from_1"]
    assert sorted(by_stack["blocks"]) == [f"attn.{k}" for k in ATTENTION] + [
        "mlp.down_kernel", "mlp.gate_kernel", "mlp.up_kernel"]
    assert sorted(by_stack["blocks_from_1"]) == [f"attn.{k}" for k in ATTENTION] + [
        "mlp.expert_down_kernel", "mlp.expert_gate_kernel", "mlp.expert_up_kernel", "mlp.shared_expert.down_kernel",
        "mlp.shared_expert.gate_kernel", "mlp.shared_expert.up_kernel"]
    adapters = jax.eval_shape(lambda key: lora.init_adapters(specs, config, key), jax.random.key(1))
    experts, o = adapters["blocks_from_1"]["mlp"]["expert_up_kernel"], adapters["blocks"]["attn"]["o_kernel"]
    assert experts["lora_a"].shape == (3, 6, 32, 3) and experts["lora_b"].shape == (3, 6, 3, 16)  # [L, E, in|r, r|out]
    assert o["lora_a"].shape == (1, 8 * 8, 3) and o["lora_b"].shape == (1, 3, 32)  # [L, S dv, r], [L, r, D]
    with pytest.raises(ValueError, match=r"lora.targets: model.attention 'gdla' / model.mlp 'moe' has no q projection "
                                         r"\(its adaptable ones: o, q_down, q_up, kv_down, kv_up, gate, up, down, experts\)"):
        lora.kernel_specs(model_config, lora.LoraConfig(rank=3, targets=("q", "o")))
    assert lora.kernel_specs(model_config, lora.LoraConfig(rank=3, targets=("attention",))).keys() == {
        path for path in specs if path[1] == "attn"}


def test_the_host_checksum_is_the_trainers_checksum():
    """The export checks the base it reads leaf by leaf with numpy (lora.host_checksum, in chunks) against the
    checksums the trainer saved (lora.checksum, on device): the same uint32 for any dtype and chunk boundary."""
    draws = np.random.RandomState(0)
    for x in (draws.standard_normal((3, 5, 7)).astype(np.float32), draws.standard_normal(100).astype(jnp.bfloat16),
              np.float32(3.0).reshape(()), draws.standard_normal(1000).astype(np.float32)):
        assert int(lora.host_checksum(x)) == int(lora.host_checksum(x, chunk=77)) == int(lora.checksum(jnp.asarray(x)))


@pytest.mark.slow
def test_merge_is_the_base_at_zero_and_w_plus_ab_per_layer_and_expert():
    """Merging is the base at B = 0 and W + (alpha / r) A @ B (written out in numpy per layer and per routed
    expert) otherwise, on the adapted kernels of both stacks only."""
    from flax import nnx

    from diffjax.model import TransformerLM

    model_config = _small_model_config()
    config = lora.LoraConfig(rank=3, alpha=6.0, targets=ALL_TARGETS)
    specs = lora.kernel_specs(model_config, config)
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0))),
                                          nnx.Param))
    draws = np.random.RandomState(0)
    params = jax.tree.map(lambda x: draws.standard_normal(x.shape).astype(x.dtype), abstract)
    adapters = jax.jit(lambda key: lora.init_adapters(specs, config, key))(jax.random.key(1))  # (one compilation)
    merge = jax.jit(lambda params, adapters: lora.merge(params, adapters, config))
    zero = merge(params, adapters)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(zero), jax.tree.leaves(params), strict=True))

    adapters = jax.tree.map(lambda x: x if x.any() else 0.05 * draws.standard_normal(x.shape).astype(x.dtype), adapters)
    merged, expected = merge(params, adapters), _numpy_merged(params, adapters, config)
    for (path, got), (_, want), (_, base) in zip(lora._flat(merged), lora._flat(expected), lora._flat(params)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6, err_msg=str(path))
        assert (path in specs) == (not np.array_equal(got, base)), path  # only the adapted kernels change


# ------------------------------------------------------------------------------------------------
# a converted Motif 3 through the real trainer, the export and the re-statement


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _run(*command) -> str:
    done = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, env=_env(),
                          cwd=REPO_ROOT, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _fine_tune(base: Path, run_dir: Path, steps: int) -> dict[str, str]:
    """`python train.py --config BASE/config.yaml` with LoRA on every target: {step: logged loss}."""
    out = _run("train.py", "--config", base / "config.yaml", f"train.init_from={base}", f"train.run_dir={run_dir}",
               "lora.rank=4", "lora.alpha=8", f"lora.targets=[{', '.join(ALL_TARGETS)}]", "lora.trainable=[lambda]",
               f"train.steps={steps}", "checkpoint.every=2", "train.eval_every=0", "train.sample_tokens=0",
               "data.source=builtin", "data.seq_len=32", "train.batch_size=8", "train.log_every=1", "optim.lr=1e-2",
               "optim.warmup_steps=0", "optim.decay_steps=4")  # (the schedule's length fixed: steps 2 then 4 = 4)
    return dict(re.findall(r"^step\s+(\d+)/\d+ \| loss ([\d.]+) \|", out, flags=re.M))


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """The re-statement (byte vocabulary) saved as a remote-code directory, converted by the CLI, then LoRA runs
    over it: 4 steps straight, and 2 steps, stop, 2 more."""
    pytest.importorskip("torch")
    from motif3_reference import make_motif3_model, save_with_remote_code

    root = tmp_path_factory.mktemp("motif3_lora")
    save_with_remote_code(make_motif3_model(small_config("all_on", vocab_size=257), seed=0), root / "hf")
    _run("-m", "diffjax.convert", "hf-to-diffjax", root / "hf", root / "base")
    losses = {"straight": _fine_tune(root / "base", root / "straight", 4),
              "first": _fine_tune(root / "base", root / "resumed", 2),
              "second": _fine_tune(root / "base", root / "resumed", 4)}
    return root, losses


@pytest.mark.slow
def test_a_converted_motif3_fine_tunes_and_resumes_bitwise(fine_tuned):
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer

    root, losses = fine_tuned
    assert sorted(losses["second"]) == ["3", "4"]  # resumed at step 2 (a fresh start would log steps 1 to 4)
    assert {**losses["first"], **losses["second"]} == losses["straight"] and len(losses["straight"]) == 4
    assert float(losses["straight"]["4"]) < float(losses["straight"]["1"])  # it learns
    saved = Checkpointer(root / "straight", CheckpointConfig()).read(4)["state"]
    resumed = Checkpointer(root / "resumed", CheckpointConfig()).read(4)["state"]
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    adapters = saved["params"]["lora"]
    assert sorted(adapters) == ["blocks", "blocks_from_1"]  # one adapter tree per stack
    assert np.abs(adapters["blocks_from_1"]["mlp"]["expert_gate_kernel"]["lora_b"]).max() > 0
    assert sorted(saved["params"]["base"]["blocks_from_1"]["attn"]) == ["lambda_kernel"]  # lora.trainable


@pytest.mark.slow
def test_the_merged_export_loads_in_the_restatement_with_the_lora_models_logits(fine_tuned, capsys):
    """diffjax-to-hf of the LoRA run: Motif's config.json and tensor names, the adapted tensors (only those, and the
    trained lambda projection) changed; the re-statement loading it computes the LoRA model's logits (fp32 rel 1e-5),
    with the adapters merged independently in numpy. HF -> diffjax -> HF of the base keeps every tensor's bits."""
    import json

    import torch
    import transformers
    from flax import nnx
    from safetensors.numpy import load_file

    from diffjax.model import TransformerLM
    from diffjax.params_checkpoint import load_model, load_params, saved_model_config
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer

    root, _ = fine_tuned
    _run("-m", "diffjax.convert", "diffjax-to-hf", root / "base", root / "base_back")
    _run("-m", "diffjax.convert", "diffjax-to-hf", root / "straight", root / "merged")
    original = load_file(root / "hf" / "model.safetensors")
    back, merged = load_file(root / "base_back" / "model.safetensors"), load_file(root / "merged" / "model.safetensors")
    assert sorted(back) == sorted(original) == sorted(merged)
    assert all(back[name].dtype == value.dtype and np.array_equal(back[name], value) for name, value in original.items())
    changed = {re.sub(r"layers\.\d+\.", "", name) for name in original if not np.array_equal(original[name], merged[name])}
    assert changed == {f"model.self_attn.{n}.weight" for n in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "lambda_proj")} | {
        "model.mlp.gate_proj.weight", "model.mlp.up_proj.weight", "model.mlp.down_proj.weight",
        "model.moe.shared_experts.gate_proj.weight", "model.moe.shared_experts.up_proj.weight",
        "model.moe.shared_experts.down_proj.weight", "model.moe.experts.gate_up_proj", "model.moe.experts.down_proj"}
    written = json.loads((root / "merged" / "config.json").read_text())
    assert written["model_type"] == "Motif" and written["architectures"] == ["MotifForCausalLM"]

    model_config = saved_model_config(root / "base" / "checkpoints" / "0")
    trained = Checkpointer(root / "straight", CheckpointConfig()).read(4)["state"]["params"]
    config = lora.LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS, trainable=("lambda",))
    params = _numpy_merged(lora.join(jax.tree.map(np.asarray, load_params(root / "base")), trained["base"]),
                           trained["lora"], config)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0))))
    tokens = np.random.RandomState(0).randint(0, 257, (2, 16)).astype(np.int32)
    expected = np.asarray(nnx.merge(graphdef, params)(tokens))
    np.testing.assert_allclose(np.asarray(load_model(root / "straight")(tokens)), expected, rtol=1e-5, atol=1e-5)

    reference = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", trust_remote_code=True).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(theirs - expected).max() / np.abs(expected).max() < 1e-5
    base_model = load_model(root / "base")
    assert np.abs(np.asarray(base_model(tokens)) - expected).max() / np.abs(expected).max() > 1e-3  # not the base

    # a base that changed since: the export refuses in one line, naming the leaf, and writes nothing
    import shutil

    from diffjax.convert.__main__ import main
    from diffjax.params_checkpoint import save_params

    changed = jax.tree.map(np.asarray, load_params(root / "base"))
    changed["blocks_from_1"]["mlp"]["router_kernel"][0, 0, 0] += np.float32(1e-3)
    save_params(root / "changed_base", changed, model_config)
    shutil.copytree(root / "straight", root / "moved")
    run_config = yaml.safe_load((root / "moved" / "config.yaml").read_text())
    run_config["train"].update(init_from=str(root / "changed_base"), run_dir=str(root / "moved"))
    (root / "moved" / "config.yaml").write_text(yaml.safe_dump(run_config))
    capsys.readouterr()
    assert main(["diffjax-to-hf", str(root / "moved"), str(root / "refused")]) == 2
    assert re.search(r"the base model changed since the LoRA checkpoint .*now holds different "
                     r"blocks_from_1\.mlp\.router_kernel; the adapters fit", capsys.readouterr().err)
    assert not (root / "refused").exists()
