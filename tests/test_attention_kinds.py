"""Every attention kind in diffjax.attention_kinds, walked through what diffjax does with a kind: its label,
parameter count against the built model, FLOPs, every analysis it lists, a gradient step, a KV-cache decode
and its converters' round trips; and a toy kind defined in this file (a table entry plus one module) that
trains, generates and is described without any other file knowing it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import attention_kinds
from diffjax.analysis import attention_scores, common, needles, outliers, quantization
from diffjax.analysis.probe import make_probe
from diffjax.config import ModelConfig
from diffjax.convert import ConversionError, formats, unilm
from diffjax.data.config import DataConfig
from diffjax.losses import next_token_loss
from diffjax.model import AttentionModule, TransformerLM
from diffjax.model.layers import normal_param, ones_param
from diffjax.model.rope import apply_rope
from diffjax.tokenizers import ByteTokenizer
from diffjax.train.metrics import matmul_params, training_flops_per_token

KINDS = attention_kinds.names()  # the built-in kinds (collected before any test registers one)
TOKENIZER = ByteTokenizer()
TASK = needles.NeedleTask(lengths=(100,), num_needles=2, num_queries=1, depths=(0, 100), samples=1, digits=3)


def tiny(name: str) -> ModelConfig:
    """Two layers, GQA; as many output heads' worth of values as d_model has (value_width x heads x d)."""
    heads = 4 // attention_kinds.get(name).value_width
    return ModelConfig(vocab_size=257, d_model=32, num_layers=2, num_heads=heads, num_kv_heads=heads // 2,
                       max_seq_len=192, attention=name, attention_impl="xla", init_std=0.2, lambda_std=0.3)


@pytest.fixture(scope="module")
def models():
    return {name: nnx.jit(lambda config=tiny(name): TransformerLM(config, rngs=nnx.Rngs(0)))() for name in KINDS}


def _packed_batch():
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 1, 257)
    segment_ids = jnp.array([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4])
    positions = jnp.where(segment_ids == 2, jnp.arange(24) - 10, jnp.arange(24))
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids}


def test_the_table_names_the_built_in_kinds():
    assert set(KINDS) >= {"diff", "standard", "diff_v2", "shared_diff", "gda"}
    with pytest.raises(ValueError, match=r"attention must be one of \(.*'diff'.*\), got 'nope'"):
        attention_kinds.get("nope")
    with pytest.raises(ValueError, match="two maps need a lambda and one map none"):
        attention_kinds.AttentionKind(name="bad", label="Bad", module="x:Y", maps=2, value_width=1, lambda_form="none",
                                      attention_params=lambda c: 0, attention_flops=lambda c, t: 0)


# Every kind on CI's oldest-jax leg; DIFF V1 alone on the newest (the kinds share every path below the module).
@pytest.mark.parametrize("name", [n if n == "diff" else pytest.param(n, marks=pytest.mark.single_leg) for n in KINDS])
@pytest.mark.slow
def test_kind_walks_through_diffjax(name, models, measured):
    kind, model = attention_kinds.get(name), models[name]
    config = model.config
    # Label and parameter count.
    assert common.describe(model).startswith(f"{kind.label} ({config.num_heads} {'diff ' if kind.maps == 2 else ''}heads")
    assert model.num_params() == config.param_count()
    # FLOPs: the attention term is the table's per-layer formula, linear in the context (the comparison with XLA's
    # own count walks the table in test_train_config.py).
    attention = [training_flops_per_token(config, seq) - 6 * matmul_params(config) for seq in (64, 128)]
    assert attention[1] == pytest.approx(2 * attention[0]) and attention[0] > 0
    # A gradient step: finite, and every parameter takes part.
    batch = _packed_batch()
    targets = batch["segment_ids"] != 0
    grads = nnx.grad(lambda m: next_token_loss(m(batch["tokens"], batch["positions"], batch["segment_ids"]),
                                               batch["tokens"], targets))(model)
    for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param)):
        assert np.isfinite(np.asarray(g[...])).all() and np.abs(np.asarray(g[...])).max() > 0, path
    # Every analysis the table lists, through the probe (the kind's explicit_maps).
    checkpoint = common.Checkpoint(name, model, TOKENIZER, DataConfig(seq_len=24))
    assert set(kind.analyses) == set(attention_kinds.ANALYSES)
    stats = outliers.statistics(model, [batch], median_sample=1 << 20)
    assert stats.top_k("attention logits", 1) > 0 and stats.median["hidden states"] > 0
    scores = attention_scores.evaluate(checkpoint, TASK, batch_size=2)
    assert all(np.isfinite(scores.answer[depth]).all() for depth in TASK.depths)
    result = quantization.evaluate(checkpoint, [batch], TASK, bits=(4,), batch_size=2)  # needles too
    assert set(result.metrics) == {(b, m) for b in (None, 4) for m in quantization.METRICS}
    # The probe runs the model's own forward: its logits equal the model's.
    logits, _ = make_probe(model)(batch["tokens"], batch["positions"], batch["segment_ids"])
    expected = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    assert measured(f"probe vs model logits ({name})", float(jnp.abs(logits - expected).max()), 1e-5) <= 1e-5
    # A KV-cache decode equals greedy decoding by full forwards (causal: one forward over prompt + generated
    # tokens gives, at each position, what a forward over the prefix ending there gives).
    prompt = np.asarray(batch["tokens"][:1, :6])
    generated = np.asarray(diffjax.generate(model, prompt, 4))[0]
    full = np.asarray(jnp.argmax(model(jnp.asarray(np.concatenate([prompt[0], generated])[None]))[0], axis=-1))
    assert generated.tolist() == full[5:9].tolist()


