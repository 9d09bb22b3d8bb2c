"""HF -> diffjax run directory (Orbax) -> HF, against the original torch model; diffjax -> HF against transformers.

The reference is always transformers: the original model's own state_dict and logits, or
`AutoModelForCausalLM.from_pretrained` of the export, never numbers the converter produced.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import diffjax  # noqa: E402
from diffjax.convert import ConversionError, diffjax_to_hf, hf_to_diffjax  # noqa: E402
from diffjax.checkpoint import load_model  # noqa: E402
from hf_models import LLAMA3_ROPE, make_hf_model, max_relative_error, random_tokens  # noqa: E402

CASES = {
    "diffllama_mha": ("diffllama", dict(num_key_value_heads=8)),
    "diffllama_gqa_tied": ("diffllama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "diffllama_llama3_rope": ("diffllama", dict(num_key_value_heads=4, rope_parameters=LLAMA3_ROPE, head_dim=16, num_attention_heads=4)),
    "llama_mha": ("llama", dict(num_key_value_heads=8)),
    "llama_gqa_tied_llama3": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
}
# config.json fields that define the function the model computes: they must survive the round trip.
STRUCTURAL = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
              "max_position_embeddings", "bos_token_id", "eos_token_id")


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def from_pretrained(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def exported_tensors(directory):
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("case", [c if c == "llama_mha" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_hf_to_diffjax_to_hf_is_bit_exact(case, tmp_path, measured):
    kind, overrides = CASES[case]
    original = make_hf_model(kind, **overrides)
    original.save_pretrained(tmp_path / "hf", max_shard_size="60KB")  # several shards in, several out
    hf_to_diffjax(tmp_path / "hf", tmp_path / "diffjax")
    diffjax_to_hf(tmp_path / "diffjax", tmp_path / "back", max_shard_size="60KB")

    # Every tensor of the original state_dict, bit for bit (a tied model has no lm_head in either file).
    reference = {k: v for k, v in original.state_dict().items() if not (original.config.tie_word_embeddings and k == "lm_head.weight")}
    back = exported_tensors(tmp_path / "back")
    assert sorted(back) == sorted(reference)
    for key, value in reference.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        assert torch.equal(back[key], value), f"{key} differs after the round trip"
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 1
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(reference)

    before, after = json.loads((tmp_path / "hf" / "config.json").read_text()), json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: before.get(k) for k in STRUCTURAL} == {k: after.get(k) for k in STRUCTURAL}
    assert (tmp_path / "back" / "generation_config.json").exists()  # side files travel through DST/hf/

    # transformers loads the export and computes exactly the original logits.
    tokens = random_tokens(original.config.vocab_size)
    expected = torch_logits(original, tokens)
    np.testing.assert_array_equal(torch_logits(from_pretrained(tmp_path / "back"), tokens), expected)
    # The run directory loads with the trainer's load_model and computes the same function.
    model = load_model(tmp_path / "diffjax")
    assert model.config.rope_style == "interleaved"
    err = measured("converted run dir logits vs torch, max rel", max_relative_error(model(jnp.asarray(tokens)), expected), 1e-5)
    assert err <= 1e-5


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
    original = make_hf_model("diffllama", num_key_value_heads=4).to(torch.bfloat16)
    original.save_pretrained(tmp_path / "hf")
    hf_to_diffjax(tmp_path / "hf", tmp_path / "diffjax")
    assert load_model(tmp_path / "diffjax").blocks.attn.q_kernel[...].dtype == jnp.bfloat16
    diffjax_to_hf(tmp_path / "diffjax", tmp_path / "back")
    back = exported_tensors(tmp_path / "back")
    for key, value in original.state_dict().items():
        assert torch.equal(back[key], value), key
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_casts_to_bfloat16_like_torch(tmp_path):
    original = make_hf_model("llama", num_key_value_heads=4)
    original.save_pretrained(tmp_path / "hf")
    hf_to_diffjax(tmp_path / "hf", tmp_path / "diffjax")
    diffjax_to_hf(tmp_path / "diffjax", tmp_path / "back", dtype="bfloat16")
    back = exported_tensors(tmp_path / "back")
    for key, value in original.state_dict().items():  # rounding to nearest even, as torch's .to(bfloat16)
        assert torch.equal(back[key], value.to(torch.bfloat16)), key


def test_pytorch_bin_checkpoint_converts_like_safetensors(tmp_path):
    original = make_hf_model("diffllama", num_key_value_heads=4)
    original.save_pretrained(tmp_path / "hf")
    state = original.state_dict()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    names = list(state)  # two shards with an index, as transformers 4.x wrote them
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2], "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, keys in shards.items():
        torch.save({k: state[k].clone() for k in keys}, tmp_path / "bin" / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf_to_diffjax(tmp_path / "bin", tmp_path / "diffjax")
    diffjax_to_hf(tmp_path / "diffjax", tmp_path / "back")
    back = exported_tensors(tmp_path / "back")
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def random_diffjax_model(**overrides):
    """A diffjax-native model (interleaved RoPE) as the trainer makes them, with non-trivial subln and norms."""
    sizes = dict(vocab_size=61, d_model=64, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=128)
    config = diffjax.ModelConfig(**{**sizes, **overrides})
    model = diffjax.TransformerLM(config, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("scale", "subln_scale"):
            variable[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(variable.shape), variable[...].dtype)
        elif not path[-1].startswith("lambda"):
            variable[...] = variable[...] * 7.0  # larger than init, so attention is far from uniform
    return model


@pytest.mark.parametrize(
    "overrides",
    [pytest.param(dict(), marks=pytest.mark.slow), dict(tie_embeddings=True, activation="gelu_tanh"),
     dict(rope_type="llama3", rope_original_max_len=16, rope_theta=5e5), dict(rope_style="rotate_half"),
     pytest.param(dict(attention="standard", num_heads=8, num_kv_heads=4), marks=pytest.mark.slow)],
    ids=["diff_gqa", "diff_tied_gelu_tanh", "diff_llama3", "diff_rotate_half", "standard_gqa"],
)
def test_diffjax_model_exports_to_transformers(overrides, tmp_path, measured):
    """A model trained in diffjax (non-unit subln folded into o_proj) gives the same logits under transformers."""
    model = random_diffjax_model(**overrides)
    diffjax.save_hf(model, tmp_path)
    hf = from_pretrained(tmp_path)
    assert hf.config.model_type == ("llama" if model.config.attention == "standard" else "diffllama")
    tokens = random_tokens(model.config.vocab_size, (2, 48))
    err = max_relative_error(model(jnp.asarray(tokens)), torch_logits(hf, tokens))
    assert measured("diffjax vs transformers(export), max rel", err, 1e-5) <= 1e-5


def test_unexpressible_settings_are_named(tmp_path):
    model = random_diffjax_model(lambda_init=0.8)
    with pytest.raises(ConversionError, match=r"lambda_init=0.8 \(one constant for every layer\).*0.8 - 0.6 exp"):
        diffjax.save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    one_layer = random_diffjax_model(lambda_init=0.2, num_layers=1)  # equals the schedule at depth 0
    diffjax.save_hf(one_layer, tmp_path / "one")


@pytest.mark.slow
def test_converted_run_directory_trains_on_and_the_result_exports(tmp_path, measured):
    """train.py's loop continues from a converted checkpoint (fresh optimizer, step 0); its own
    checkpoint (full train state, OCDBT) then exports to HF like a converted one."""
    from diffjax.train import load_run_config, train

    make_hf_model("llama", vocab_size=260, num_hidden_layers=1).save_pretrained(tmp_path / "hf")  # >= the byte tokenizer's 257
    hf_to_diffjax(tmp_path / "hf", tmp_path / "run")
    overrides = ["train.steps=1", "parallel.data=1", "optim.warmup_steps=0", "train.batch_size=2", "data.seq_len=16", "data.builtin_bytes=50000", "data.eval_batches=1",
                 "train.eval_every=0", "train.sample_tokens=0", "train.progress=lines", "train.tensorboard=false",
                 f"train.run_dir={tmp_path / 'run'}"]
    lines = []
    result = train(load_run_config(tmp_path / "run" / "config.yaml", overrides), log=lines.append)
    assert result.step == 1
    assert any("params-only checkpoint" in line for line in lines), lines

    diffjax_to_hf(tmp_path / "run", tmp_path / "trained")  # the newest step: the trainer's step 1
    tokens = random_tokens(260)
    trained = load_model(tmp_path / "run" / "checkpoints" / "1")
    err = max_relative_error(trained(jnp.asarray(tokens)), torch_logits(from_pretrained(tmp_path / "trained"), tokens))
    assert measured("trainer checkpoint vs transformers(export), max rel", err, 1e-5) <= 1e-5
    converted = load_model(tmp_path / "run" / "checkpoints" / "0")
    assert not np.array_equal(np.asarray(converted.blocks.mlp.up_kernel[0]), np.asarray(trained.blocks.mlp.up_kernel[0]))


def test_existing_destination_is_refused(tmp_path):
    make_hf_model("llama", num_hidden_layers=1).save_pretrained(tmp_path / "hf")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        hf_to_diffjax(tmp_path / "hf", tmp_path / "dst")
    hf_to_diffjax(tmp_path / "hf", tmp_path / "dst", overwrite=True)
    hf_to_diffjax(tmp_path / "hf", tmp_path / "dst", overwrite=True)  # replaces its own earlier conversion
    assert (tmp_path / "dst" / "notes.txt").read_text() == "keep me"
    with pytest.raises(FileExistsError, match="not empty"):
        diffjax_to_hf(tmp_path / "dst", tmp_path / "hf")
