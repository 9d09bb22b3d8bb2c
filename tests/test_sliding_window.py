"""Sliding-window attention (issue 24, item 4): each query sees its W latest keys.

The ops against the XLA reference (forward and gradients, packed, GQA, both ops and both key layouts): the fused
Pallas TPU kernels (interpret mode), the blockwise XLA path, splash (interpret) and the cuDNN composition's
arguments (the Mosaic GPU kernels' windowed cases are in test_ops_pallas_gpu.py); that the skipped blocks are
exactly those with no visible key (attention costs T x W); the model against transformers' Mistral (Llama with
a sliding window), every kind's loss and gradients with windowed layers run blockwise against the reference;
unilm flashdiff's window_size; the config and export refusals.
The context-parallel path with a window is in test_context_parallel.py, windowed generation in test_generate.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from diffjax import attention_kinds, ops
from diffjax.config import ModelConfig
from diffjax.convert import ConversionError, unilm_window_size, window_from_unilm
from diffjax.convert.export import check_exportable
from diffjax.model import TransformerLM
from diffjax.ops import compositions, context_parallel, pallas_tpu
from diffjax.ops.reference import attention_mask
from diffjax.train.metrics import training_flops_per_token

B, T, H, K, d = 2, 128, 4, 2, 16
# Kernel blocks smaller than the window and the sequence, so that blocks before, across and behind it occur.
BLOCKS = (32, 16)
WINDOW = 20


def _inputs(op: str, T: int = T, seed: int = 0):
    """(q, k, v, lam) for "diff" (G = 2), "diff_v2" (G = 1, lambda per token) or "standard" (GQA)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    if op == "standard":
        shapes = [(B, T, H, d), (B, T, K, d), (B, T, K, d)]
    else:
        G, dv = (2, 2 * d) if op == "diff" else (1, d)
        shapes = [(B, T, H, 2, d), (B, T, K, G, d), (B, T, K, dv)]
    q, k, v = (jax.random.normal(key, shape) for key, shape in zip(keys, shapes))
    lam = 0.2 + 0.1 * jax.random.normal(keys[3], (B, T, H)) if op == "diff_v2" else 0.35
    return q, k, v, lam


def _packed_ids(T: int = T):
    """Row 0: three documents; row 1: one, then padding."""
    ids = np.ones((B, T), np.int32)
    ids[0, T // 3:], ids[0, 3 * T // 4:] = 2, 3
    ids[1, T - 9:] = 0
    return jnp.asarray(ids)


def _attention(op, q, k, v, lam, **kwargs):
    if op == "standard":
        return ops.dot_product_attention(q, k, v, **kwargs)
    return ops.diff_attention(q, k, v, lam, **kwargs)


def _output_and_grads(f, q, k, v, weights):
    return jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * weights), (0, 1, 2))(*a)))(q, k, v)


def _compare(f, reference, q, k, v, measured, what, atol=2e-6, grad_atol=2e-5):
    weights = jax.random.normal(jax.random.key(9), jax.eval_shape(reference, q, k, v).shape)
    (o, g), (o_ref, g_ref) = _output_and_grads(f, q, k, v, weights), _output_and_grads(reference, q, k, v, weights)
    measured(f"{what}: output max |impl - reference|", float(jnp.max(jnp.abs(o - o_ref))), atol)
    np.testing.assert_allclose(o, o_ref, atol=atol)
    for name, a, b in zip("qkv", g, g_ref):
        measured(f"{what}: d{name} max |impl - reference|", float(jnp.max(jnp.abs(a - b))), grad_atol)
        np.testing.assert_allclose(a, b, atol=grad_atol, err_msg=f"{what}: gradient of {name}")


def test_the_reference_mask_is_a_window_of_the_latest_keys():
    """Query t (at position S - T + t) sees keys S - T + t - W + 1 .. S - T + t: W keys once it has W behind it."""
    mask = np.asarray(attention_mask(6, 9, causal=True, window=3))[0]
    for t in range(6):
        np.testing.assert_array_equal(np.flatnonzero(mask[t]), np.arange(3 + t - 2, 3 + t + 1))
    # A window longer than the sequence is the causal mask.
    np.testing.assert_array_equal(attention_mask(9, 9, causal=True, window=50), attention_mask(9, 9, causal=True))


