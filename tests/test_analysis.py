"""diffjax.analysis: the probe forward against the model's own, and each analysis on inputs with planted structure
whose numbers are worked out by hand here (uniform attention, constant q/k weights, a planted outlier, known
quantization levels, an oracle that knows the answers)."""

from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import ModelConfig, TransformerLM
from diffjax.analysis import attention_scores, needles, outliers, quantization, recall
from diffjax.analysis.common import Checkpoint
from diffjax.analysis.probe import LayerView, absmax_quantize, make_probe
from diffjax.data.config import DataConfig
from diffjax.data.segments import parse_segments, to_json_line, tokenize_document
from diffjax.tokenizers import ByteTokenizer

TOKENIZER = ByteTokenizer()
# GQA (query heads over half as many kv heads), so the kv-head repeat is exercised.
TINY = ModelConfig(vocab_size=257, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=512,
                   attention_impl="xla", init_std=0.2, lambda_std=0.3)
TWINS = {"diff": TINY, "standard": TINY.replace(attention="standard", num_heads=4, num_kv_heads=2),
         "shared_diff": TINY.replace(attention="shared_diff"), "diff_v2": TINY.replace(attention="diff_v2", num_heads=4,
                                                                                        num_kv_heads=2)}


@pytest.fixture(scope="module")
def models():
    """One model of each kind for the whole module (an eager init costs seconds on 2 cores); tests that plant
    weights change a clone."""
    return {kind: nnx.jit(lambda config=config: TransformerLM(config, rngs=nnx.Rngs(0)))() for kind, config in TWINS.items()}


def _packed_batch():
    """Two rows: two documents packed in row 0, one document then padding in row 1."""
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 1, 257)
    segment_ids = jnp.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])
    positions = jnp.where(segment_ids == 2, jnp.arange(12) - 5, jnp.arange(12))
    return tokens, positions, segment_ids


@pytest.mark.parametrize("kind", ["diff", "standard", "shared_diff", "diff_v2"])
def test_probe_forward_equals_the_model_and_its_maps_equal_attention_maps(kind, models, measured):
    model, config = models[kind], TWINS[kind]
    tokens, positions, segment_ids = _packed_batch()
    expected = nnx.jit(lambda model, *batch: model(*batch))(model, tokens, positions, segment_ids)
    logits, observed = make_probe(model, lambda view, aux: (view.logits_MBHTS, view.effective_BHTS))(tokens, positions, segment_ids)
    measured("probe logits vs model", float(jnp.abs(logits - expected).max()), 1e-5)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=1e-5)
    # Layer 0's input is the embedding, so attention_maps (the notebooks' function) can be called on it directly.
    from diffjax.model.rope import inv_frequencies, rope_tables

    layer = model.layer(0)
    x = layer.attn_norm(model.embed(tokens, jnp.float32))
    maps = layer.attn.attention_maps(x, rope_tables(positions, inv_frequencies(config), jnp.float32), segment_ids)
    maps = (maps,) if kind == "standard" else maps
    scores_MBHTS, effective_BHTS = observed[0]
    allowed = np.asarray(segment_ids)[:, None, :, None] == np.asarray(segment_ids)[:, None, None, :]
    for m, a in enumerate(maps):  # the probe's logits give the layer's maps through a masked softmax
        s = np.where(allowed & np.tril(np.ones((12, 12), bool)), np.asarray(scores_MBHTS[m]), -np.inf)
        np.testing.assert_allclose(np.exp(s - s.max(-1, keepdims=True)) / np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True),
                                   a, atol=1e-6)
    if kind == "standard":
        expected = maps[0]
    else:  # lambda: a scalar per layer (V1, Shared DIFF) or [B, T, H] from the activations (V2)
        (lam,) = layer.attn.op_arguments(x, layer.attn.layer_constants(jnp.float32))
        lam = lam if jnp.ndim(lam) == 0 else jnp.moveaxis(lam, 1, 2)[..., None]
        if kind == "diff":
            np.testing.assert_allclose(lam, model.layer_lambdas()[0], rtol=1e-6)
        expected = maps[0] - lam * maps[-1]
    np.testing.assert_allclose(effective_BHTS, expected, atol=1e-6)