def _exportable(config):
    """The tiny model's config as its checkpoint format holds it (Motif's: its own lambda schedule); None where no
    format holds the kind's tiny model (Motif 3's blocks are tests/test_motif3.py's)."""
    try:
        if formats.of_config(config).name == "motif":
            config = config.replace(lambda_init_depth_offset=-1)
        formats.check_exportable(config)
        return config
    except ConversionError:
        return None


@pytest.mark.parametrize("name", [n for n in KINDS if _exportable(tiny(n))])
def test_kind_round_trips_through_its_hf_format(name, models, tmp_path):
    pytest.importorskip("safetensors")
    model = models[name]
    if (config := _exportable(model.config)) != model.config:
        model = TransformerLM(config, rngs=nnx.Rngs(0))
    out = diffjax.save_hf(model, tmp_path / "hf")
    back = diffjax.load_hf(out)
    assert back.config.attention == name
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)), nnx.to_flat_state(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


@pytest.mark.parametrize("name", [n for n in KINDS if n in unilm.MODULES.values()])
def test_kind_round_trips_through_its_unilm_module(name, models):
    from diffjax.convert import load_unilm_attention
    from diffjax.convert.unilm import unilm_attention_state_dict

    layer = models[name].layer(1).attn
    back = load_unilm_attention(unilm_attention_state_dict(layer), depth=1, rope_theta=layer.config.rope_theta)
    assert back.config.attention == name
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(layer, nnx.Param)), nnx.to_flat_state(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


@pytest.mark.slow
def test_two_map_outlier_medians_sample_both_maps():
    """With every value sampled, the median of the attention logits is the median over both maps of every
    two-map kind (Shared DIFF's second map was never sampled before the table)."""
    for name in (n for n in KINDS if attention_kinds.get(n).maps == 2):
        model = nnx.jit(lambda config=tiny(name): TransformerLM(config, rngs=nnx.Rngs(0)))()
        batch = _packed_batch()
        stats = outliers.statistics(model, [batch], median_sample=1 << 22)
        _, observed = make_probe(model, lambda view, aux: (view.logits_MBHTS, view.counted_BTS))(
            batch["tokens"], batch["positions"], batch["segment_ids"])
        values = np.concatenate([np.abs(np.asarray(s))[np.broadcast_to(np.asarray(c)[None, :, None], s.shape)]
                                 for s, c in observed])
        assert stats.median["attention logits"] == pytest.approx(float(np.median(values)), rel=1e-6), name


# ------------------------------------------------------------------------------ a kind defined here


class GatedAttention(AttentionModule):
    """The baseline's attention with a learned gate per head on its output: a toy kind."""

    def __init__(self, config, depth=None, *, rngs):
        D, N, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        self.config = config
        self.q_kernel = normal_param(rngs, (D, N, d), config.init_std, config.param_dtype, ("embed", "heads", "head_dim"))
        self.k_kernel = normal_param(rngs, (D, K, d), config.init_std, config.param_dtype, ("embed", "kv_heads", "head_dim"))
        self.v_kernel = normal_param(rngs, (D, K, d), config.init_std, config.param_dtype, ("embed", "kv_heads", "head_dim"))
        self.o_kernel = normal_param(rngs, (N, d, D), config.init_std, config.param_dtype, ("heads", "head_dim", "embed"))
        self.gate = ones_param((N,), config.param_dtype, ("heads",))

    def project(self, x_BTD, rope_cos_sin):
        cos, sin = rope_cos_sin
        q, k, v = (jnp.einsum("btD,Dnd->btnd", x_BTD, w[...].astype(x_BTD.dtype))
                   for w in (self.q_kernel, self.k_kernel, self.v_kernel))
        return apply_rope(q, cos, sin, self.config.rope_style), apply_rope(k, cos, sin, self.config.rope_style), v

    def output(self, o_BTNd, constants):
        return self._out_projection(o_BTNd * self.gate[...].astype(o_BTNd.dtype)[:, None], o_BTNd.dtype)


GATED = attention_kinds.AttentionKind(
    name="toy_gated", label="Gated toy", module=GatedAttention, maps=1, value_width=1, lambda_form="none",
    attention_params=lambda c: 2 * c.d_model * c.num_heads * c.head_dim + 2 * c.d_model * c.num_kv_heads * c.head_dim + c.num_heads,
    vector_params=lambda c: c.num_heads, attention_flops=lambda c, context: 4 * c.num_heads * c.head_dim * context,
)


@pytest.fixture
def gated_kind():
    attention_kinds.register(GATED)
    yield GATED
    attention_kinds.unregister(GATED.name)


def test_a_kind_defined_in_a_test_file_trains_generates_and_is_described(gated_kind, tmp_path):
    from diffjax.checkpoint import load_model
    from diffjax.train import train
    from test_trainer import _config

    run_dir = tmp_path / "run"
    result = train(_config(run_dir, "model.attention=toy_gated", "model.num_heads=4", "model.num_kv_heads=2",
                           "model.num_layers=1", "train.steps=2", "train.sample_tokens=4"), log=lambda _: None)
    assert np.isfinite(list(result.losses.values())).all() and result.sample
    model = load_model(run_dir)
    assert isinstance(model.blocks.attn, GatedAttention) and model.num_params() == model.config.param_count()
    assert common.describe(model).startswith("Gated toy (4 heads")
    assert np.asarray(diffjax.generate(model, [[104, 105]], 3)).shape == (1, 3)
    stats = outliers.statistics(model, [_packed_batch()])
    assert stats.tokens == int(np.count_nonzero(_packed_batch()["segment_ids"]))
