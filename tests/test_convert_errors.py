"""Bad checkpoints and configs get one clear error naming what is wrong and what is allowed."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from diffjax.convert import ConversionError, hf_to_diffjax, load_hf  # noqa: E402
from hf_models import make_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    make_hf_model("diffllama", num_key_value_heads=4, num_hidden_layers=2).save_pretrained(directory)
    return directory


@pytest.fixture
def checkpoint(hf_dir, tmp_path):
    for file in hf_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    return tmp_path


def edit_weights(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def edit_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_and_unexpected_keys_are_all_listed(checkpoint):
    def edit(tensors):
        tensors.pop("model.layers.1.self_attn.lambda_k2")
        tensors.pop("model.layers.0.mlp.up_proj.weight")
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        tensors["score.weight"] = torch.zeros(2, 64)

    edit_weights(checkpoint, edit)
    with pytest.raises(ConversionError) as error:
        hf_to_diffjax(checkpoint, checkpoint.parent / "out")
    message = str(error.value)
    assert "missing 2 key(s): model.layers.0.mlp.up_proj.weight, model.layers.1.self_attn.lambda_k2" in message
    assert "2 unexpected key(s)" in message and "model.layers.0.self_attn.q_proj.bias, score.weight" in message
    assert not (checkpoint.parent / "out").exists()  # a failed conversion leaves nothing behind


def test_shape_mismatch_names_key_expected_and_found(checkpoint):
    def edit(tensors):
        tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:-8].clone()

    edit_weights(checkpoint, edit)
    with pytest.raises(ConversionError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(24, 64\), expected \(32, 64\)"):
        load_hf(checkpoint)


def test_a_config_off_by_one_dimension_is_a_readable_line(checkpoint):
    """hidden_size off by 8 mis-shapes every tensor: the first few and a count, not each (issue 55 item 11; the
    Motif 3 path: test_motif3.py)."""
    edit_config(checkpoint, hidden_size=72)
    with pytest.raises(ConversionError) as error:
        load_hf(checkpoint)
    message = str(error.value)
    assert len(message) < 600 and "\n" not in message, message
    assert message.startswith("21 checkpoint tensor(s) have another shape than this config's: "
                              "'model.embed_tokens.weight' has shape (97, 64), expected (97, 72); "), message
    assert message.endswith(" and 18 more"), message


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="mistral"), r"model_type 'mistral' is not supported; supported: \('diffllama', 'llama', 'motif'\)"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'yarn' is not supported; supported: 'default', 'llama3'"),
        (dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic' is not supported"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_parameters and rope_scaling disagree on rope_type"),
        (dict(mlp_bias=True), "mlp_bias=true is not supported"),
        (dict(attention_bias=True), "attention_bias=true is not supported"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5 is not supported"),
        (dict(hidden_act="relu"), "hidden_act 'relu' is not supported"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "llama3 rope scaling is missing 'low_freq_factor'"),
    ],
)
def test_unsupported_settings_are_named(checkpoint, changes, message):
    edit_config(checkpoint, **changes)
    with pytest.raises(ConversionError, match=message):
        hf_to_diffjax(checkpoint, checkpoint.parent / "out")


class RunsCode:
    """What a malicious pickle looks like: unpickling calls an arbitrary function."""

    def __reduce__(self):
        import builtins

        return builtins.exec, ("open(__import__('os').environ['DIFFJAX_PWNED'], 'w').write('pwned')",)


def test_bin_with_code_is_refused_not_run(checkpoint, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("DIFFJAX_PWNED", str(marker))
    state = {k: v for k, v in load_file(checkpoint / "model.safetensors").items()}
    (checkpoint / "model.safetensors").unlink()
    torch.save({**state, "payload": RunsCode()}, checkpoint / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"pytorch_model.bin: refused to load: .*Python objects other than tensors"):
        hf_to_diffjax(checkpoint, tmp_path / "out")
    assert not marker.exists(), "the pickle's payload ran"
    # The same tensors without the payload load (so the refusal is about the payload, not the format).
    torch.save(state, checkpoint / "pytorch_model.bin")
    assert load_hf(checkpoint).config.num_layers == 2


def test_safetensors_preferred_over_bin(checkpoint):
    (checkpoint / "pytorch_model.bin").write_bytes(b"not a pickle at all")  # never opened
    assert load_hf(checkpoint).config.num_layers == 2


def test_truncated_or_foreign_files(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_hf(checkpoint)
    (checkpoint / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_hf(checkpoint)


def test_a_garbage_header_or_config_is_named_in_one_line(checkpoint):
    import struct

    safetensors = checkpoint / "model.safetensors"
    safetensors.write_bytes(struct.pack("<Q", 8) + b"\xff{garbage")  # a plausible length, then no JSON
    with pytest.raises(ValueError, match=rf"^{safetensors}: not a safetensors file \(its header is not valid JSON"):
        load_hf(checkpoint)
    safetensors.write_bytes(struct.pack("<Q", 6) + b"[1, 2]")
    with pytest.raises(ValueError, match=rf"^{safetensors}: not a safetensors file \(its header is a JSON list"):
        load_hf(checkpoint)
    (checkpoint / "config.json").write_text("[1, 2]")
    with pytest.raises(ConversionError, match=r"config.json: a JSON list, not an object of the model's settings"):
        load_hf(checkpoint)


def test_index_naming_absent_shard(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConversionError, match=r"names file\(s\) that do not exist: \['model-00001-of-00002.safetensors'\]"):
        load_hf(checkpoint)


def test_shard_size_and_export_dtype_are_checked(tmp_path):
    from flax import nnx

    import diffjax

    model = diffjax.TransformerLM(diffjax.ModelConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
    with pytest.raises(ConversionError, match="shard size '5 parsecs' is not a size"):
        diffjax.save_hf(model, tmp_path / "a", max_shard_size="5 parsecs")
    with pytest.raises(ConversionError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        diffjax.save_hf(model, tmp_path / "b", dtype="int8")


def test_training_only_setting_is_named_and_dropped(checkpoint, tmp_path, caplog):
    """attention_dropout changes nothing at inference: the import says so, the export writes 0
    (transformers 5 refuses DiffLlama with attention_dropout > 0)."""
    from diffjax.convert import diffjax_to_hf

    edit_config(checkpoint, attention_dropout=0.1)
    with caplog.at_level("WARNING"):
        hf_to_diffjax(checkpoint, tmp_path / "diffjax")
    assert "attention_dropout=0.1" in caplog.text
    diffjax_to_hf(tmp_path / "diffjax", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["attention_dropout"] == 0.0