def test_absmax_quantization_levels():
    values = jnp.array([[-1.0, 0.55, 0.26, 0.1, 100.0], [0.2, -0.05, 0.0, 0.0, 0.0]])
    counted = jnp.array([[True, True, True, True, False], [True] * 5])  # the masked 100 sets no scale
    # 3 bits: 3 levels each side; row 0 scale 1/3, row 1 scale 0.2/3.
    expected = [[-1.0, 2 / 3, 1 / 3, 0.0, 100.0], [0.2, -0.2 / 3, 0.0, 0.0, 0.0]]
    np.testing.assert_allclose(absmax_quantize(values, 3, counted), expected, rtol=1e-6)
    # 8 bits: 127 levels; 0.3 * 127 = 38.1 -> 38.
    np.testing.assert_allclose(absmax_quantize(jnp.array([[1.0, 0.3]]), 8), [[1.0, 38 / 127]], rtol=1e-6)
    with pytest.raises(ValueError, match="bits must be an integer in"):
        absmax_quantize(values, 1)


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_quantized_probe_puts_each_sequences_logits_on_the_grid(kind, models):
    model = models[kind]
    tokens, positions, segment_ids = _packed_batch()
    probe = make_probe(model, lambda view, aux: view.logits_MBHTS)
    logits, observed = probe(tokens, positions, segment_ids, logit_bits=4)
    counted = np.asarray(segment_ids)[:, :, None] == np.asarray(segment_ids)[:, None, :]
    counted &= np.tril(np.ones((12, 12), bool)) & (np.asarray(segment_ids) != 0)[:, :, None]
    for layer in observed:
        for b in range(2):  # one scale per sequence, over both maps and every head: at most 2 * 7 + 1 values
            assert len(np.unique(np.asarray(layer)[:, b][:, :, counted[b]])) <= 15
    unquantized = probe(tokens, positions, segment_ids)[0]
    assert float(jnp.abs(logits - unquantized).max()) > 1e-3
    np.testing.assert_allclose(probe(tokens, positions, segment_ids, logit_bits=16)[0], unquantized, atol=2e-3)
    with pytest.raises(ValueError, match="bits must be an integer in"):
        probe(tokens, logit_bits=1)


def _example(depth, seed=0, length=300, needles_=4, queries=2):
    return needles.make_example(TOKENIZER, context_length=length, num_needles=needles_, num_queries=queries,
                                depth=depth, digits=5, rng=np.random.default_rng(seed))


def test_needle_examples_depth_answers_and_determinism():
    longest_filler = max(len(" " + s) for s in needles.FILLER)
    for depth in needles.DEPTHS:
        example = _example(depth)
        assert 300 - longest_filler < example.context_length <= 300
        start, end = example.needle_spans[0]
        if depth == 0:
            assert start == 0
        elif depth == 100:
            assert end == example.context_length
        else:  # within one filler sentence (and the needles placed before it) of the depth
            assert abs(start - depth / 100 * example.context_length) <= longest_filler + 4 * 40
        for (n_start, n_end), (a_start, a_end), answer in zip(example.needle_spans, example.answer_spans, example.answers):
            assert n_end <= example.context_length < a_start
            needle = TOKENIZER.decode(example.ids[n_start:n_end])
            assert needle.startswith(" The magic number for ") and needle.endswith(f" is {answer}.")
            assert TOKENIZER.decode(example.ids[a_start:a_end]) == " " + answer
            city = needle[len(" The magic number for ") : -len(f" is {answer}.")]
            assert TOKENIZER.decode(example.ids[example.context_length : a_start]).endswith(f"The magic number for {city} is")
        assert example.text == TOKENIZER.decode(example.ids)
    assert np.array_equal(_example(50, seed=3).ids, _example(50, seed=3).ids)
    assert not np.array_equal(_example(50, seed=3).ids, _example(50, seed=4).ids)
    with pytest.raises(ValueError, match="too short for 4 needles"):
        _example(0, length=100)
    texts = needles.training_texts(TOKENIZER, 5, lengths=(200,), seed=1)
    assert len(texts) == 5 and all("The magic number for " in text for text in texts)