# op, packed: both ops, both key layouts (G = 2 and shared keys with lambda per token), GQA throughout.
OP_CASES = {"diff,packed": ("diff", True), "diff_v2,G=1": ("diff_v2", False), "standard,packed": ("standard", True)}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_pallas_tpu_kernels_take_a_window(case, measured):
    """The fused kernels (interpret mode) with a window of 20 over blocks of 32 queries x 16 keys."""
    op, packed = OP_CASES[case]
    q, k, v, lam = _inputs(op)
    ids = _packed_ids() if packed else None
    kwargs = dict(segment_ids=ids, window=WINDOW)
    _compare(lambda q, k, v: _attention(op, q, k, v, lam, impl="pallas_tpu", block_sizes=BLOCKS, **kwargs),
             lambda q, k, v: _attention(op, q, k, v, lam, impl="xla", **kwargs), q, k, v, measured, f"pallas_tpu {case}")


@pytest.mark.parametrize("case", list(OP_CASES))
def test_the_blockwise_xla_path_takes_a_window(case, monkeypatch, measured):
    """The XLA path runs blockwise under a window longer than one key block (lowered here to pieces of 16 queries
    and blocks of 8 keys), skipping blocks behind the window: the reference's output and gradients."""
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", 16)
    monkeypatch.setattr(context_parallel, "DEFAULT_BLOCK", 8)
    op, packed = OP_CASES[case]
    q, k, v, lam = _inputs(op, seed=1)
    kwargs = dict(segment_ids=_packed_ids() if packed else None, window=WINDOW)
    blockwise = lambda q, k, v: _attention(op, q, k, v, lam, impl="xla", **kwargs)  # noqa: E731
    assert "custom_vjp_call" in str(jax.make_jaxpr(blockwise)(q, k, v))  # the blockwise path ran
    reference = ops.dot_product_attention_xla if op == "standard" else \
        (lambda q, k, v, **kw: ops.diff_attention_xla(q, k, v, lam, **kw))
    _compare(blockwise, lambda q, k, v: reference(q, k, v, **kwargs), q, k, v, measured, f"blockwise {case}")


def test_splash_takes_a_window(measured):
    """splash's LocalMask (interpret mode; splash needs multiples of 128 tokens), packed."""
    q, k, v, lam = _inputs("diff", T=256)
    kwargs = dict(segment_ids=_packed_ids(256), window=WINDOW)
    splash = ops.diff_attention(q, k, v, lam, impl="splash", **kwargs)
    error = float(jnp.max(jnp.abs(splash - ops.diff_attention_xla(q, k, v, lam, **kwargs))))
    assert measured("splash windowed output max |splash - reference|", error, 2e-6) < 2e-6


def test_the_cudnn_composition_passes_the_window_as_jax_nn_local_window(monkeypatch, measured):
    """cuDNN runs only on a GPU: here jax.nn.dot_product_attention's XLA implementation stands where the
    composition calls cuDNN, with the arguments the composition gives it (local_window_size = (W - 1, 0))."""
    real = jax.nn.dot_product_attention
    calls = []

    def xla_in_place_of_cudnn(*args, implementation=None, **kwargs):
        calls.append(kwargs["local_window_size"])
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", xla_in_place_of_cudnn)
    for op in ("diff", "standard"):
        q, k, v, lam = _inputs(op)
        composition = compositions.diff_attention_cudnn if op == "diff" else compositions.dot_product_attention_cudnn
        args = (q, k, v) if op == "standard" else (q, k, v, lam)
        got = composition(*args, window=WINDOW)
        want = _attention(op, q, k, v, lam, impl="xla", window=WINDOW)
        assert measured(f"cudnn composition ({op}) max |composition - reference|", float(jnp.max(jnp.abs(got - want))),
                        2e-6) < 2e-6
    assert set(calls) == {(WINDOW - 1, 0)}


