"""The multi-token-prediction block (ModelConfig.mtp_depths) whatever the model around it: its layer's fields, each
combination of them training or refused in one line."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model import TransformerLM
from diffjax.train.config import load_run_config

TINY = dict(vocab_size=64, d_model=16, num_layers=1, num_heads=1, max_seq_len=16)


def _one_step(config: ModelConfig) -> dict:
    """The metrics of one train step of a fresh model (2 micro-batches of 1 x 12 tokens, 2 documents a row)."""
    from diffjax.train.step import init_state, make_train_step

    model = TransformerLM(config, rngs=nnx.Rngs(0))
    tx = optax.adam(1e-2)
    step = jax.jit(make_train_step(nnx.graphdef(model), tx, optax.constant_schedule(1e-2), config))
    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 1, 12))
    batch = {"tokens": tokens, "positions": np.broadcast_to(np.arange(12), tokens.shape),
             "segment_ids": np.broadcast_to(np.where(np.arange(12) < 7, 1, 2), tokens.shape)}
    return step(init_state(model, tx, jax.random.key(0)), batch)[1]


def test_an_mhc_model_s_mtp_layer_is_plain_unless_told():
    """Issue 62: MTP on an mHC model (the shipped motif3/small with model.mtp_depths=1) gets a plain residual in its
    MTP layer, as Motif 3's and DeepSeek-V3's MTP blocks have; mtp_layer.residual=mhc gives it the model's mHC."""
    shipped = load_run_config("motif3/small", ["model.mtp_depths=1"]).model
    assert (shipped.residual, shipped.mtp_layer_config().residual) == ("mhc", "plain")
    assert shipped.mtp_layer_config().residual_options is None
    asked = shipped.replace(mtp_layer={"residual": "mhc"}).mtp_layer_config()
    assert (asked.residual, asked.residual_options) == ("mhc", shipped.residual_options)


@pytest.mark.slow
def test_an_mtp_layer_plain_or_with_mhc_streams_trains_on_an_mhc_model():
    """Both MTP layers of an mHC model train: the plain one, and one with mHC streams of its own (expanded from the
    depth's input, collapsed before its final norm; on main its first step died in mhc.gates)."""
    config = ModelConfig(**TINY, residual="mhc", residual_options={"streams": 2, "sinkhorn_iters": 1}, mtp_depths=1)
    for model in (config, config.replace(mtp_layer={"residual": "mhc"})):
        metrics = _one_step(model)
        assert bool(metrics["ok"]) and 3.0 < float(metrics["mtp_loss/depth_1"]) < 6.0  # ~ln 64 at init