class _Oracle:
    """A 'model' predicting every next token of its batch correctly, except in the rows `wrong(ids_row)` marks."""

    config = types.SimpleNamespace(max_seq_len=512)

    def __init__(self, wrong):
        self.wrong = wrong

    def __call__(self, ids_BT):
        next_BT = np.concatenate([ids_BT[:, 1:], ids_BT[:, :1]], axis=1)
        next_BT = np.where([[self.wrong(row)] for row in ids_BT], (next_BT + 1) % 257, next_BT)
        return np.eye(257, dtype=np.float32)[next_BT], []


def test_needle_accuracy_by_depth_with_an_oracle():
    task = needles.NeedleTask(lengths=(300,), num_needles=4, num_queries=2, samples=3, digits=5)
    at_depth_0 = {tuple(e.ids) for e in task.examples(TOKENIZER, 300, 0)}
    oracle = _Oracle(lambda row: tuple(row[row != 0]) in at_depth_0)  # text has no 0 bytes: 0 is padding
    checkpoint = Checkpoint("oracle", oracle, TOKENIZER, DataConfig())
    result = needles.evaluate(checkpoint, task, batch_size=4, forward=oracle)
    assert result.accuracy == {(300, 0): 0.0, **{(300, d): 1.0 for d in needles.DEPTHS[1:]}}
    table = needles.format_results(["oracle"], [result])
    assert "0%" in table and "avg" in table and "0.800" in table


def test_recall_examples_place_the_asked_pair_at_the_depth_and_answer_with_its_value():
    """Associative recall (issue 25): every asked pair's span in the context reads " keyvalue" and its answer after
    the context reads value, after "\nkey"; the first asked pair is pair round(depth (n - 1)) of the n; seeded."""
    task = recall.RecallTask(pair_counts=(12,), num_queries=3, samples=2)
    for depth in recall.DEPTHS:
        for example in task.examples(TOKENIZER, 12, depth):
            assert example.text == TOKENIZER.decode(example.ids)
            context = TOKENIZER.decode(example.ids[: example.context_length])
            pairs = context.split()
            assert len(pairs) == 12 and len({p[:2] for p in pairs}) == 12  # distinct keys
            for (n_start, n_end), (a_start, a_end), value in zip(example.needle_spans, example.answer_spans, example.answers):
                pair = TOKENIZER.decode(example.ids[n_start:n_end])
                key = pair.strip()[:2]
                assert pair == f" {key}{value}" and len(value) == 2 and len(key) == 2
                assert TOKENIZER.decode(example.ids[a_start:a_end]) == value
                assert TOKENIZER.decode(example.ids[:a_start]).endswith(f"\n{key}")
            first = TOKENIZER.decode(example.ids[slice(*example.needle_spans[0])]).strip()
            assert pairs.index(first) == round(depth / 100 * 11)
    again = recall.RecallTask(pair_counts=(12,), num_queries=3, samples=2).examples(TOKENIZER, 12, 50)
    assert all(np.array_equal(a.ids, b.ids) for a, b in zip(again, task.examples(TOKENIZER, 12, 50)))
    assert not np.array_equal(again[0].ids, again[1].ids)
    with pytest.raises(ValueError, match=r"queries \(5\) <= pairs \(4\)"):
        recall.make_example(TOKENIZER, num_pairs=4, num_queries=5, depth=0, rng=np.random.default_rng(0))
    # Training documents: the loss mask (through the data pipeline's tokenization) marks exactly the answers.
    documents = recall.training_documents(TOKENIZER, 6, pair_counts=(3, 6), max_queries=2)
    for document in documents:
        tokens, loss_mask = tokenize_document(TOKENIZER, document, eos_id=None)
        text = "".join(piece for piece, _ in document)
        pairs, *queries = text.split("\n")
        values = dict((pair[:2], pair[2:]) for pair in pairs.split())
        assert len(values) in (3, 6) and 1 <= len(queries) <= 2
        assert TOKENIZER.decode(tokens) == text
        assert TOKENIZER.decode(tokens[loss_mask == 1]) == "".join(values[query[:2]] for query in queries)
        assert all(query[2:] == values[query[:2]] for query in queries)
    assert parse_segments(json.loads(to_json_line(documents[0]))["segments"], fail=None) == documents[0]


