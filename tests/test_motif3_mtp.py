"""Motif 3's multi-token-prediction block (ModelConfig.mtp_depths; diffjax.model.mtp.PredictionBlock): its
layer config as the published config.json says it, the depths' targets, the Hugging Face names in and out, the loss
in the train step, LoRA and the sharding rules on its stack, the PyTorch re-statement's MTP depths
(tests/motif3_reference.py) in logits and gradients, and a converted Motif 3 trained with the MTP loss, resumed and
exported with every name and config key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import diffjax
from diffjax import lora
from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError
from diffjax.convert.hf import config_from_hf
from diffjax.model import TransformerLM, mtp
from diffjax.model.mtp import depth_targets

from motif3_published import PUBLISHED, checkpoint_shapes, small_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def _config(depths: int = 2, **changes) -> ModelConfig:
    """The small Motif 3 (every feature on) with `depths` MTP depths, as the converter reads it."""
    return config_from_hf({"model_type": "Motif", **small_config(num_nextn_predict_layers=depths, **changes)})


# ------------------------------------------------------------------------------ config


def test_the_published_mtp_layer_is_dense_windowed_everywhere_and_without_mhc():
    """vLLM motif_mtp.py's layer for the published config.json: GDLA, a 129-key window at every position with plain
    RoPE theta 1e4 (no YaRN, no softmax factor), no mHC, a dense PolyNorm MLP 12,288 wide without clamps."""
    config = config_from_hf(PUBLISHED)
    layer = config.mtp_layer_config()
    assert config.mtp_depths == 1 and layer.mtp_depths == 0
    assert (layer.attention, layer.residual, layer.mlp, layer.mlp_dim) == ("gdla", "plain", "polynorm", 12288)
    assert (layer.attention_window, layer.global_layers, layer.window_rope_theta) == (129, (), 10000.0)
    assert (layer.mlp_options.hidden_clamp, layer.mlp_options.output_scale, layer.mlp_options.sigmoid_weight) == (
        None, 0.5, True)
    assert layer.attention_options == config.attention_options
    assert ModelConfig.from_dict(config.to_dict()) == config and hash(config) == hash(config.replace())
    assert config.replace(mtp_depths=0).param_count() + 251_151_876 == config.param_count()  # the 19 tensors'


@pytest.mark.parametrize("changes,message", [
    ({"mtp_depths": -1}, r"mtp_depths must be an integer >= 0, got -1"),
    ({"mtp_loss_weight": -0.5}, r"mtp_loss_weight must be a number >= 0, got -0.5"),
    ({"mtp_layer": {"mlp": "polynorm", "window": 3}}, r"unknown config key mtp_layer.window"),
    ({"mlp": "moe", "mtp_layer": {"mlp": "moe", "mlp_options": {"num_experts": 2}}},
     r"mtp_layer: mlp 'moe' with mlp_options other than the model's moe layers' \(top 2 of 8 experts\): one training "
     r"side serves every layer of a kind; leave mtp_layer.mlp_options unset \(the model's\)$"),
    ({"mtp_layer": {"window_rope_theta": 5.0}, "attention_window": None},
     r"mtp_layer: .*window_rope_theta 5.0 needs an attention_window"),
])
def test_bad_mtp_settings_are_one_line_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        ModelConfig(**{"vocab_size": 64, "d_model": 32, "num_layers": 2, "num_heads": 2, "mtp_depths": 1, **changes})
    assert "\n" not in str(error.value)


def test_depth_targets_stay_inside_a_document_and_the_loss_mask():
    """depth_targets against a plain loop: depth k at t reads token t + k and predicts t + 1 + k, counted only when
    t + 1 + k is in the row, in t's document, and its loss_mask is set."""
    draws = np.random.RandomState(0)
    tokens = draws.randint(1, 50, (2, 9))
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    loss_mask = draws.rand(2, 9) > 0.2
    inputs, targets, weights = map(np.asarray, depth_targets(tokens, segments, loss_mask, 3))
    for k in (1, 2, 3):
        for b in range(2):
            for t in range(9):
                counted = (t + 1 + k < 9 and segments[b, t] == segments[b, t + 1 + k] != 0 and loss_mask[b, t + 1 + k])
                assert weights[k - 1, b, t] == counted, (k, b, t)
                if counted:
                    assert (inputs[k - 1, b, t], targets[k - 1, b, t]) == (tokens[b, t + k], tokens[b, t + 1 + k])
    # unmasked, depth 1: two 4-token documents and one of 9 give 2 + 2 + 7 targets (one fewer each than the main loss)
    assert np.asarray(depth_targets(tokens, segments, None, 1)[2]).sum() == 2 + 2 + 7


