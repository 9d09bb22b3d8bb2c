"""ModelConfig validation and sizes, bad input, and model-level properties (packing, jit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import ModelConfig

TINY = dict(vocab_size=50, d_model=32, num_layers=2, num_heads=2)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(d_model=30, num_heads=4), "d_model (30) must be divisible by 2 * num_heads (8)"),
        (dict(num_heads=4, num_kv_heads=3), "num_heads (4) must be divisible by num_kv_heads (3)"),
        (dict(attention="linear"), "attention must be one of"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(lambda_init=1.5), "lambda_init must be None"),
        (dict(rope_type="dynamic"), "rope_type must be one of"),
        (dict(rope_type="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0), "rope_low_freq_factor < rope_high_freq_factor"),
        (dict(head_dim=7), "head_dim must be even"),
        (dict(attention_options={"rank": 4}), "attention_options: 'diff' has no options, got {'rank': 4}"),
        (dict(attention="gda", attention_options={"rank": 4}), "unknown config key attention_options.rank; valid keys under attention_options: num_noise_heads"),
        (dict(attention="gda", attention_options={"num_noise_heads": 0}), "attention_options.num_noise_heads must be a positive integer, got 0"),
        (dict(mlp="kan"), "mlp must be one of ('gated', 'polynorm', 'moe'), got 'kan'"),
        (dict(residual="hyper"), "residual must be one of ('plain', 'mhc'), got 'hyper'"),
        (dict(attention_impl="pallas_gpu", attention="standard"), "attention_impl 'pallas_gpu' (the fused Mosaic GPU kernels) needs dtype bfloat16 or float16"),
    ],
)
def test_config_errors_name_the_problem(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        ModelConfig(**{**TINY, **fields})


def test_config_takes_pallas_gpu_for_both_attentions_in_16_bit():
    for attention in ("diff", "standard"):
        assert ModelConfig(**{**TINY, "attention_impl": "pallas_gpu", "attention": attention, "dtype": "bfloat16"}).attention == attention


def test_config_derives_sizes_and_rederives_on_replace():
    config = ModelConfig(vocab_size=100, d_model=1024, num_layers=1, num_heads=8)
    assert (config.head_dim, config.num_kv_heads) == (64, 8)  # d = D / (2H): unilm's example
    baseline = config.replace(attention="standard", num_heads=16)
    assert (baseline.head_dim, baseline.num_kv_heads) == (64, 16)
    v2 = config.replace(attention="diff_v2", num_heads=16)  # V2's heads are the baseline's: d = D / h
    assert (v2.head_dim, v2.num_kv_heads) == (64, 16)
    shared = config.replace(attention="shared_diff")  # d = D / 2H as DIFF; rank d_model / 16 unless given
    assert (shared.head_dim, shared.attention_options.rank) == (64, 64)
    assert shared.replace(attention="diff").attention_options is None  # a kind's options go with the kind
    assert shared.replace(d_model=512).attention_options.rank == 32  # a derived rank is derived again
    assert shared.replace(attention_options={"rank": 8}).replace(d_model=512).attention_options.rank == 8
    explicit = ModelConfig(vocab_size=100, d_model=1000, num_layers=1, num_heads=7, head_dim=128)
    assert explicit.head_dim == 128  # explicit head_dim lifts the divisibility rule (Shared DIFF shapes)
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert ModelConfig.from_dict(shared.to_dict()) == shared and "attention_options" not in config.to_dict()
    with pytest.raises(ValueError, match=r"unknown ModelConfig keys heads \(did you mean num_heads or head_dim\?\); valid keys"):
        ModelConfig.from_dict({"heads": 3})


def test_lambda_init_schedule_matches_published_table():
    # The paper's schedule 0.8 - 0.6 exp(-0.3 depth), as unilm's lambda_init_fn (0-based depth).
    table = [0.2, 0.355509, 0.470713, 0.556058, 0.619283, 0.666122, 0.700821, 0.726526]
    config = ModelConfig(**TINY)
    np.testing.assert_allclose([config.lambda_init_at(depth) for depth in range(8)], table, atol=1e-6)
    assert ModelConfig(**TINY, lambda_init=0.8).lambda_init_at(5) == 0.8
    model = diffjax.TransformerLM(ModelConfig(**{**TINY, "num_layers": 3}), rngs=nnx.Rngs(0))
    np.testing.assert_allclose([model.layer(depth).attn.lambda_init for depth in range(3)], table[:3], atol=1e-6)
    np.testing.assert_allclose(model.depth_constants(jnp.float32)["lambda_init"], table[:3], atol=1e-6)


# Table 9 of the paper: DIFF sizes with vocab 100288, FFN 8/3 d_model, one embedding matrix counted.
TABLE_9 = {"830M": (0.83e9, 1536, 24, 8), "1.4B": (1.4e9, 2048, 24, 8), "2.8B": (2.8e9, 2560, 32, 10),
           "6.8B": (6.8e9, 4096, 32, 16), "13.1B": (13.1e9, 5120, 40, 20)}


@pytest.mark.parametrize("size", list(TABLE_9))
def test_param_count_matches_paper_table_9(size, measured):
    target, d_model, layers, heads = TABLE_9[size]
    diff = ModelConfig(vocab_size=100288, d_model=d_model, num_layers=layers, num_heads=heads)
    baseline = diff.replace(attention="standard", num_heads=2 * heads)
    for config in (diff, baseline):
        error = abs(config.param_count(include_lm_head=False) / target - 1)
        assert error <= 0.015, f"{config.attention}: {config.param_count(include_lm_head=False):,} vs {target:,.0f}"
    measured("param count rel err vs paper", abs(diff.param_count(include_lm_head=False) / target - 1), 0.015)


@pytest.mark.parametrize(
    "fields",
    [dict(), dict(num_kv_heads=1), dict(tie_embeddings=True), dict(attention="standard", num_kv_heads=1), dict(mlp_dim=40),
     dict(attention="diff_v2", num_heads=4, num_kv_heads=2), dict(attention="shared_diff", num_kv_heads=1, attention_options={"rank": 3})],
)
def test_param_count_equals_the_arrays(fields):
    config = ModelConfig(**{**TINY, **fields})
    abstract = nnx.eval_shape(lambda: diffjax.TransformerLM(config, rngs=nnx.Rngs(0)))
    assert abstract.num_params() == config.param_count()


# ---------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny_model():
    return diffjax.TransformerLM(ModelConfig(**TINY), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bad_id", [50, -1, 10**6])
def test_token_ids_outside_vocab_raise(tiny_model, bad_id):
    tokens = np.zeros((1, 8), np.int32)
    tokens[0, 3] = bad_id
    with pytest.raises(ValueError, match=f"token id {bad_id} is outside the vocabulary \\[0, 50\\)"):
        tiny_model(tokens)


def test_token_ids_outside_vocab_under_jit_give_nan_not_a_clamped_row(tiny_model):
    """Inside jit the ids cannot be checked; the bad row reads NaN (0 * NaN poisons the whole
    sequence through attention), so the loss is NaN rather than silently wrong."""
    logits = nnx.jit(lambda model, tokens: model(tokens))(tiny_model, jnp.array([[1, 2, 50], [1, 2, 3]], jnp.int32))
    assert np.isnan(np.asarray(logits[0, 2])).all() and np.isfinite(np.asarray(logits[1])).all()


def test_the_embedding_gradient_sums_in_float32_in_a_bfloat16_model():
    """The lookup in bfloat16 reads the same rows as casting the table first; its gradient is each id's cotangents
    summed in float32 (against float64 numpy): 4,000 cotangents of one id summed in bfloat16 would be off by ~1%.
    Ids outside the table read NaN rows and get no gradient."""
    from diffjax.model.layers import embedding_lookup

    V, D, dtype = 64, 16, jnp.dtype(jnp.bfloat16)
    table_VD = jax.random.normal(jax.random.key(0), (V, D))
    ids_BT = jnp.concatenate([jnp.full((2, 2000), 5), jnp.arange(64).reshape(2, 32) % V, jnp.full((2, 1), V + 3)], axis=1)
    rows_BTD = jax.jit(embedding_lookup, static_argnums=2)(table_VD, ids_BT, dtype)
    expected = jnp.take(table_VD.astype(dtype), ids_BT, axis=0, mode="fill", fill_value=jnp.nan)
    assert rows_BTD.dtype == dtype and np.array_equal(np.asarray(rows_BTD), np.asarray(expected), equal_nan=True)
    assert np.isnan(np.asarray(rows_BTD[:, -1], np.float32)).all()

    cotangents_BTD = jax.random.normal(jax.random.key(1), rows_BTD.shape).astype(dtype)
    grad_VD = jax.jit(jax.grad(lambda t: jnp.sum(jnp.where(jnp.isnan(r := embedding_lookup(t, ids_BT, dtype)), 0, r)
                                                 .astype(jnp.float32) * cotangents_BTD.astype(jnp.float32))))(table_VD)
    reference = np.zeros((V, D))
    ids = np.asarray(ids_BT).ravel()
    inside = ids < V
    np.add.at(reference, ids[inside], np.asarray(cotangents_BTD, np.float64).reshape(-1, D)[inside])
    assert grad_VD.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grad_VD), reference, rtol=1e-5, atol=1e-5)


def test_bad_token_shapes_and_dtypes(tiny_model):
    with pytest.raises(ValueError, match="tokens must have shape \\[batch, length\\]"):
        tiny_model(np.zeros((8,), np.int32))
    with pytest.raises(TypeError, match="tokens must be an integer array"):
        tiny_model(np.zeros((1, 8), np.float32))
    with pytest.raises(ValueError, match="sequence length 3000 exceeds max_seq_len 2048"):
        tiny_model(np.zeros((1, 3000), np.int32))


# ---------------------------------------------------------------------------- properties


@pytest.mark.parametrize("attention", [pytest.param("diff", marks=pytest.mark.slow), "standard"])
def test_packed_documents_equal_documents_alone(attention):
    """With per-document positions and segment ids, attention never crosses documents."""
    model = diffjax.TransformerLM(ModelConfig(**TINY, attention=attention), rngs=nnx.Rngs(1))
    rng = np.random.RandomState(0)
    docs = [rng.randint(0, 50, n).astype(np.int32) for n in (5, 9, 2)]
    packed = np.concatenate(docs)[None]
    positions = np.concatenate([np.arange(len(doc)) for doc in docs])[None]
    segments = np.concatenate([np.full(len(doc), i) for i, doc in enumerate(docs)])[None]
    logits = np.asarray(model(packed, positions, segments))
    start = 0
    for doc in docs:
        alone = np.asarray(model(doc[None]))
        np.testing.assert_allclose(logits[0, start : start + len(doc)], alone[0], atol=1e-5)
        start += len(doc)


def test_jit_and_eager_agree(tiny_model):
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 50, (2, 12)), jnp.int32)
    jitted = nnx.jit(lambda model, tokens: model(tokens))(tiny_model, tokens)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(tiny_model(tokens)), atol=1e-5)


def test_causality(tiny_model):
    """Changing a later token never changes earlier logits."""
    tokens = np.random.RandomState(0).randint(0, 50, (1, 12)).astype(np.int32)
    changed = tokens.copy()
    changed[0, 7] = (changed[0, 7] + 1) % 50
    a, b = np.asarray(tiny_model(tokens)), np.asarray(tiny_model(changed))
    np.testing.assert_allclose(a[0, :7], b[0, :7], atol=1e-6)
    assert np.abs(a[0, 7:] - b[0, 7:]).max() > 1e-4


@pytest.mark.parametrize("shape, dtype", [((3,), "float32"), ((257, 64), "float32"), ((64, 2, 2, 16), "bfloat16")])
def test_normal_param_draws_exactly_what_a_draw_in_its_shape_gives(shape, dtype):
    """normal_param draws the head of a flat power-of-two draw (XLA compiles it several times faster); the values
    must be those of std * jax.random.normal(key, shape), eagerly, under vmap (the stacked layers' init) and jit."""
    from diffjax.model.layers import normal_param

    def drawn(rngs):
        return normal_param(rngs, shape, 0.02, dtype, ("x",) * len(shape))[...]

    def expected(rngs):
        return (0.02 * jax.random.normal(rngs.params(), shape, dtype=jnp.float32)).astype(dtype)

    np.testing.assert_array_equal(np.asarray(drawn(nnx.Rngs(3))), np.asarray(expected(nnx.Rngs(3))))
    keys = jax.random.split(jax.random.key(4), 2)
    stacked = jax.vmap(lambda key: drawn(nnx.Rngs(key)))(keys)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(jax.vmap(lambda key: expected(nnx.Rngs(key)))(keys)))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda key: drawn(nnx.Rngs(key)))(keys[0])),
                                  np.asarray(expected(nnx.Rngs(keys[0]))))