def test_recall_accuracy_by_depth_with_an_oracle():
    task = recall.RecallTask(pair_counts=(6, 10), num_queries=2, samples=3)
    at_depth_100 = {tuple(e.ids) for n in (6, 10) for e in task.examples(TOKENIZER, n, 100)}
    oracle = _Oracle(lambda row: tuple(row[row != 0]) in at_depth_100)
    result = recall.evaluate(Checkpoint("oracle", oracle, TOKENIZER, DataConfig()), task, batch_size=4, forward=oracle)
    assert result.accuracy == {**{(n, d): 1.0 for n in (6, 10) for d in recall.DEPTHS[:-1]}, (6, 100): 0.0, (10, 100): 0.0}
    table = recall.format_results(["oracle"], [result])
    assert "100%" in table and "@10 pairs" in table and "chance 0.01" in table


def _planted(model, weights: dict, embedding=None):
    """A clone of `model` with the named kernels ((module, name) -> value, every layer) set to a constant."""
    model = nnx.clone(model)
    for (module, name), value in weights.items():
        variable = getattr(getattr(model.blocks, module), name)
        variable[...] = jnp.full_like(variable[...], value)
    if embedding is not None:
        model.embed.embedding[...] = embedding
    return model


@pytest.mark.parametrize("kind", ["diff", "standard", "diff_v2"])
def test_attention_scores_of_uniform_attention(kind, models):
    """q and k weights 0: every map is uniform over the keys a query sees, in every layer (normalized, DIFF's row
    sum 1 - lambda divides out): from query row t, the answer score is the needle's length / (t + 1) and the
    noise the rest of the context / (t + 1)."""
    model = _planted(models[kind], {("attn", "q_kernel"): 0.0, ("attn", "k_kernel"): 0.0})
    task = needles.NeedleTask(lengths=(200,), num_needles=2, num_queries=2, depths=(0, 100), samples=2, digits=4)
    result = attention_scores.evaluate(Checkpoint(kind, model, TOKENIZER, DataConfig()), task, batch_size=3)
    for depth in (0, 100):
        answer, noise = [], []
        for example in task.examples(TOKENIZER, 200, depth):
            rows = [(t, q) for q, (start, end) in enumerate(example.answer_spans) for t in range(start - 1, end - 1)]
            span = lambda q: example.needle_spans[q][1] - example.needle_spans[q][0]  # noqa: E731
            answer.append(np.mean([span(q) / (t + 1) for t, q in rows]))
            noise.append(np.mean([(example.context_length - span(q)) / (t + 1) for t, q in rows]))
        np.testing.assert_allclose(result.answer[depth], [np.mean(answer)] * 2, rtol=1e-5)  # both layers
        np.testing.assert_allclose(result.noise[depth], [np.mean(noise)] * 2, rtol=1e-5)


def test_span_scores_of_a_planted_differential_map():
    """Query row 2 of a 4-token sequence: A1 puts everything on key 0 (the needle), A2 is uniform, lambda 0.5:
    A1 - 0.5 A2 = [1 - 1/6, -1/6, -1/6] sums to 0.5, so normalized [5/3, -1/3, -1/3]; keys 0-1 are context."""
    effective = np.zeros((1, 1, 4, 4), np.float32)
    effective[0, 0, 2, :3] = [1 - 0.5 / 3, -0.5 / 3, -0.5 / 3]
    view = LayerView(0, None, jnp.asarray(effective), None, None, None)
    aux = {"rows": jnp.array([[-1, -1, 0, -1]]), "keys": jnp.array([[0, -1, -2, -2]])}
    scores = attention_scores.span_scores(view, aux)
    np.testing.assert_allclose(scores["answer"][0, 2], 5 / 3, rtol=1e-6)
    np.testing.assert_allclose(scores["noise"][0, 2], -1 / 3, rtol=1e-6)


# Attention and MLP outputs 0: every layer's input and output is the embedding.
SILENT = {("attn", "o_kernel"): 0.0, ("mlp", "down_kernel"): 0.0}


