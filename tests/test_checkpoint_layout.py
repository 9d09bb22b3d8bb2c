"""Checkpoints written before the blocks' params were stacked (one "blocks/<i>" entry per layer) still load."""

import jax
import numpy as np
import pytest
from flax import nnx

from diffjax.checkpoint import CheckpointParams, load_model, load_params, refuse_per_layer, save_params
from diffjax.config import ModelConfig
from diffjax.model import TransformerLM

CONFIG = ModelConfig(vocab_size=32, d_model=16, num_layers=3, num_heads=2, max_seq_len=16)


@pytest.fixture(scope="module")
def per_layer_checkpoint(tmp_path_factory):
    """A params-only checkpoint in the old layout, made by unstacking a model's params; and those params."""
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(TransformerLM(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)))
    layers = [jax.tree.map(lambda x, i=i: x[i], params["blocks"]) for i in range(CONFIG.num_layers)]
    per_layer = {**params, "blocks": dict(enumerate(layers))}
    step_dir = save_params(tmp_path_factory.mktemp("old") / "run", per_layer, CONFIG)
    return step_dir, params


def test_per_layer_checkpoints_are_stacked_on_read(per_layer_checkpoint):
    step_dir, params = per_layer_checkpoint
    expected = nnx.to_flat_state(nnx.state(TransformerLM(CONFIG, rngs=nnx.Rngs(0)), nnx.Param))
    loaded = dict(nnx.to_flat_state(nnx.state(load_model(step_dir), nnx.Param)))
    for path, value in expected:
        np.testing.assert_array_equal(np.asarray(loaded[path][...]), np.asarray(value[...]), err_msg=str(path))
    host = load_params(step_dir)
    np.testing.assert_array_equal(host["blocks"]["mlp"]["up_kernel"], np.asarray(params["blocks"]["mlp"]["up_kernel"]))
    lazy = CheckpointParams(step_dir)
    key = ("blocks", "attn", "q_kernel")
    assert lazy.shapes[key] == params["blocks"]["attn"]["q_kernel"].shape
    np.testing.assert_array_equal(lazy[key], np.asarray(params["blocks"]["attn"]["q_kernel"]))
    np.testing.assert_array_equal(lazy.layer(key, 2), np.asarray(params["blocks"]["attn"]["q_kernel"][2]))


def test_resuming_a_per_layer_train_state_is_refused_with_the_fix(per_layer_checkpoint):
    step_dir, _ = per_layer_checkpoint
    with pytest.raises(ValueError, match="one entry per layer.*train.init_from="):
        refuse_per_layer(step_dir, "resume")


def test_stacked_checkpoints_read_one_layer(tmp_path):
    params = nnx.to_pure_dict(nnx.state(TransformerLM(CONFIG, rngs=nnx.Rngs(1)), nnx.Param))
    step_dir = save_params(tmp_path / "run", params, CONFIG)
    refuse_per_layer(step_dir, "resume")  # stacked: nothing to refuse
    lazy = CheckpointParams(step_dir)
    for depth in range(CONFIG.num_layers):
        np.testing.assert_array_equal(lazy.layer(("blocks", "mlp", "down_kernel"), depth),
                                      np.asarray(params["blocks"]["mlp"]["down_kernel"][depth]))


def test_loading_logs_no_orbax_metadata_warning(per_layer_checkpoint, caplog):
    """Orbax warned "Metadata file does not exist: .../state/_CHECKPOINT_METADATA" on every load (generate, the
    analyses, load_model, init_from): the checkpoint is fine, so the loaders silence that one message."""
    import logging

    step_dir, _ = per_layer_checkpoint
    with caplog.at_level(logging.WARNING):
        load_model(step_dir)
        load_params(step_dir)
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]
