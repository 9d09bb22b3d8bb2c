"""Generation with GDLA's latent KV cache and windowed layers' rings (diffjax.model.kv_cache, attention/gdla.py): what
the buffers hold (the kv latent and the RoPE key per token, a ring of window slots on windowed layers), which
positions a ring shows each decode step as it wraps with right-padded prompts of different lengths, cached greedy
decode of a small Motif 3 against the full forward token for token, on one device and on 8 simulated devices, and the
benchmark's cache-size table at the published size against the config's arithmetic."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import diffjax
from diffjax.convert.hf import config_from_hf
from diffjax.model import TransformerLM
from diffjax.model.kv_cache import K_SLOT_AXIS, V_SLOT_AXIS, KVCache

from motif3_published import small_config

REPO_ROOT = Path(__file__).resolve().parents[1]
# SMALL: layers 0 and 2 global, 1 and 3 windowed (sliding_window 3: 4 keys); prompts longer and shorter than the window
# and more new tokens than it, so that every ring wraps while some rows' prompts do not fill it.
PROMPT_LENGTHS = [9, 2, 6]
NEW_TOKENS = 8


def small_motif3(**changes):
    return config_from_hf({"model_type": "Motif", **small_config(**changes)}).replace(
        dtype="float32", param_dtype="float32", attention_impl="xla")


def random_model(config, seed: int = 0) -> TransformerLM:
    """numpy-drawn weights (no compiled init): std 0.2, norm scales around 1, so the maps are far from uniform."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    rng = np.random.RandomState(seed)

    def draw(path, x):
        centre = 1.0 if jax.tree_util.keystr(path).endswith("scale']") else 0.0
        return (centre + 0.2 * rng.standard_normal(x.shape)).astype(x.dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def test_the_cache_holds_the_latent_and_rope_key_and_windowed_layers_keep_a_ring():
    """Per layer and token: kv_lora_rank + qk_rope_head_dim values (not Hkv x (d + dv)); slots: the window on windowed
    layers, every position on global ones. Shapes only (eval_shape)."""
    config = small_motif3()
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    B, P, S = 3, 9, 40

    def prefilled(state):
        model = nnx.merge(graphdef, state)
        return model(jnp.zeros((B, P), jnp.int32), cache=KVCache.empty(B, S), layer_params=model.unstacked_blocks())[1]

    cache = jax.eval_shape(prefilled, state)
    o = config.attention_options
    assert config.window_at(1) == 4 and config.window_at(0) is None
    for depth, (k, v) in enumerate(zip(cache.k, cache.v, strict=True)):
        slots = config.window_at(depth) or S
        assert (k.shape[K_SLOT_AXIS], v.shape[V_SLOT_AXIS]) == (slots, slots), depth
        assert (k.size + v.size) // (B * slots) == o.kv_lora_rank + o.qk_rope_head_dim, depth


@pytest.mark.parametrize("window", [1, 3, 4])
def test_a_ring_shows_exactly_the_window_each_step_as_it_wraps(window):
    """Keys and values that are their own positions (pad positions -1): after a prefill of right-padded prompts of
    lengths 7, 2 and 4, each decode step's visible slots hold exactly the positions p - W + 1 .. p (those >= 0), as the
    S-slot cache's window mask shows them."""
    lengths = np.array([7, 2, 4], np.int32)
    B, P, S = len(lengths), int(lengths.max()), 20
    positions_BP = np.where(np.arange(P)[None] < lengths[:, None], np.arange(P)[None], -1).astype(np.float32)
    as_kv = lambda x: jnp.asarray(x, jnp.float32)[:, :, None, None]  # noqa: E731  [B, T, 1 head, 1 channel]
    ring, full = (KVCache.empty(B, S, lengths).layer(None, None, window=w) for w in (window, None))
    ring, full = (c.update(as_kv(positions_BP), as_kv(positions_BP), {"window": window})[0] for c in (ring, full))
    assert ring.k.shape[K_SLOT_AXIS] == window and full.k.shape[K_SLOT_AXIS] == S
    ring, full = (dataclasses.replace(c, lengths_B=jnp.asarray(lengths)) for c in (ring, full))
    for step in range(2 * window + 3):
        p = lengths + step
        seen = []
        for cache in (ring, full):
            cache, k, v, op_kwargs = cache.update(as_kv(p[:, None]), as_kv(p[:, None]), {"window": window})
            visible_BS = np.asarray(op_kwargs["segment_ids"][1]) > 0
            np.testing.assert_array_equal(np.asarray(k), np.asarray(v))
            seen.append([sorted(np.asarray(k)[b, visible_BS[b], 0, 0].tolist()) for b in range(B)])
            if cache.window is None:
                full = dataclasses.replace(cache, lengths_B=cache.lengths_B + 1)
            else:
                ring = dataclasses.replace(cache, lengths_B=cache.lengths_B + 1)
        expected = [list(map(float, range(max(0, q - window + 1), q + 1))) for q in p]
        assert seen == [expected, expected], f"step {step}"


def prompts_and_model():
    model = random_model(small_motif3())
    rng = np.random.RandomState(2)
    return model, [rng.randint(0, model.config.vocab_size, n) for n in PROMPT_LENGTHS]


def full_logits(model, prompts, continuations_BN) -> np.ndarray:
    """Without a cache: each row's prompt + continuation (right-padded) through one full forward; the logits [B, N, V]
    at the positions that predict each continuation token (causal: the forward over each growing prefix, one call)."""
    N = continuations_BN.shape[1]
    sequences_BS = np.zeros((len(prompts), max(map(len, prompts)) + N), np.int32)
    for b, prompt in enumerate(prompts):
        sequences_BS[b, :len(prompt) + N] = np.concatenate([prompt, continuations_BN[b]])
    logits_BSV = np.asarray(jax.jit(model)(jnp.asarray(sequences_BS)))
    return np.stack([logits_BSV[b, len(prompt) - 1:len(prompt) - 1 + N] for b, prompt in enumerate(prompts)])


@pytest.mark.slow
def test_cached_greedy_decode_equals_the_full_forward_token_for_token():
    """A batch of prompts of lengths 9, 2 and 6 (right-padded to 9) through generate (prefill + decode on the latent
    cache, rings of 4 slots on the windowed layers, absorbed decode attention) against the full forward's argmax."""
    model, prompts = prompts_and_model()
    generated_BN = np.asarray(diffjax.generate(model, prompts, NEW_TOKENS))
    np.testing.assert_array_equal(generated_BN, full_logits(model, prompts, generated_BN).argmax(-1))


@pytest.mark.slow
def test_cached_logits_equal_the_full_forward_at_every_step(measured):
    """The same prompts, then random tokens fed one at a time through the cache (the rings wrap): every step's logits
    within 1e-5 of the full forward's (the absorbed form reorders the float32 sums; a slot shown or hidden wrongly
    moves them by far more)."""
    model, prompts = prompts_and_model()
    B, P, N = len(prompts), max(PROMPT_LENGTHS), NEW_TOKENS
    continuations_BN = np.random.RandomState(3).randint(0, model.config.vocab_size, (B, N)).astype(np.int32)
    prompts_BP = np.zeros((B, P), np.int32)
    for b, prompt in enumerate(prompts):
        prompts_BP[b, :len(prompt)] = prompt
    lengths_B = np.array(PROMPT_LENGTHS, np.int32)
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, tokens_BT, cache):
        model = nnx.merge(graphdef, params)
        return model(tokens_BT, cache=cache, layer_params=model.unstacked_blocks())

    logits_BPV, cache = step(params, prompts_BP, KVCache.empty(B, P + N, lengths_B))
    cache = dataclasses.replace(cache, lengths_B=jnp.asarray(lengths_B))
    cached = [np.asarray(logits_BPV)[np.arange(B), lengths_B - 1]]
    for t in range(N - 1):
        logits_B1V, cache = step(params, continuations_BN[:, t:t + 1], cache)
        cached.append(np.asarray(logits_B1V)[:, 0])
    reference_BNV = full_logits(model, prompts, continuations_BN)
    error = np.abs(np.stack(cached, axis=1) - reference_BNV).max() / np.abs(reference_BNV).max()
    assert measured("latent cache + rings vs full forward logits, max rel err", error, 1e-5) <= 1e-5