@pytest.mark.parametrize("kind", ["diff", "standard", "diff_v2"])
def test_outliers_of_constant_q_and_k(kind, models):
    """Embedding rows all ones, layers silent: x = ones in every layer, q = k = (D w, ..., D w) per head, so
    logit(t, s) = (D w)^2 * 2 sum_i cos((t - s) theta_i) / sqrt(d), largest on the diagonal: sqrt(d) (D w)^2."""
    w = 0.1
    model = _planted(models[kind], {**SILENT, ("attn", "q_kernel"): w, ("attn", "k_kernel"): w}, embedding=1.0)
    config = model.config
    D, d, T = config.d_model, config.head_dim, 16
    batch = {"tokens": np.ones((2, T), np.int32), "positions": np.tile(np.arange(T), (2, 1)), "segment_ids": np.ones((2, T), np.int32)}
    result = outliers.statistics(model, [batch])
    theta = config.rope_theta ** (-np.arange(0, d, 2) / d)
    lag = np.subtract.outer(np.arange(T), np.arange(T))
    logits = (D * w) ** 2 * 2 * np.cos(lag[..., None] * theta).sum(-1) / np.sqrt(d)
    causal = np.abs(logits[lag >= 0])
    copies = 2 * 2 * config.num_heads * (2 if kind == "diff" else 1)  # layers x rows x heads x maps: the same logits
    all_values = np.sort(np.repeat(causal, copies))[::-1]
    assert result.top_k("attention logits", 1) == pytest.approx(np.sqrt(d) * (D * w) ** 2, rel=1e-4)
    np.testing.assert_allclose(result.top["attention logits"], all_values[:100], rtol=1e-4)
    assert result.median["attention logits"] == pytest.approx(np.median(all_values), rel=1e-4)
    assert result.tokens == 2 * T


def test_outliers_of_a_planted_hidden_state(models):
    """Silent layers: both layers' hidden state is the embedding, all ones but a -50 in token 7's row. Token 7
    is in the text once (so 50 comes once per layer), and fills the padding (which must not count)."""
    model = _planted(models["diff"], SILENT, embedding=jnp.ones((257, 32)).at[7, 3].set(-50.0))
    tokens = np.ones((2, 8), np.int32)
    tokens[0, 4] = 7
    tokens[1, 6:] = 7
    segment_ids = np.ones((2, 8), np.int32)
    segment_ids[1, 6:] = 0
    batch = {"tokens": tokens, "positions": np.tile(np.arange(8), (2, 1)), "segment_ids": segment_ids}
    result = outliers.statistics(model, [batch])
    assert [result.top_k("hidden states", k) for k in (1, 2, 3, 10)] == [50.0, 50.0, 1.0, 1.0]
    assert result.median["hidden states"] == 1.0 and result.tokens == 14
    assert "top-100" in outliers.format_results(["planted"], [result])


def _stacked(model, module: str, name: str, values) -> None:
    """Set one stacked kernel ([L, ...]: a value per layer) of `model` in place."""
    variable = getattr(getattr(model.blocks, module), name)
    variable[...] = jnp.asarray(values, variable[...].dtype)


def _hand_logits(model, tokens_BT, segment_ids_BT, q_LDHMd, k_LDKMd):
    """Each layer's counted attention logits, float64, from the embedding and the planted kernels alone (silent
    layers: every layer's input is the embedding; positions 0: RoPE is the identity): RMSNorm, q.k / sqrt(d) over
    both maps, each head against its kv head, at the (query, key) pairs attention uses."""
    config = model.config
    x = np.asarray(model.embed.embedding[...], np.float64)[tokens_BT]
    scale = np.asarray(model.blocks.attn_norm.scale[...], np.float64)  # [L, D]
    B, T = tokens_BT.shape
    t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    counted = (s <= t) & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]) & (segment_ids_BT[:, :, None] != 0)
    per_layer = []
    for layer in range(config.num_layers):
        n = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + config.norm_eps) * scale[layer]
        q = np.einsum("btD,DhMd->bthMd", n, q_LDHMd[layer])
        k = np.repeat(np.einsum("bsD,DkMd->bskMd", n, k_LDKMd[layer]), config.num_query_groups, axis=2)
        logits = np.einsum("bthMd,bshMd->Mbhts", q, k) / np.sqrt(config.head_dim)
        per_layer.append(np.abs(logits)[:, counted[:, None].repeat(config.num_heads, 1)].ravel())
    return per_layer


