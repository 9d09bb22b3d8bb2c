"""Motif 3's Hugging Face format in and out (diffjax.convert.motif3, .motif3_weights): the config mapping and its
refusals, every published tensor name through the plan at the published size (shapes only), the PyTorch re-statement
(tests/motif3_reference.py, saved as a remote-code directory) loaded with load_hf against its own logits, gradients
and greedy generation with every feature on and each off, the export bit-exact, `convert verify --trust-remote-code`
on the re-statement, and peak memory of a many-shard conversion."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.convert import motif3, motif3_weights, weight_plan
from diffjax.convert.common import ConversionError
from diffjax.convert.hf import config_from_hf
from diffjax.model import TransformerLM
from diffjax.model.sizes import describe_parameter_counts, parameter_counts

from motif3_published import PUBLISHED, PUBLISHED_ACTIVE_PARAMS, PUBLISHED_TOTAL_PARAMS, checkpoint_shapes, small_config

try:
    import torch

    from motif3_reference import greedy_generate, make_motif3_model, save_with_remote_code
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="the PyTorch re-statement needs torch and transformers")
REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs" / "motif3"
VARIANTS = ("all_on", "mhc_off", "window_off", "dense_only", "gate_off", "yarn_off")


# ------------------------------------------------------------------------------ config.json <-> ModelConfig


def test_the_published_config_maps_to_gdla_mhc_and_moe():
    c = config_from_hf(PUBLISHED)
    o, m = c.attention_options, c.mlp_options
    assert (c.attention, c.mlp, c.residual, c.dtype) == ("gdla", "moe", "mhc", "bfloat16")
    assert (c.num_heads, c.num_kv_heads, c.head_dim, o.num_noise_heads, o.q_lora_rank, o.kv_lora_rank,
            o.qk_rope_head_dim, o.v_head_dim, o.output_gate) == (80, 16, 192, 16, 1024, 512, 64, 128, True)
    assert c.attention_window == 129 and c.global_layers == tuple(range(0, 53, 4)) and len(c.global_layers) == 14
    assert (c.rope_type, c.rope_factor, c.rope_original_max_len, c.rope_mscale, c.window_rope_theta) == (
        "yarn", 64.0, 4096, 1.0, 10000.0)
    assert (m.num_experts, m.top_k, m.expert_inner, m.shared_inner, m.dense_first_layers, m.expert_bias,
            m.route_scale, m.bias_clamp, m.hidden_clamp) == (384, 8, 1280, 1280, 2, True, 2.0, 0.5, 1e6)
    assert (c.residual_options.streams, c.residual_options.sinkhorn_iters) == (4, 20)


def test_the_published_size_counts_314b_total_and_13b_active(capsys):
    """diffjax.model.sizes counts configs/motif3/published.yaml, its multi-token-prediction block included:
    314.84B total, 13.23B active, the checkpoint's tensors to the parameter (the model card's 13.2B counts that block:
    tests/motif3_published.py's note); ModelConfig.param_count's formula agrees."""
    from diffjax.train.config import load_run_config

    config = load_run_config(CONFIGS / "published.yaml").model
    total, active = parameter_counts(config)
    assert abs(total - PUBLISHED_TOTAL_PARAMS) < 0.01 * PUBLISHED_TOTAL_PARAMS
    assert abs(active - PUBLISHED_ACTIVE_PARAMS) < 0.02 * PUBLISHED_ACTIVE_PARAMS
    built = sum(math.prod(shape) for shape in checkpoint_shapes(PUBLISHED, include_mtp=True).values())
    assert total == built == config.param_count()
    assert parameter_counts(config.replace(mtp_depths=0))[0] == sum(
        math.prod(shape) for shape in checkpoint_shapes(PUBLISHED).values())
    with capsys.disabled():
        print(f"\nMotif 3 published (configs/motif3/published.yaml): {describe_parameter_counts(config)}")


@pytest.mark.parametrize("changes,message", [
    ({"polynorm_output_scale_per_layer": {"3": 0.25}}, r"polynorm_output_scale_per_layer=\{'3': 0.25\} is not "
     r"supported for Motif 3: diffjax has one polynorm_output_scale"),
    ({"headwise_attn_output_gate": True}, r"headwise_attn_output_gate=True is not supported .*element-wise gate"),
    ({"score_before_experts": True}, r"score_before_experts=True is not supported"),
    ({"hidden_act": "silu"}, r"hidden_act='silu' is not supported for Motif 3"),
    ({"sliding_window_pattern": "odd"}, r"sliding_window_pattern='odd' is not supported .*'interleave', 'all'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_type 'llama3': Motif 3 uses 'yarn' or none"),
    ({"rope_factor": 32.0}, r"rope_factor \(32.0\) differs from rope_scaling's factor \(64.0\)"),
    ({"score_func": "relu"}, r"mlp_options.score_func must be one of \('sigmoid', 'softmax'\), got 'relu'"),
])
def test_unsupported_values_are_named_in_one_line(changes, message):
    with pytest.raises(ConversionError, match=message) as error:
        config_from_hf({**PUBLISHED, **changes})
    assert "\n" not in str(error.value)


def test_the_export_refuses_what_motif_3_cannot_hold(tmp_path):
    config = config_from_hf({"model_type": "Motif", **small_config()}).replace(mlp="gated", mlp_options=None)
    with pytest.raises(ConversionError, match=r"^cannot export to Hugging Face \(Motif 3\): mlp='gated': Motif 3 "
                                              r"holds mlp 'moe', 'polynorm' only$"):
        diffjax.save_hf(TransformerLM(config, rngs=nnx.Rngs(0)), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------ the published names, shapes only


def test_a_config_off_by_one_dimension_is_a_readable_line():
    """The published checkpoint's tensors against its config.json with hidden_size off by 8: before, one line of
    129,589 characters listing every tensor (issue 55 item 11)."""
    shapes = checkpoint_shapes(PUBLISHED, include_mtp=True)
    rows = motif3_weights.plan(config_from_hf({**PUBLISHED, "hidden_size": PUBLISHED["hidden_size"] + 8}))
    with pytest.raises(ConversionError, match=r"^\d+ checkpoint tensor\(s\) have another shape than this config's: "
                                              r"'model.embed_tokens.weight' has shape .* and \d+ more$") as error:
        weight_plan.check_names(shapes, rows, motif3.FORMAT)
    assert len(str(error.value)) < 600, str(error.value)


@pytest.mark.parametrize("rope_style", ["rotate_half", "interleaved"])
def test_every_published_tensor_maps_at_the_published_size(rope_style):
    """checkpoint_shapes(PUBLISHED, include_mtp=True) through the plan without allocating: all 2,236 names mapped
    (the multi-token-prediction block's 19 included), each row's converted shapes those of the abstract model's
    leaves, every leaf slice once."""
    config = config_from_hf(PUBLISHED).replace(rope_style=rope_style)
    shapes = checkpoint_shapes(PUBLISHED, include_mtp=True)
    rows = motif3_weights.plan(config)
    assert weight_plan.check_names(shapes, rows, motif3.FORMAT) == []
    assert len(rows) == len(shapes) == 2236 and sorted(row.key for row in rows) == sorted(shapes)
    assert sum(row.key.startswith("model.mtp_layers.0.") for row in rows) == 19
    abstract = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    leaves = {path: tuple(v.shape) for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    covered = {}
    for row in rows:
        outs = jax.eval_shape(row.to_ours, jax.ShapeDtypeStruct(row.shape, jnp.float32))
        for (path, index), out in zip(row.leaves, outs, strict=True):
            expected = leaves[path] if index is None else leaves[path][1:]
            assert tuple(out.shape) == expected, (row.key, path)
            covered[path] = covered.get(path, []) + [index]
    assert set(covered) == set(leaves)
    for path, indices in covered.items():
        stacked = path[0].startswith("blocks")
        assert (sorted(indices) if stacked else indices) == (list(range(leaves[path][0])) if stacked else [None]), path


# ------------------------------------------------------------------------------ the re-statement in and out


def _saved(tmp_path, variant, name="hf"):
    reference = make_motif3_model(small_config(variant), seed=0)
    directory = tmp_path / name
    save_with_remote_code(reference, directory)
    return reference, directory


def _grads_by_name(model, tokens, loss_of=None):
    """Gradients of the next-token loss (or of loss_of(model)), as the checkpoint names them (the plan's inverse)."""
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        if loss_of is not None:
            return loss_of(nnx.merge(graphdef, params))
        return diffjax.next_token_loss(nnx.merge(graphdef, params)(tokens), tokens)

    flat = {path: np.asarray(g[...]) for path, g in nnx.to_flat_state(jax.grad(loss)(params))}
    plan = weight_plan.export_plan(motif3_weights.plan(model.config), flat.__getitem__, lambda path, i: flat[path][i],
                                   {path: np.dtype(np.float32) for path in flat})
    return {key: produce() for key, _, _, produce in plan}


def relative(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize("variant", VARIANTS)
def test_load_hf_equals_the_reference_in_logits_gradients_and_generation(tmp_path, variant, measured):
    """float32 logits within 1e-5 of the float32 reference's and greedy generation token for token; every gradient
    of the next-token loss within 1e-4 of the reference's in float64 (the exact one: the float32 reference itself
    strays 1.4e-4 from it on mHC's scalar alphas). Gradients below 1e-3 of the largest are measured against that
    floor: layer 0's h_pre and the last layer's h_res have zero true gradient (equal streams into a scale-invariant
    norm; columns summing to 1 before the mean), so both sides hold float32 rounding there."""
    reference, directory = _saved(tmp_path, variant)
    model = diffjax.load_hf(directory)  # rope_style interleaved: the RoPE channels permuted at load
    tokens = np.random.RandomState(1).randint(0, 97, (2, 12))
    with torch.no_grad():
        expected_logits = reference(torch.tensor(tokens)).logits.numpy()
    assert measured(f"Motif 3 logits vs reference ({variant})", relative(model(jnp.asarray(tokens)), expected_logits),
                    1e-5) < 1e-5
    prompt = tokens[:, :5]
    expected_tokens = greedy_generate(reference, prompt, 7).numpy()[:, 5:]
    assert np.asarray(diffjax.generate(model, jnp.asarray(prompt), 7)).tolist() == expected_tokens.tolist()

    reference = reference.double()
    logits = reference(torch.tensor(tokens)).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                      torch.tensor(tokens[:, 1:]).reshape(-1)).backward()
    grads = _grads_by_name(model, jnp.asarray(tokens))
    expected = {name: param.grad.numpy() for name, param in reference.named_parameters() if param.requires_grad}
    floor = 1e-3 * max(np.abs(g).max() for g in expected.values())
    errors = {name: float(np.abs(grads[name] - g).max() / max(np.abs(g).max(), floor)) for name, g in expected.items()}
    worst = max(errors, key=errors.get)
    assert measured(f"Motif 3 gradients vs reference ({variant})", errors[worst], 1e-4) < 1e-4, worst
    frozen = [name for name, param in reference.named_parameters() if not param.requires_grad]
    assert all(name.endswith("moe.expert_bias") and not np.any(grads[name]) for name in frozen)


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize("variant", VARIANTS)
def test_save_hf_writes_the_same_tensors_and_a_config_that_reads_back(tmp_path, variant):
    from safetensors.numpy import load_file

    _, directory = _saved(tmp_path, variant)
    model = diffjax.load_hf(directory)
    diffjax.save_hf(model, tmp_path / "back")
    original, back = load_file(directory / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(np.array_equal(back[name], value) for name, value in original.items())
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config_from_hf(written).replace(rope_style="interleaved") == model.config


@pytest.mark.slow
@needs_torch
def test_export_is_bit_exact_and_verify_passes_on_the_restatement(tmp_path):
    """hf-to-diffjax, diffjax-to-hf and verify --trust-remote-code through the CLI: the same tensor names, shapes and
    bits, config.json with the published field names, the re-statement's remote code agreeing with diffjax."""
    from safetensors.numpy import load_file

    _, directory = _saved(tmp_path, "all_on")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"),
                                                        os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "diffjax.convert", *map(str, args)], capture_output=True,
                              text=True, env=env, cwd=REPO_ROOT, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    cli("hf-to-diffjax", directory, tmp_path / "run")
    cli("diffjax-to-hf", tmp_path / "run", tmp_path / "back")
    original, back = load_file(directory / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, value in original.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == "Motif" and written["architectures"] == ["MotifForCausalLM"]
    for key, value in small_config().items():
        if key != "rope_scaling":
            assert written[key] == value, key
    assert written["rope_scaling"]["factor"] == small_config()["rope_scaling"]["factor"]
    out = cli("verify", directory, "--trust-remote-code", "--seq-len", "12")
    assert "PASS" in out


# ------------------------------------------------------------------------------ shard by shard


def _peak_growth(*args) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "diffjax.convert", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    match = re.search(r"peak memory (\d+) MiB \((-?\d+) MiB above", done.stderr)
    assert match, done.stderr
    return int(match.group(2)) * 2**20, done.stderr


@pytest.mark.slow
@needs_torch
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS of the child alone needs /proc (VmHWM)")
def test_a_many_shard_checkpoint_converts_within_a_shard_and_a_layer(tmp_path, measured):
    """A ~150 MiB Motif 3 in many shards: hf-to-diffjax grows by at most the largest shard + one layer + the
    allowance test_convert_streaming states (Orbax and thread pools), with no model term (each tensor goes into
    the checkpoint as its shard is read); diffjax-to-hf by 3 x the largest shard + that allowance; the export, MTP
    block included, is bit-exact."""
    from safetensors.numpy import load_file

    config = small_config(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=32,
                          q_lora_rank=64, kv_lora_rank=48, vocab_size=4096, num_hidden_layers=24,
                          num_nextn_predict_layers=1)
    reference = make_motif3_model(config, seed=0)
    layer_bytes = max(sum(v.numel() * v.element_size() for k, v in reference.state_dict().items()
                          if k.startswith(f"model.layers.{i}.")) for i in range(24))
    directory = tmp_path / "hf"
    reference.save_pretrained(directory, max_shard_size="2MB")
    files = sorted(directory.glob("*.safetensors"))
    sizes = [file.stat().st_size for file in files]
    model_bytes = sum(sizes)
    bound = max(sizes) + layer_bytes + 96 * 2**20
    assert len(files) >= 10 and model_bytes > bound  # holding the model would not fit
    growth, _ = _peak_growth("hf-to-diffjax", directory, tmp_path / "run")
    print(f"\nMotif 3 hf-to-diffjax, {model_bytes / 2**20:.0f} MiB in {len(files)} shards (largest "
          f"{max(sizes) / 2**20:.1f} MiB, a layer {layer_bytes / 2**20:.1f} MiB): peak growth {growth / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    measured("Motif 3 hf-to-diffjax peak growth, MiB", growth / 2**20, bound / 2**20)
    assert growth <= bound
    back = tmp_path / "back"
    export_bound = 3 * max(sizes) + 96 * 2**20  # one tensor at a time: no model term
    growth, _ = _peak_growth("diffjax-to-hf", tmp_path / "run", back, "--shard-size", "2MB")
    measured("Motif 3 diffjax-to-hf peak growth, MiB", growth / 2**20, export_bound / 2**20)
    assert growth <= export_bound
    original = {k: v for f in files for k, v in load_file(f).items()}
    assert any(k.startswith("model.mtp_layers.0.") for k in original)
    exported = {k: v for f in back.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(original)
    assert all(np.array_equal(exported[k], original[k]) for k in original)


# -------------------------------------------------------------------------------------- configs/motif3/


def _switches(path: Path) -> dict[str, list[str]]:
    """The "feature off" overrides a config's comments document: {feature: [key=value, ...]}."""
    lines = re.findall(r"^#   (\w[\w ]*?\w)\s{2,}(model\..*)$", path.read_text(), flags=re.M)
    return {name: re.findall(r"(model\.\S+=(?:\"[^\"]*\"|\S+))", overrides) for name, overrides in lines}


@pytest.mark.parametrize("name,hf", [("published", PUBLISHED), ("small", {"model_type": "Motif", **small_config()})])
def test_the_configs_are_the_published_and_small_config_json(name, hf):
    """configs/motif3/*.yaml are what the converter reads from the config.json (scan_layers, remat and the attention
    route aside: how it runs), and each documented switch turns its feature off alone in a config that builds."""
    from diffjax.train.config import load_run_config

    path = CONFIGS / f"{name}.yaml"
    model = load_run_config(path, [f"model.vocab_size={hf['vocab_size']}"]).model
    assert model.replace(scan_layers=False, attention_impl="auto", remat="none") == config_from_hf(hf)
    switches = _switches(path)
    assert set(switches) == {"mHC off", "window off", "dense only", "gate off", "YaRN off"}
    off = {name: load_run_config(path, [f"model.vocab_size={hf['vocab_size']}", *overrides]).model
           for name, overrides in switches.items()}
    assert off["mHC off"].residual == "plain" and off["gate off"].attention_options.output_gate is False
    assert off["window off"].attention_window is None and off["YaRN off"].rope_type == "default"
    assert off["dense only"].mlp_options.dense_first_layers == model.num_layers
    for config in off.values():  # the rest as it was
        assert sum(getattr(config, f) != getattr(model, f) for f in ("residual", "mlp_options", "rope_type",
                                                                    "attention_window", "attention_options")) == 1


@pytest.mark.slow
def test_the_small_config_trains_its_full_length_as_shipped(tmp_path):
    """`diffjax-train --config motif3/small` as printed (its 50 steps; no eval or sample) exits 0 with the loss well
    down. Its MoE routers' collapse guard (collapse_steps 10) looks from step 10 on: with Motif 3's
    load_balance_coeff (1e-4, too slow a bias for this learning rate) layer 3 settled on 2 experts and the run
    stopped at step 23 (exit 3)."""
    command = [sys.executable, "train.py", "--config", "motif3/small", f"train.run_dir={tmp_path / 'run'}",
               "train.eval_every=0", "train.sample_tokens=0"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    losses = [float(loss) for loss in re.findall(r"^step\s+\d+/50 \| loss ([\d.]+) \|", done.stdout, flags=re.M)]
    assert len(losses) == 50 and max(losses[-5:]) < losses[0] - 1.5, losses