# ------------------------------------------------------------------------------ Hugging Face names


def test_a_published_config_export_keeps_every_source_key_and_reads_back():
    """config.json of the published model converted from the published config.json (with the keys issue 56 found
    dropped: attention_dropout, output_router_logits, rope_scaling's rope_theta and apply_yarn_scaling): every key of
    the source, num_nextn_predict_layers 1, and it reads back as the same ModelConfig, MTP layer included."""
    from diffjax.convert import motif3
    from diffjax.convert.formats import config_json

    source = {**PUBLISHED, "attention_dropout": 0.0,
              "rope_scaling": {**PUBLISHED["rope_scaling"], "rope_theta": 10000.0, "apply_yarn_scaling": False}}
    config = config_from_hf(source)
    written = config_json(motif3.FORMAT, config, dtype="bfloat16", source=source)
    assert not set(source) - set(written) and not set(source["rope_scaling"]) - set(written["rope_scaling"])
    assert (written["num_nextn_predict_layers"], written["rope_scaling"]["apply_yarn_scaling"]) == (1, False)
    assert config_from_hf(written) == config and config.mtp_depths == 1
    assert config_json(motif3.FORMAT, config, dtype="bfloat16")["num_nextn_predict_layers"] == 1  # (no source)


@pytest.mark.slow
def test_save_hf_then_load_hf_keeps_the_mtp_depths_bit_exact(tmp_path):
    """A random diffjax Motif 3 with 2 MTP depths through the Hugging Face format: model.mtp_layers.{0,1}.* written
    with the published names (19 each), num_nextn_predict_layers 2; loaded and written again, every tensor bit for
    bit."""
    from safetensors.numpy import load_file

    config = _config()
    model = TransformerLM(config, rngs=nnx.Rngs(3))
    diffjax.save_hf(model, tmp_path / "hf")
    names = load_file(tmp_path / "hf" / "model.safetensors")
    expected = checkpoint_shapes(small_config(num_nextn_predict_layers=2), include_mtp=True)
    assert {name: tuple(value.shape) for name, value in names.items()} == expected
    assert sum(name.startswith("model.mtp_layers.1.") for name in names) == 19
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    back = diffjax.load_hf(tmp_path / "hf")  # (rope_style interleaved: the RoPE channels permuted at load)
    assert back.config == config.replace(rope_style="interleaved")
    diffjax.save_hf(back, tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(names) and all(np.array_equal(again[k], v) for k, v in names.items())


def test_an_mtp_layer_motif_3_does_not_build_is_refused_on_export():
    from diffjax.convert.formats import check_exportable

    assert check_exportable(_config()).name == "motif3"
    for changes in ({"residual": "mhc"}, {"mlp_dim": 64}, {"mlp_options": {"hidden_clamp": 5.0}},
                    {"attention_window": 9}):
        config = _config().replace(mtp_layer={"mlp": "polynorm", **changes})
        with pytest.raises(ConversionError, match=r"^cannot export to Hugging Face \(Motif 3\): mtp_layer: Motif 3's "
                                                  r"MTP layer is a dense PolyNorm MLP .*no mHC[^;]*$"):
            check_exportable(config)


# ------------------------------------------------------------------------------ training


def _step_once(config: ModelConfig, params: dict) -> tuple[dict, dict]:
    from diffjax.train.step import init_state, make_train_step

    model = TransformerLM(config, rngs=nnx.Rngs(0))
    nnx.update(model, params)
    tx = optax.adam(1e-2)
    step = jax.jit(make_train_step(nnx.graphdef(model), tx, optax.constant_schedule(1e-2), config))
    tokens = np.random.RandomState(1).randint(0, 97, (1, 2, 12))
    batch = {"tokens": tokens, "positions": np.broadcast_to(np.arange(12), tokens.shape),
             "segment_ids": np.broadcast_to(np.where(np.arange(12) < 7, 1, 2), tokens.shape)}
    state, metrics = step(init_state(model, tx, jax.random.key(0)), batch)
    return state["params"], metrics


def test_analytic_flops_count_the_mtp_depths_as_xla_does(measured):
    """The forward of a model with 2 MTP depths (main logits and each depth's) against XLA's count of its compiled
    forward, as tests/test_train_config.py checks the layers: the depths' layers, input projections and LM heads."""
    from diffjax.train.metrics import matmul_params, training_flops_per_token

    config = ModelConfig(vocab_size=512, d_model=256, num_layers=1, num_heads=2, max_seq_len=256, mtp_depths=2)
    graphdef, params = nnx.split(TransformerLM(config, rngs=nnx.Rngs(0)))
    B, T = 2, 256
    tokens = jnp.zeros((B, T), jnp.int32)

    def forward(params, tokens):
        model = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
        hidden = model.hidden_states(tokens, positions).hidden_BTD
        inputs = jnp.stack([tokens, tokens])
        return [model.logits(h) for h in [hidden, *mtp.hidden_states(model, hidden, inputs, positions)]]

    cost = jax.jit(forward).lower(params, tokens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    full_square_forward = (training_flops_per_token(config, 2 * T) - 6 * matmul_params(config)) / 3 + 2 * matmul_params(config)
    without = config.replace(mtp_depths=0)
    assert matmul_params(config) - matmul_params(without) > 2 * 512 * 256  # (the two LM heads at least)
    ratio = cost["flops"] / (full_square_forward * B * T)
    measured("XLA / analytic forward FLOPs (2 MTP depths)", ratio - 1, 0.02)
    assert abs(ratio - 1) < 0.02


@pytest.mark.slow  # (three train steps compiled: ~10 s on 2 idle cores)
def test_the_mtp_loss_joins_the_main_loss_by_its_weight():
    """One train step of a model with 2 MTP depths (a tiny DIFF model: the step names no kind, and a Motif 3's three
    compiles take minutes on a CPU): at weight 0 its main params move exactly as those of the model without them and
    its MTP params do not move; at 0.5 the MTP loss reaches the trunk and the MTP block trains. The main loss is what
    is logged as `loss`; each depth's mean as `mtp_loss/depth_k`."""
    config = ModelConfig(vocab_size=97, d_model=16, num_layers=1, num_heads=1, max_seq_len=16, mtp_depths=2)
    params = nnx.state(TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param)
    main = {name: tree for name, tree in nnx.to_pure_dict(params).items() if name != "blocks_mtp"}
    plain, plain_metrics = _step_once(config.replace(mtp_depths=0, mtp_layer=None), main)
    silent, silent_metrics = _step_once(config.replace(mtp_loss_weight=0.0), params)
    trained, metrics = _step_once(config.replace(mtp_loss_weight=0.5), params)
    for name in main:
        for a, b in zip(jax.tree.leaves(plain[name]), jax.tree.leaves(silent[name]), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-7, err_msg=name)
    before = nnx.to_pure_dict(params)["blocks_mtp"]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(silent["blocks_mtp"])))
    assert not np.allclose(trained["embed"]["embedding"], silent["embed"]["embedding"], rtol=0, atol=1e-6)
    assert not np.array_equal(trained["blocks_mtp"]["input_proj_kernel"], before["input_proj_kernel"])
    assert plain_metrics["loss"] == silent_metrics["loss"] == metrics["loss"]
    assert sorted(k for k in metrics if k.startswith("mtp_")) == ["mtp_loss/depth_1", "mtp_loss/depth_2"]
    assert all(3.0 < float(metrics[f"mtp_loss/depth_{k}"]) < 7.0 for k in (1, 2))  # ~ln 97 at init