@pytest.mark.slow
def test_decode_on_a_mesh_equals_one_device():
    """data=2 x tensor=4 on the 8 simulated devices (the prompts split over data, heads and experts over tensor where
    they divide): the same tokens as one device."""
    model, prompts = prompts_and_model()
    prompts = prompts + [prompts[0][:5]]  # 4 rows: the data axis divides them
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 4), ("data", "fsdp", "tensor"))
    on_mesh = np.asarray(diffjax.generate(model, prompts, NEW_TOKENS, mesh=mesh))
    np.testing.assert_array_equal(on_mesh, np.asarray(diffjax.generate(model, prompts, NEW_TOKENS)))


@pytest.mark.slow
def test_the_benchmark_reports_latent_and_expanded_bytes_per_token_at_the_published_size(tmp_path, capsys):
    """benchmarks/generate.py --cache-sizes on motif3/published (shapes only): per token and layer the
    latent cache holds (kv_lora_rank + qk_rope_head_dim) bf16 values, the expanded one Hkv (d + dv); with rings the
    windowed layers hold their window, so a 256K sequence holds the global layers' positions plus the windows."""
    from diffjax.train.config import load_run_config

    spec = importlib.util.spec_from_file_location("generate_benchmark", REPO_ROOT / "benchmarks" / "generate.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    path = "motif3/published"
    rows = {row["layout"]: row for row in benchmark.cache_sizes([str(path)], tmp_path / "sizes.md")}
    c = load_run_config(path).model
    o, L, itemsize = c.attention_options, c.num_layers, jnp.dtype(c.dtype).itemsize
    latent = (o.kv_lora_rank + o.qk_rope_head_dim) * itemsize
    expanded = c.num_kv_heads * (c.head_dim + o.v_head_dim) * itemsize
    per_layer = (rows["latent"]["bytes_per_token_per_layer"], rows["expanded"]["bytes_per_token_per_layer"])
    assert per_layer == (latent, expanded) == (1152, 10240)
    assert (rows["latent"]["bytes_per_token"], rows["expanded"]["bytes_per_token"]) == (L * latent, L * expanded)
    context, window, global_layers = 262144, c.attention_window, len(c.global_layers)
    assert rows["latent"]["bytes_per_sequence"][str(context)] == latent * (
        global_layers * context + (L - global_layers) * window)
    assert rows["latent_no_ring"]["bytes_per_sequence"][str(context)] == latent * L * context
    assert "| published | latent + rings (generate) | bfloat16 | 1,152 |" in (tmp_path / "sizes.md").read_text()