@pytest.mark.parametrize("T_, W, block", [(4096, 256, 128), (1000, 100, 64), (512, 66, 64), (512, 1, 128)])
def test_skipped_blocks_are_exactly_those_behind_or_ahead_of_every_window(T_, W, block, measured):
    """Every block a kernel skips has no visible key (exact), and every block it runs has one (no work wasted): so
    attention costs T x W, not T^2. The Pallas TPU kernel's grid and the blockwise path's scan, against the mask."""
    mask = np.asarray(attention_mask(T_, T_, causal=True, window=W))[0]
    n = -(-T_ // block)
    padded = np.zeros((n * block, n * block), bool)
    padded[:T_, :T_] = mask
    has_key = padded.reshape(n, block, n, block).any(axis=(1, 3))
    st = pallas_tpu._Static(M=1, G=1, R=1, T=T_, S=T_, bq=block, bk=block, causal=True, window=W, scale=1.0,
                            has_seg=False, has_lam=False, interpret=True)
    kernel = np.array([[bool(pallas_tpu._block_needed(st, i, j, 0)) for j in range(n)] for i in range(n)])
    if T_ % block == 0:
        index = jnp.arange(T_).reshape(n, block)
        blockwise = np.array([[bool(context_parallel._block_visible(index[i], index[j], True, W)) for j in range(n)]
                              for i in range(n)])
        np.testing.assert_array_equal(blockwise, has_key)
    np.testing.assert_array_equal(kernel, has_key)
    # The index maps fetch, for every step, a block the step needs or the nearest one (so skipped steps cost no DMA).
    for i in range(n):  # the forward and dq grids: kv blocks per q block
        first, last = int(pallas_tpu._first_kv_block(st, i, n, 0)), int(pallas_tpu._last_kv_block(st, i, n, 0))
        assert np.flatnonzero(has_key[i]).tolist() == list(range(first, last + 1))
    for j in range(n):  # the dk / dv grid: q blocks per kv block
        first, last = int(pallas_tpu._first_q_block(st, j, n, 0)), int(pallas_tpu._last_q_block(st, j, n, 0))
        assert np.flatnonzero(has_key[:, j]).tolist() == list(range(first, last + 1))
    causal_blocks = n * (n + 1) // 2
    measured(f"T={T_}, W={W}, block {block}: blocks run / causal blocks", kernel.sum() / causal_blocks)
    assert kernel.sum() <= n * (-(-W // block) + 1)


def test_the_explicit_impls_that_take_no_window_refuse_it():
    q, k, v, lam = _inputs("diff")
    h100 = ops.DEVICES["h100"]
    call = ops.AttentionCall.of("diff_attention", q.astype(jnp.bfloat16), k, v, True, None, WINDOW)
    with pytest.raises(ValueError, match="impl='triton' takes no sliding window"):
        ops.choose(call, "triton", h100)
    # On an H100, auto takes cuDNN (local_window_size) for a windowed call pallas_gpu cannot run (d 16) without
    # segment ids...
    assert ops.choose(call, "auto", h100).impl == "cudnn"
    # ...and the blockwise XLA path, which skips the blocks outside the window, for packed rows.
    packed = ops.AttentionCall.of("diff_attention", q.astype(jnp.bfloat16), k, v, True, _packed_ids(), WINDOW)
    assert ops.choose(packed, "auto", h100).impl == "xla"
    # pallas_gpu takes a window with any shape it runs: packed rows at d 64 run it, asked for or not.
    wide = [jax.ShapeDtypeStruct(x.shape[:-1] + (x.shape[-1] * 4,), jnp.bfloat16) for x in (q, k, v)]
    packed_d64 = ops.AttentionCall.of("diff_attention", *wide, True, _packed_ids(), WINDOW)
    assert ops.choose(packed_d64, "pallas_gpu", h100).impl == ops.choose(packed_d64, "auto", h100).impl == "pallas_gpu"
    for bad, message in [(0, "positive integer"), (2.5, "positive integer"), (True, "positive integer")]:
        with pytest.raises(ValueError, match=f"window must be None .* {message}"):
            ops.diff_attention(q, k, v, lam, window=bad)
    with pytest.raises(ValueError, match="window=4 needs causal attention"):
        ops.diff_attention(q, k, v, lam, causal=False, window=4)


# --- the model --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_windowed_baseline_equals_transformers_mistral(tmp_path, measured):
    """Mistral is Llama with a sliding window: a random Llama loaded into diffjax with attention_window W computes
    what transformers' MistralForCausalLM(sliding_window=W) computes with the same weights (and not what the
    windowless model computes)."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from hf_models import make_hf_model, max_relative_error, random_tokens
    from transformers import MistralConfig, MistralForCausalLM

    import diffjax

    llama = make_hf_model("llama", num_key_value_heads=4)
    llama.save_pretrained(tmp_path)
    window = 7
    keep = set(MistralConfig().to_dict()) - {"architectures", "model_type"}
    mistral_config = MistralConfig(**{k: v for k, v in llama.config.to_dict().items() if k in keep}, sliding_window=window)
    mistral_config._attn_implementation = "eager"
    mistral = MistralForCausalLM(mistral_config).eval()
    mistral.load_state_dict(llama.state_dict(), strict=True)
    tokens = random_tokens(llama.config.vocab_size)  # 40 tokens: most queries have more than the window behind them
    with torch.no_grad():
        expected = mistral(torch.tensor(tokens, dtype=torch.long)).logits.numpy()

    model = diffjax.load_hf(tmp_path, rope_style="rotate_half")
    windowed = nnx.merge(nnx.split(nnx.eval_shape(lambda: TransformerLM(model.config.replace(attention_window=window),
                                                                          rngs=nnx.Rngs(0))))[0], nnx.state(model))
    error = measured("windowed diffjax vs Mistral logits, max rel err", max_relative_error(windowed(tokens), expected), 1e-5)
    assert error < 1e-5
    assert max_relative_error(model(tokens), expected) > 0.1  # the window matters on this input


MODEL = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=32,
                    attention_impl="xla", attention_window=5, global_layers=(1,), scan_layers=True)


def _loss_and_grads(graphdef, params, batch):
    def loss(params):
        logits = nnx.merge(graphdef, params)(batch["tokens"], batch["positions"], batch["segment_ids"])
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["tokens"][:, 1:]))

    return jax.jit(jax.value_and_grad(loss))(params)


# ~20 s a kind: the newest leg and the fast lane run "diff" (the kinds share the windowed blockwise op), the oldest
# leg every kind.
@pytest.mark.parametrize("kind", [n if n == "diff" else
                                  pytest.param(n, marks=[pytest.mark.single_leg, pytest.mark.slow])
                                  for n in attention_kinds.names()])
def test_every_kind_windowed_blockwise_equals_the_reference_loss_and_gradients(kind, monkeypatch, measured):
    """A scanned stack of windowed layers around a global one (lax.cond picks per layer), packed rows: with the
    windowed layers run blockwise (blocks of 4 keys) the loss and every gradient equal the reference path's; and the
    model differs from one without the window."""
    rng = np.random.default_rng(0)
    ids = np.ones((2, 32), np.int32)
    ids[0, 12:] = 2
    positions = np.where(ids == 2, np.arange(32) - 12, np.arange(32)).astype(np.int32)
    batch = {"tokens": rng.integers(0, 64, (2, 32)).astype(np.int32), "positions": positions, "segment_ids": ids}
    config = MODEL.replace(attention=kind)
    graphdef, params = nnx.split(TransformerLM(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    reference_loss, reference_grads = _loss_and_grads(graphdef, params, batch)
    monkeypatch.setattr(context_parallel, "DEFAULT_BLOCK", 4)
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", 8)
    forward = lambda p: nnx.merge(graphdef, p)(batch["tokens"], batch["positions"], batch["segment_ids"])  # noqa: E731
    assert "custom_vjp_call" in str(jax.make_jaxpr(forward)(params))  # the blockwise path runs
    loss, grads = _loss_and_grads(graphdef, params, batch)
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-6)
    worst = 0.0
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference_grads)):
        tolerance = 1e-4 if "lambda" in jax.tree_util.keystr(path) else 1e-5
        difference = float(jnp.max(jnp.abs(g - g_ref)) / jnp.max(jnp.abs(g_ref))) / tolerance
        worst = max(worst, difference)
        assert difference < 1, f"{kind}: gradient of {jax.tree_util.keystr(path)} differs by {difference} x the tolerance"
    measured(f"{kind}: gradients max |blockwise - reference| / (max |g| x 1e-5, 1e-4 for lambda)", worst, 1)
    unwindowed = nnx.split(nnx.eval_shape(lambda: TransformerLM(config.replace(attention_window=None, global_layers=()),
                                                                  rngs=nnx.Rngs(0))))[0]
    assert abs(float(_loss_and_grads(unwindowed, params, batch)[0]) - float(reference_loss)) > 1e-3


@pytest.mark.slow
def test_the_analyses_see_each_layers_window():
    """The probe's explicit maps (what the analyses read) use each layer's own mask: its logits equal the model's,
    and a windowed layer's maps are zero outside the window while the global layer's are not."""
    from diffjax.analysis.probe import make_probe
    from diffjax.model.rope import inv_frequencies, rope_tables

    model = TransformerLM(MODEL, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(1).integers(0, 64, (2, 24)).astype(np.int32)
    logits, _ = make_probe(model)(tokens)
    np.testing.assert_allclose(logits, model(tokens), atol=1e-5)
    layer = model.layer(0)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    rope = rope_tables(positions, inv_frequencies(MODEL), jnp.float32)
    x = layer.attn_norm(model.embed(tokens, jnp.float32))
    outside = ~np.asarray(attention_mask(24, 24, causal=True, window=5))[0] & np.tri(24, dtype=bool)
    a1, _ = layer.attn.attention_maps(x, rope, constants={**layer.attn.layer_constants(jnp.float32), "global_attention": False})
    assert float(jnp.max(jnp.abs(a1[..., outside]))) == 0.0
    a1_global, _ = model.layer(1).attn.attention_maps(x, rope, constants={
        **model.layer(1).attn.layer_constants(jnp.float32), "global_attention": True})
    assert float(jnp.max(jnp.abs(a1_global[..., outside]))) > 0.0


# --- config, FLOPs, conversion ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    (dict(attention_window=0), r"attention_window must be None \(whole context\) or a positive integer \(keys per query\), got 0"),
    (dict(attention_window=8, global_layers=(0, 3)), r"global_layers must hold 0-based layer indices below num_layers \(3\), got \[3\]"),
    (dict(attention_window=8, global_layers=(1, 1)), r"global_layers has repeats: \[1, 1\]"),
    (dict(global_layers=(1,)), r"global_layers \[1\] needs an attention_window"),
])
def test_bad_window_settings_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(num_layers=3, **fields)


def test_flops_count_the_keys_each_layer_sees():
    """The attention FLOPs follow each layer's mean context, which matches a count of the mask's visible keys
    (to the half key of the T/2 convention); global layers count T/2."""
    config = ModelConfig(num_layers=4, attention_window=100, global_layers=(3,))
    for depth, window in [(0, 100), (3, None)]:
        visible = float(np.asarray(attention_mask(1000, 1000, causal=True, window=window)).sum()) / 1000
        assert abs(config.mean_context(depth, 1000) - visible) <= 0.5
    full = config.replace(attention_window=None, global_layers=())
    kind = attention_kinds.get(config.attention)
    saved = 3 * 3 * (kind.attention_flops(config, 500) - kind.attention_flops(config, config.mean_context(0, 1000)))
    assert training_flops_per_token(full, 1000) - training_flops_per_token(config, 1000) == pytest.approx(saved)


def test_unilm_window_size_round_trips_and_hf_export_refuses_a_window():
    config = ModelConfig(num_layers=3, attention_window=64, global_layers=(2,))
    assert unilm_window_size(config, 0) == (63, 0) and unilm_window_size(config, 2) == (-1, -1)
    assert window_from_unilm((63, 0)) == 64 and window_from_unilm((63, 63)) == 64  # right is ignored (causal)
    assert window_from_unilm((-1, -1)) is None
    for bad in [(-2, 0), (3,), "64", (1.5, 0)]:
        with pytest.raises(ValueError, match="window_size"):
            window_from_unilm(bad)
    with pytest.raises(ConversionError, match="attention_window=64: HF DiffLlama and Llama attend the whole context"):
        check_exportable(config)