def test_outliers_of_planted_values_by_hand(models):
    """Distinct planted outliers, every figure worked out in float64 here: hidden states (silent layers: each layer's
    output is the embedding row, so each value counts once per layer) with three planted entries, and attention
    logits from random q / k kernels whose second layer is 1.3x the first (both among the largest); a packed batch with
    padding. Each reported top-k, the median (every value: fewer than median_sample) and the layers are checked."""
    model = _planted(models["diff"], SILENT)
    config = model.config
    L, D, H, K, d = config.num_layers, config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    rng = np.random.default_rng(0)
    embedding = rng.normal(size=(257, D))
    embedding[5, 7], embedding[9, 2], embedding[11, 30] = 40.0, -25.0, 60.0
    model.embed.embedding[...] = jnp.asarray(embedding, jnp.float32)
    q_kernels = rng.normal(size=(L, D, H, 2, d)) * np.array([1.0, 1.3])[:, None, None, None, None] / np.sqrt(D)
    k_kernels = rng.normal(size=(L, D, K, 2, d)) / np.sqrt(D)
    _stacked(model, "attn", "q_kernel", q_kernels)
    _stacked(model, "attn", "k_kernel", k_kernels)
    tokens, _, segment_ids = (np.array(a) for a in _packed_batch())
    tokens[0, 3], tokens[1, 8], tokens[1, 2] = 5, 9, 11  # the planted rows, each once, in real tokens
    tokens[1, 10] = 11  # and in the padding, which must not count
    batch = {"tokens": tokens, "positions": np.zeros_like(tokens), "segment_ids": segment_ids}
    result = outliers.statistics(model, [batch])

    real = segment_ids != 0
    hidden = np.sort(np.tile(np.abs(embedding[tokens[real]]).ravel(), L))[::-1]
    assert hidden[:6].tolist() == [60.0, 60.0, 40.0, 40.0, 25.0, 25.0]  # once per layer
    logits = _hand_logits(model, tokens, segment_ids, q_kernels, k_kernels)
    layer_of = np.concatenate([np.full(len(values), depth) for depth, values in enumerate(logits)])
    order = np.argsort(-np.concatenate(logits), kind="stable")
    expected = {"hidden states": hidden, "attention logits": np.concatenate(logits)[order]}
    for kind, values in expected.items():
        for k in outliers.TOP_K:
            assert result.top_k(kind, k) == pytest.approx(values[k - 1], rel=1e-5), (kind, k)
        assert result.median[kind] == pytest.approx(np.median(values), rel=1e-5), kind
    assert np.array_equal(result.top_layers["attention logits"], layer_of[order][:100])
    assert 0 < np.count_nonzero(layer_of[order][:100] == 0) < 100  # both layers among the largest
    assert not result.repeated("attention logits") and "note:" not in outliers.format_results(["p"], [result])


