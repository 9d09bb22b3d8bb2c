"""load_hf on the checkpoint shapes users have (sharded, bare base model) and on broken ones."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

import diffjax
from hf_models import make_hf_model, max_relative_error, random_tokens


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model("diffllama", num_key_value_heads=4)


@pytest.fixture
def checkpoint(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    return tmp_path


def reference_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_sharded_checkpoint_loads(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    tokens = random_tokens(hf_model.config.vocab_size)
    model = diffjax.load_hf(tmp_path)
    assert max_relative_error(model(jnp.asarray(tokens)), reference_logits(hf_model, tokens)) <= 1e-5


@pytest.mark.slow
def test_dtype_argument_casts(checkpoint):
    model = diffjax.load_hf(checkpoint, dtype="bfloat16")
    assert model.blocks.attn.q_kernel[...].dtype == jnp.bfloat16
    assert model(np.zeros((1, 4), np.int32)).dtype == jnp.float32  # logits stay float32


def rewrite_weights(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_key_is_named(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.pop("model.layers.1.self_attn.lambda_k2"))
    with pytest.raises(ValueError, match="missing 1 key\\(s\\): model.layers.1.self_attn.lambda_k2"):
        diffjax.load_hf(checkpoint)


def test_misshaped_key_is_named(checkpoint):
    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1].clone()

    rewrite_weights(checkpoint, shrink)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(95, 64\), expected \(96, 64\)"):
        diffjax.load_hf(checkpoint)


def test_untied_config_without_lm_head_is_an_error(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        diffjax.load_hf(checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="mistral"), "model_type 'mistral' is not supported"),
        (dict(attention_bias=True), "attention_bias=true is not supported"),
        (dict(num_key_value_heads=3), "even num_attention_heads and num_key_value_heads"),
        (dict(hidden_act="relu2"), "hidden_act 'relu2' is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'yarn' is not supported"),
    ],
)
def test_unsupported_configs_are_named(checkpoint, changes, message):
    rewrite_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=message):
        diffjax.load_hf(checkpoint)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        diffjax.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="missing required key\\(s\\) \\['vocab_size', 'intermediate_size'"):
        diffjax.load_hf(tmp_path)
    sizes = dict(vocab_size=10, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, **sizes}))
    with pytest.raises(FileNotFoundError, match="no .safetensors files"):
        diffjax.load_hf(tmp_path)