def test_lora_adapts_the_mtp_block_and_it_shards_like_a_layer():
    """The MTP depths are a stack like the layers': LoRA's targets find its attention and MLP kernels, and every
    leaf it shares with the layers' stack gets the same PartitionSpec on an fsdp x tensor mesh."""
    from diffjax import sharding
    from diffjax.train.mesh import ParallelConfig, make_mesh

    config = _config(depths=1)
    specs = lora.kernel_specs(config, lora.LoraConfig(rank=2, targets=("attention", "mlp")))
    assert sorted(".".join(p[1:]) for p in specs if p[0] == "blocks_mtp") == sorted(
        ["attn.q_down_kernel", "attn.q_up_kernel", "attn.kv_down_kernel", "attn.kv_up_kernel", "attn.o_kernel",
         "mlp.gate_kernel", "mlp.up_kernel", "mlp.down_kernel"])
    abstract = nnx.state(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
    mesh = make_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
    flat = {tuple(map(str, path)): s.spec for path, s in
            nnx.to_flat_state(nnx.State(sharding.param_shardings(abstract, mesh)))}
    shared = [path[1:] for path in flat if path[0] == "blocks_mtp" and ("blocks",) + path[1:] in flat]
    assert len(shared) >= 12 and any(any(flat[("blocks",) + p]) for p in shared)  # (some leaves are split)
    assert all(flat[("blocks_mtp",) + p] == flat[("blocks",) + p] for p in shared)
    assert flat[("blocks_mtp", "input_proj_kernel")][0] is None  # "layers" never split


# ------------------------------------------------------------------------------ the PyTorch re-statement


@pytest.mark.slow
def test_mtp_depths_equal_the_restatement_in_logits_and_gradients(tmp_path, measured):
    """The re-statement with 2 MTP depths (every feature of the model on), loaded with load_hf: each depth's float32
    logits within 1e-5 of the reference's over the positions DeepSeek-V3's form keeps (depth k: T - k), and every
    gradient of main + depth losses within 1e-4 of the float64 reference's (the floor as in tests/test_motif3.py)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from motif3_reference import make_motif3_model, save_with_remote_code
    from test_motif3 import _grads_by_name, relative

    reference = make_motif3_model(small_config(num_nextn_predict_layers=2), seed=0)
    save_with_remote_code(reference, tmp_path / "hf")
    model = diffjax.load_hf(tmp_path / "hf")
    tokens = np.random.RandomState(1).randint(0, 97, (2, 12))
    T, positions = tokens.shape[1], jnp.broadcast_to(jnp.arange(12), tokens.shape)
    inputs, targets, weights = depth_targets(tokens, None, None, 2)

    def depth_logits(model):
        hidden = model.hidden_states(jnp.asarray(tokens), positions).hidden_BTD
        return [model.logits(h) for h in mtp.hidden_states(model, hidden, inputs, positions)]

    with torch.no_grad():
        expected = [reference.lm_head(h) for h in reference.mtp_hidden_states(torch.tensor(tokens))]
    for k, (ours, theirs) in enumerate(zip(depth_logits(model), expected), start=1):
        error = relative(np.asarray(ours)[:, :T - k], theirs.numpy())
        assert measured(f"Motif 3 MTP depth {k} logits vs reference", error, 1e-5) < 1e-5

    reference = reference.double()
    ids = torch.tensor(tokens)
    loss = torch.nn.functional.cross_entropy(reference(ids).logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    for k, hidden in enumerate(reference.mtp_hidden_states(ids), start=1):
        logits = reference.lm_head(hidden)[:, :-1]
        loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, 97), ids[:, 1 + k:].reshape(-1))
    loss.backward()

    def ours_loss(model):
        loss = diffjax.next_token_loss(model(jnp.asarray(tokens)), jnp.asarray(tokens))
        for logits, t, w in zip(depth_logits(model), targets, weights):
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, t)
            loss = loss + jnp.sum(losses * w) / jnp.sum(w)
        return loss

    grads = _grads_by_name(model, jnp.asarray(tokens), ours_loss)
    theirs = {name: p.grad.numpy() for name, p in reference.named_parameters() if p.requires_grad}
    assert sum(name.startswith("model.mtp_layers.") for name in theirs) == 38
    floor = 1e-3 * max(np.abs(g).max() for g in theirs.values())
    errors = {name: float(np.abs(grads[name] - g).max() / max(np.abs(g).max(), floor)) for name, g in theirs.items()}
    worst = max(errors, key=errors.get)
    assert measured("Motif 3 MTP gradients vs reference", errors[worst], 1e-4) < 1e-4, worst


# ------------------------------------------------------------------------------ HF -> diffjax -> train -> HF


def _run(*command) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _train(base: Path, run_dir: Path, steps: int) -> str:
    return _run("train.py", "--config", base / "config.yaml", f"train.init_from={base}", f"train.run_dir={run_dir}",
                f"train.steps={steps}", "checkpoint.every=1", "train.eval_every=0", "train.sample_tokens=0",
                "data.source=builtin", "data.seq_len=32", "train.batch_size=8", "train.log_every=1", "optim.lr=1e-2",
                "optim.warmup_steps=0", "optim.decay_steps=2")


@pytest.mark.slow
def test_a_motif3_directory_with_its_mtp_block_trains_resumes_and_exports_every_name_and_key(tmp_path):
    """Issue 56's "done when": the re-statement with all published names (MTP included) and config keys the converter
    does not model -> hf-to-diffjax -> 2 train steps with the MTP loss (metrics.jsonl logs it per depth), stopped
    after 1 and resumed, bitwise the same as 2 straight -> diffjax-to-hf: every tensor name and config.json key of
    the source, num_nextn_predict_layers as the source's, the MTP block trained."""
    pytest.importorskip("torch")
    from safetensors.numpy import load_file

    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer
    from motif3_reference import make_motif3_model, save_with_remote_code

    save_with_remote_code(make_motif3_model(small_config(vocab_size=257, num_nextn_predict_layers=1)), tmp_path / "hf")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    source.update(attention_dropout=0.0, output_router_logits=False)  # keys the published config.json has
    source["rope_parameters"]["apply_yarn_scaling"] = False
    (tmp_path / "hf" / "config.json").write_text(json.dumps(source))
    _run("-m", "diffjax.convert", "hf-to-diffjax", tmp_path / "hf", tmp_path / "base")
    _train(tmp_path / "base", tmp_path / "straight", 2)
    first = _train(tmp_path / "base", tmp_path / "resumed", 1)
    second = _train(tmp_path / "base", tmp_path / "resumed", 2)
    assert "resumed from" in second and "resumed from" not in first
    straight, resumed = (Checkpointer(tmp_path / name, CheckpointConfig()).read(2)["state"]
                         for name in ("straight", "resumed"))
    for x, y in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    logged = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    depth_losses = [row["mtp_loss/depth_1"] for row in logged if "mtp_loss/depth_1" in row]
    assert len(depth_losses) == 2 and all(np.isfinite(depth_losses))

    _run("-m", "diffjax.convert", "diffjax-to-hf", tmp_path / "straight", tmp_path / "back")
    original, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original) and sum(name.startswith("model.mtp_layers.0.") for name in back) == 19
    assert not np.array_equal(back["model.mtp_layers.0.input_proj.weight"], original["model.mtp_layers.0.input_proj.weight"])
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    missing = sorted(set(source) - set(written) - {"transformers_version"})
    assert not missing, missing
    assert written["num_nextn_predict_layers"] == 1 and written["attention_dropout"] == 0.0
    assert written["rope_parameters"]["apply_yarn_scaling"] is False