def test_outliers_a_repeated_first_layer_value_is_explained(models):
    """A first layer's logit is a function of its two tokens and their distance: text that repeats repeats its
    largest logit at every occurrence (the tiny DIFF run's 48.3 for every k: a space five bytes after a newline, 721
    times in 32768 tokens). The table says the 100 largest are one value from layer 0 (the second is silent)."""
    model = _planted(models["diff"], {**SILENT, ("attn", "q_kernel"): 0.0})
    config = model.config
    rng = np.random.default_rng(1)
    q_kernels = np.zeros((config.num_layers, config.d_model, config.num_heads, 2, config.head_dim))
    q_kernels[0] = rng.normal(size=q_kernels.shape[1:])
    _stacked(model, "attn", "q_kernel", q_kernels)
    B, T, length = 8, 128, 8  # rows of 16 documents, each the same 8 tokens: every (query, key) pair recurs 128 times
    tokens = np.tile(rng.integers(1, 257, length), (B, T // length)).astype(np.int32)
    positions = np.tile(np.arange(T) % length, (B, 1))
    batch = {"tokens": tokens, "positions": positions, "segment_ids": np.tile(1 + np.arange(T) // length, (B, 1))}
    result = outliers.statistics(model, [batch])
    top = result.top["attention logits"]
    assert top[99] >= 0.999 * top[0] and set(result.top_layers["attention logits"]) == {0}
    assert result.repeated("attention logits") and result.layers("attention logits") == "0"
    table = outliers.format_results(["periodic"], [result])
    assert "note: periodic, attention logits: the 100 largest are one value repeated (layers 0)" in table


def test_cli_writes_training_data_and_refuses_bad_checkpoints(tmp_path, capsys):
    path = tmp_path / "needles.jsonl"
    assert needles.main(["--write-training", str(path), "--count", "3", "--lengths", "200", "--digits", "4"]) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3 and all("magic number" in line["text"] for line in lines)
    assert outliers.main(["--checkpoint", str(tmp_path / "missing")]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_cli_prints_the_table_of_a_saved_checkpoint(models, tmp_path, capsys):
    from diffjax.checkpoint import save_params

    model = models["diff"]
    save_params(tmp_path / "uniform", nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.config)
    argv = ["--checkpoint", str(tmp_path / "uniform"), "--label", "flat", "--length", "200", "--needles", "2",
            "--samples", "1", "--depths", "0,100", "--digits", "3"]
    assert attention_scores.main(argv) == 0
    out = capsys.readouterr().out
    assert "flat: DIFF (2 diff heads" in out and "answer 0%" in out and "noise 100%" in out
    assert attention_scores.main(argv + ["--label", "extra"]) == 2


def test_text_batches_from_files(tmp_path):
    from diffjax.analysis.common import text_batches

    documents = ["a" * 100, "b" * 30, "c" * 200]
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    checkpoint = Checkpoint("x", _Oracle(None), TOKENIZER, DataConfig(seq_len=64))
    batches = text_batches(checkpoint, tokens=200, batch_size=2, paths=[str(path)])
    assert len(batches) == 2 and batches[0]["tokens"].shape == (2, 64)  # ceil(200 / 128) batches of 2 x 64
    assert batches[0]["tokens"][0, :64].tolist() == [ord("a")] * 64  # document 0's first piece, in order
    with pytest.raises(ValueError, match="fewer than 8 rows"):
        text_batches(checkpoint, tokens=200, batch_size=8, seq_len=512, paths=[str(path)])


def test_clis_fit_the_model_check_first_and_name_their_command(models, tmp_path, capsys, monkeypatch):
    """Issue 29's rough edges: the default needle length is the longest the model fits (it was 1024 for any
    model); a task that cannot fit is refused before any text is scored; bad counts are refused by argparse;
    usage lines name `python -m ...`; a negative answer score is explained."""
    from diffjax.checkpoint import save_params

    model = models["diff"]
    short = model.config.replace(max_seq_len=256)  # RoPE is computed, not stored: the same params fit
    save_params(tmp_path / "short", nnx.to_pure_dict(nnx.state(model, nnx.Param)), short)
    argv = ["--checkpoint", str(tmp_path / "short"), "--needles", "2", "--samples", "1", "--depths", "0", "--digits", "3"]
    assert attention_scores.main(argv) == 0
    out = capsys.readouterr().out
    longest = needles.longest_context(TOKENIZER, 256, 1, 3)
    assert f"context {longest} tokens" in out and "an answer score below 0" in out

    def scored_too_early(*args, **kwargs):
        raise AssertionError("text was scored before the needle task was checked")

    monkeypatch.setattr(quantization, "text_metrics", scored_too_early)
    assert quantization.main(["--checkpoint", str(tmp_path / "short"), "--length", "1024", "--digits", "3", "--tokens", "64"]) == 2
    assert f"use lengths of at most {longest}" in capsys.readouterr().err

    for main, extra in ((outliers.main, ["--tokens", "-5"]), (needles.main, ["--samples", "0"])):
        with pytest.raises(SystemExit) as exit_info:
            main(["--checkpoint", str(tmp_path / "short"), *extra])
        assert exit_info.value.code == 2
        assert "expected a positive integer" in capsys.readouterr().err
    assert needles.main(["--write-training", str(tmp_path / "absent" / "x.jsonl"), "--count", "2"]) == 0  # made
    assert len((tmp_path / "absent" / "x.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    for main in (needles.main, recall.main):  # a directory that cannot be made: a file is in the way
        assert main(["--write-training", str(tmp_path / "absent" / "x.jsonl" / "y.jsonl"), "--count", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --write-training") and "cannot make its directory" in err
        assert "\n" not in err.strip()
    with pytest.raises(SystemExit):
        outliers.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m diffjax.analysis.outliers")
