"""Generation with the KV cache: every step's logits against a full forward pass over the same prefix,
greedy output token for token against transformers' generate, sampling filters against transformers'
logits warpers, data-parallel generation on 8 simulated devices, one decode compile, the donated cache."""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import diffjax
from diffjax.config import ModelConfig
from diffjax.generate import decode, generation
from diffjax.generate.__main__ import SEPARATOR
from diffjax.generate.sampling import Sampling, filter_logits, next_tokens
from diffjax.model import TransformerLM
from diffjax.model.kv_cache import K_SLOT_AXIS, V_SLOT_AXIS, KVCache

TINY = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=2, max_seq_len=32)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, rope_factor=4.0, rope_original_max_len=8)
# Between them and the transformers cases below: both attentions, GQA, both RoPE styles, llama3 scaling,
# scanned and looped layers.
CASES = {
    "diff_gqa_rotate_half_llama3_scanned": ModelConfig(**{**TINY, "d_model": 64, "num_heads": 4}, num_kv_heads=2,
                                                       rope_style="rotate_half", scan_layers=True, **LLAMA3),
    "standard_mha_interleaved": ModelConfig(**{**TINY, "num_heads": 4}, attention="standard"),
    # The variants: V2's keys shared by each pair (G = 1) and per-token lambda; Shared DIFF's low-rank q / k.
    "diff_v2_gqa": ModelConfig(**{**TINY, "num_heads": 4}, attention="diff_v2", num_kv_heads=2),
    "shared_diff": ModelConfig(**TINY, attention="shared_diff"),
    # A sliding window of 3 keys (shorter than every prompt plus its steps) on layer 0, layer 1 global: the decode
    # step's mask over the cache slots, and a scanned stack that picks per layer.
    "diff_window_and_global_layer_scanned": ModelConfig(**{**TINY, "d_model": 64}, attention_window=3, global_layers=(1,),
                                                        scan_layers=True),
    "standard_window": ModelConfig(**{**TINY, "num_heads": 4}, attention="standard", attention_window=4),
}
PROMPT_LENGTHS = [5, 2, 7]
STEPS = 6
CACHED_LOGITS_TOL = 1e-5  # max |cached - full| / max |full|, fp32


def random_model(config: ModelConfig, seed: int = 0) -> TransformerLM:
    """A model with numpy-drawn weights (an eager init compiles op by op: ~10 s on 2 busy cores); weights
    of std 0.2 and norm scales around 1, so that attention maps are far from uniform."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    rng = np.random.RandomState(seed)

    def draw(path, x):
        is_scale = jax.tree_util.keystr(path).endswith("scale']")
        return ((1.0 if is_scale else 0.0) + 0.2 * rng.standard_normal(x.shape)).astype(x.dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


@functools.cache
def tiny_model(case: str) -> TransformerLM:
    return random_model(CASES[case])


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "unstacked"))
def _prefill(graphdef, params, prompts_BP, lengths_B, *, max_len, unstacked):
    model = nnx.merge(graphdef, params)
    layer_params = model.unstacked_blocks() if unstacked else None
    logits_BPV, cache = model(prompts_BP, cache=KVCache.empty(prompts_BP.shape[0], max_len, lengths_B),
                              layer_params=layer_params)
    return logits_BPV, dataclasses.replace(cache, lengths_B=lengths_B)


@functools.partial(jax.jit, static_argnames=("graphdef", "unstacked"), donate_argnames=("cache",))
def _decode(graphdef, params, cache, tokens_B1, *, unstacked):
    model = nnx.merge(graphdef, params)
    return model(tokens_B1, cache=cache, layer_params=model.unstacked_blocks() if unstacked else None)


# Every case through per-layer params and caches (what generate runs); the scanned ones also through the stack.
CACHE_PATHS = [(case, True) for case in CASES] + [(case, False) for case in CASES if case.endswith("_scanned")]


@pytest.mark.parametrize("case, unstacked", CACHE_PATHS)
def test_cached_logits_equal_a_full_forward_at_every_step(case, unstacked, measured):
    """Prompts of different lengths (right-padded), then STEPS tokens fed one at a time through the cache:
    each step's logits equal the full model's at the same position of the whole sequence (causal, so
    that is the forward pass over the same prefix)."""
    model = tiny_model(case)
    rng = np.random.RandomState(1)
    B, P, V = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), model.config.vocab_size
    prompts_BP = rng.randint(0, V, (B, P)).astype(np.int32)
    continuation_BN = rng.randint(0, V, (B, STEPS)).astype(np.int32)
    lengths_B = np.array(PROMPT_LENGTHS, np.int32)
    sequences_BS = np.zeros((B, P + STEPS), np.int32)
    for b, n in enumerate(PROMPT_LENGTHS):
        sequences_BS[b, :n] = prompts_BP[b, :n]
        sequences_BS[b, n : n + STEPS] = continuation_BN[b]
    prompts_BP[np.arange(P)[None] >= lengths_B[:, None]] = 7  # pad ids: never attended

    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    full_BSV = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, sequences_BS))
    logits_BPV, cache = _prefill(graphdef, params, prompts_BP, lengths_B, max_len=P + STEPS, unstacked=unstacked)
    cached = [np.asarray(logits_BPV)[np.arange(B), lengths_B - 1]]
    for t in range(STEPS - 1):
        previous = cache
        logits_B1V, cache = _decode(graphdef, params, cache, continuation_BN[:, t : t + 1], unstacked=unstacked)
        assert all(x.is_deleted() for x in jax.tree.leaves((previous.k, previous.v))), "the cache is not donated"
        cached.append(np.asarray(logits_B1V)[:, 0])
    reference = np.stack([full_BSV[np.arange(B), lengths_B - 1 + t] for t in range(STEPS)])
    error = measured("cached vs full logits, max rel err", np.abs(np.stack(cached) - reference).max() / np.abs(reference).max(),
                     CACHED_LOGITS_TOL)
    assert error <= CACHED_LOGITS_TOL
    # One buffer per layer (or a stack of them), one slot per position; per layer in a loop, a windowed layer's a ring
    # of its window's slots.
    assert (len(cache.k), isinstance(cache.k, tuple)) == (model.config.num_layers, unstacked)
    k0, v0 = cache.k[0], cache.v[0]
    slots = min(model.config.window_at(0) or P + STEPS, P + STEPS) if unstacked else P + STEPS
    assert (k0.shape[0], k0.shape[K_SLOT_AXIS], v0.shape[V_SLOT_AXIS]) == (B, slots, slots)
    np.testing.assert_array_equal(cache.lengths_B, lengths_B + STEPS - 1)


# --- against transformers ----------------------------------------------------------------------------

HF_CASES = {
    "diffllama_gqa": ("diffllama", dict(num_key_value_heads=4), "interleaved"),
    "llama_gqa_llama3_rotate_half": ("llama", "llama3", "rotate_half"),
}
HF_PROMPT_LENGTHS = [6, 3, 9]
HF_NEW_TOKENS = 8


def _hf_case(case, tmp_path):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from hf_models import LLAMA3_ROPE, make_hf_model

    kind, overrides, rope_style = HF_CASES[case]
    overrides = dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE) if overrides == "llama3" else overrides
    hf = make_hf_model(kind, num_hidden_layers=2, **overrides)
    hf.save_pretrained(tmp_path)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, hf.config.vocab_size, n) for n in HF_PROMPT_LENGTHS]

    def hf_greedy(prompt, **stop):
        """transformers' greedy decoding, one prompt at a time, re-running the whole prefix each step."""
        ids = torch.tensor(prompt[None], dtype=torch.long)
        with torch.no_grad():  # (the attention mask given: HF would otherwise mask prompt tokens equal to pad_token_id)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=HF_NEW_TOKENS, do_sample=False,
                              use_cache=False, **({"eos_token_id": None, "pad_token_id": 0} | stop))
        return out[0, len(prompt):].numpy()

    return diffjax.load_hf(tmp_path, rope_style=rope_style), prompts, hf_greedy


@pytest.mark.parametrize("case", list(HF_CASES))
def test_greedy_equals_transformers_token_for_token(case, tmp_path):
    model, prompts, hf_greedy = _hf_case(case, tmp_path)
    compiles = decode._generate._cache_size()
    ours = diffjax.generate(model, prompts, HF_NEW_TOKENS)  # one batch, prompts of three lengths
    np.testing.assert_array_equal(diffjax.generate(model, prompts, HF_NEW_TOKENS), ours)
    assert decode._generate._cache_size() == compiles + 1, "generation compiled more than once for the same shapes"
    for b, prompt in enumerate(prompts):
        np.testing.assert_array_equal(ours[b], hf_greedy(prompt), err_msg=f"prompt {b} ({len(prompt)} tokens)")

    # A stop token (one the first row produces at step 3): each row ends at its first one, then pads with it.
    stop = int(ours[0, 3])
    stopped = diffjax.generate(model, prompts, HF_NEW_TOKENS, stop_tokens=[stop])
    for b, prompt in enumerate(prompts):
        theirs = hf_greedy(prompt, eos_token_id=stop, pad_token_id=stop)
        np.testing.assert_array_equal(stopped[b, : len(theirs)], theirs)
        assert (stopped[b, len(theirs):] == stop).all()
    assert stop in stopped[0, :4]


# --- sampling ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k, top_p", [(1, None), (5, None), (None, 0.3), (None, 0.9), (10, 0.7)])
def test_filters_keep_the_tokens_transformers_keeps(top_k, top_p):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.RandomState(0).randn(6, 50).astype(np.float32) * 2
    expected = torch.tensor(logits)
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p))
    np.testing.assert_array_equal(np.isfinite(ours), torch.isfinite(expected).numpy())


def test_sampled_frequencies_follow_the_filtered_distribution():
    """20000 draws with temperature, top-k and top-p: each token's frequency within 1.5 points of the
    softmax of the tempered, filtered logits (written out here in numpy); filtered tokens never drawn."""
    logits_V = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], np.float32)
    temperature, top_k, top_p = 0.7, 5, 0.85
    scaled = logits_V / temperature
    probs = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    kept = np.argsort(-scaled)[:top_k]  # top-k, then the most likely of those until their mass reaches top_p
    renorm = np.exp(scaled[kept] - scaled.max()) / np.exp(scaled[kept] - scaled.max()).sum()
    kept = kept[: int(np.searchsorted(np.cumsum(renorm), top_p) + 1)]
    expected = np.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    draws = np.asarray(next_tokens(jnp.tile(logits_V, (20000, 1)), jax.random.key(0), Sampling(temperature, top_k, top_p)))
    frequencies = np.bincount(draws, minlength=logits_V.size) / draws.size
    assert (frequencies[expected == 0] == 0).all(), frequencies
    np.testing.assert_allclose(frequencies, expected, atol=0.015)


# --- the decode step reads each weight once -----------------------------------------------------------

def hlo_computations(hlo_text: str) -> dict[str, list[str]]:
    """A compiled module's computations (name -> instruction lines)."""
    computations, name = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?(%\S+) ", line)
        if header:
            name = header.group(1)
            computations[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            computations[name].append(line)
    return computations


INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(")
COPY_FREE = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant"}


def is_matmul(line: str) -> bool:
    """A dot, or a library call XLA makes of one (XNNPACK / oneDNN / cuBLAS fusions are kCustom)."""
    match = INSTRUCTION.match(line)
    return match is not None and (match.group(3) in ("dot", "custom-call") or "kind=kCustom" in line)


def arrays_sized(instructions: list[str], sizes: set[int], but=()) -> list[str]:
    """Instructions that produce an array with one of `sizes` elements other than by a matmul (or an op whose name
    holds one of `but`): for a weight's size a slice, copy, convert or transpose of the weight (each reads it and
    writes it again before the matmul reads it); for a cache buffer's, a copy of the buffer."""
    found = []
    for line in instructions:
        match = INSTRUCTION.match(line)
        if match and match.group(3) not in COPY_FREE and not is_matmul(line) and not any(b in match.group(1) for b in but):
            if int(np.prod([int(d) for d in match.group(2).split(",") if d])) in sizes:
                found.append(line.strip()[:160])
    return found


# Batch 3 and power-of-two model sizes: every activation and cache buffer has a multiple of 3 elements, no weight does.
LOOP_CASES = {
    "diff_gqa_looped": ModelConfig(**{**TINY, "d_model": 64, "num_heads": 4}, num_kv_heads=2),
    "diff_gqa_scanned": ModelConfig(**{**TINY, "d_model": 64, "num_heads": 4}, num_kv_heads=2, scan_layers=True),
    "standard_tied_bf16_compute": ModelConfig(**{**TINY, "vocab_size": 64, "num_heads": 4}, attention="standard",
                                              tie_embeddings=True, dtype="bfloat16"),
}


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_the_decode_loop_copies_no_weight_and_no_cache(case):
    """The compiled decode loop (the while body: one decode step) produces no weight-sized array but by matmuls
    (the per-layer params and the compute-dtype embedding / head it reads are made once, before the loop) and no
    cache-sized one but the in-place slot write (the attention reads the buffers as stored)."""
    model = random_model(LOOP_CASES[case])
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    weights = [x for x in jax.tree.leaves(model.unstacked_blocks()) + [model.embed.embedding[...]] if x.ndim >= 2]
    B, P, N = 3, 4, 8
    choice = decode.Choice(Sampling(), (), 0)
    hlo = decode._generate.lower(graphdef, params, np.ones((B, P), np.int32), np.full((B,), P, np.int32), jax.random.key(0),
                                 np.int32(0), max_len=P + N, max_new_tokens=N, choice=choice, mesh=None,
                                 streaming=False, step=decode.PLAIN).compile().as_text()
    body = hlo_computations(hlo)[re.search(r"body=(%[\w.\-]+)", hlo).group(1)]
    assert sum(map(is_matmul, body)) >= 4 * model.config.num_layers, "this is not the decode step's loop"
    assert arrays_sized(body, {x.size for x in weights}) == []
    if model.config.dtype != "float32":
        return  # XLA:CPU runs a bfloat16 attention dot in float32: it converts the keys and values each step, by design
    _, cache = jax.eval_shape(lambda: model(np.ones((B, P), np.int32), cache=KVCache.empty(B, P + N),
                                            layer_params=model.unstacked_blocks()))
    assert arrays_sized(body, {x.size for x in jax.tree.leaves((cache.k, cache.v))}, but=("scatter", "dynamic-update-slice")) == []


def test_the_decoding_weights_compute_what_the_model_computes():
    """Float32 params, bfloat16 compute: the per-layer, pre-cast weights generation reads give the model's own
    logits and cache bit for bit (every module casts a matrix to the compute dtype before its matmul)."""
    model = random_model(ModelConfig(**{**TINY, "num_heads": 4}, num_kv_heads=2, dtype="bfloat16", param_dtype="float32"))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tokens_BT = np.random.RandomState(0).randint(0, TINY["vocab_size"], (2, 5))

    @jax.jit
    def both(params):
        decoding, layer_params = decode.decoding_model(graphdef, params)
        assert {x.dtype for x in jax.tree.leaves(layer_params) if x.ndim >= 2} == {jnp.dtype(jnp.bfloat16)}
        cache = KVCache.empty(2, 8)
        return nnx.merge(graphdef, params)(tokens_BT, cache=cache), decoding(tokens_BT, cache=cache, layer_params=layer_params)

    (logits, cache), (decoded, decoded_cache) = both(params)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(decoded_cache.k[1]), np.asarray(cache.k[1]))


# --- the loop on the device, streaming ------------------------------------------------------------------

def test_streaming_hands_over_each_step_and_can_stop_the_loop():
    """on_tokens gets every step's tokens in order (the result's columns); returning False stops the loop there,
    an exception stops it and is raised; stop tokens end the loop on the device (fewer steps run)."""
    model = tiny_model("standard_mha_interleaved")
    prompts, N = [[1, 2, 3], [4, 5]], 8
    plain = diffjax.generate(model, prompts, N)
    seen = []
    streamed = diffjax.generate(model, prompts, N, on_tokens=lambda step, tokens: seen.append((step, tokens.copy())))
    np.testing.assert_array_equal(streamed, plain)
    assert [step for step, _ in seen] == list(range(N))
    np.testing.assert_array_equal(np.stack([tokens for _, tokens in seen], axis=1), plain)
    # timings: the program compiled before it runs, the same tokens streamed, every step after the run began
    seen.clear()
    timings = []
    timed = diffjax.generate(model, prompts, N, timings=timings, on_tokens=lambda *_: seen.append(time.perf_counter()))
    np.testing.assert_array_equal(timed, plain)
    (timing,) = timings
    assert timing.compile_seconds > 0 and timing.generate_seconds > 0 and len(seen) == N
    assert timing.began <= seen[0] and seen[-1] <= timing.began + timing.generate_seconds

    seen.clear()
    stopped = diffjax.generate(model, prompts, N, pad_id=0, on_tokens=lambda step, tokens: seen.append(step) or step < 2)
    assert seen == [0, 1, 2]
    np.testing.assert_array_equal(stopped[:, :3], plain[:, :3])
    assert (stopped[:, 3:] == 0).all()

    def interrupted(step, tokens):
        seen.append(step)
        if step == 1:
            raise KeyboardInterrupt
    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        diffjax.generate(model, prompts, N, on_tokens=interrupted)
    assert seen == [0, 1]

    # Both rows produce a stop token by step 2 (each row's own token there): the device loop ends after step 2.
    graphdef, params = nnx.split(model)
    stops = [int(plain[0, 1]), int(plain[1, 2])]
    seen.clear()
    early = diffjax.generate(model, prompts, N, stop_tokens=stops, on_tokens=lambda step, tokens: seen.append(step))
    assert seen[-1] <= 2 and len(seen) == seen[-1] + 1
    decoded = decode.run(graphdef, nnx.to_pure_dict(params), *map(jnp.asarray, generation._prompt_batch(prompts, None, 61)),
                         jax.random.key(0), max_len=3 + N, max_new_tokens=N, mesh=None,
                         choice=decode.Choice(Sampling(), tuple(stops), stops[0]))
    assert decoded.steps == len(seen)
    assert early[0, 1] == stops[0]


def test_the_benchmark_runs_and_matches_transformers_greedy(tmp_path, monkeypatch, capsys):
    """benchmarks/generate.py on a small DiffLlama (the default model is 56M: too slow here): every figure present,
    and diffjax's greedy tokens equal transformers' generate with its own KV cache (eager)."""
    pytest.importorskip("transformers")
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from hf_models import make_hf_model

    make_hf_model("diffllama", num_hidden_layers=2, num_key_value_heads=4).save_pretrained(tmp_path / "hf")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    monkeypatch.setattr(sys, "argv", ["generate.py", "--hf", str(tmp_path / "hf"), "--batches", "3", "--prompts", "5",
                                      "--new-tokens", "6", "--dtypes", "float32", "--peers", "eager", "--repeats", "1",
                                      "--check-tokens", "--out", str(tmp_path / "out.json")])
    benchmark.main()
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [(row["batch"], row["tokens_equal_eager"]) for row in rows] == [(3, 1.0)]
    assert rows[0]["diffjax"]["bytes_per_step"] > 0 and rows[0]["eager"]["ratio"] > 0
    assert "| float32 | 5 | 3 |" in capsys.readouterr().out


# --- under a mesh, compile and errors ----------------------------------------------------------------

def test_data_parallel_generation_equals_one_device():
    """8 prompts of different lengths split over data=8 (8 simulated devices) give the tokens one device gives
    for the same prompts as a right-padded array with lengths (sampled: top-p with temperature)."""
    model = tiny_model("standard_mha_interleaved")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8, 1, 1), ("data", "fsdp", "tensor"))
    lengths = [3, 8, 1, 5, 6, 2, 7, 4]
    padded = np.random.RandomState(2).randint(0, model.config.vocab_size, (len(lengths), max(lengths)))
    options = dict(temperature=1.0, top_p=0.9, key=jax.random.key(5))
    on_mesh = diffjax.generate(model, [row[:n] for row, n in zip(padded, lengths)], 6, mesh=mesh, **options)
    np.testing.assert_array_equal(on_mesh, diffjax.generate(model, padded, 6, lengths=lengths, **options))


@pytest.mark.parametrize("tokens, options, message", [
    (np.array([1, 2, 3]), {}, r"tokens must be an array \[batch, length\]"),
    ([[1, 2], []], {}, r"every prompt needs 1 to 2 tokens"),
    ([[1, 61]], {}, r"token id 61 \(prompt 0, position 1\) is outside the model's vocabulary \[0, 61\)"),
    ([[1.5, 2]], {}, r"token ids must be integers"),
    ([[1, 2]], {"max_new_tokens": 31}, r"= 33 exceeds the model's max_seq_len 32"),
    ([[1, 2]], {"max_new_tokens": 0}, r"max_new_tokens must be a positive integer"),
    ([[1, 2]], {"temperature": 0.5}, r"pass key=jax.random.key"),
    ([[1, 2]], {"temperature": -1}, r"temperature must be a number >= 0"),
    ([[1, 2]], {"temperature": 1, "top_p": 1.5, "key": jax.random.key(0)}, r"top_p must be in \(0, 1\]"),
    ([[1, 2]], {"top_k": 0}, r"top_k must be a positive integer"),
    ([[1, 2]], {"stop_tokens": [99]}, r"stop / pad token 99 is outside"),
    (np.ones((2, 3), np.int32), {"lengths": [1]}, r"lengths must be integers, one per prompt \(2\)"),
])
def test_bad_input_is_a_clear_error(tokens, options, message):
    model = tiny_model("standard_mha_interleaved")
    options = {"max_new_tokens": 2, **options}
    with pytest.raises((ValueError, TypeError), match=message):
        diffjax.generate(model, tokens, options.pop("max_new_tokens"), **options)


# --- the CLI -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def byte_run_dir(tmp_path_factory):
    """A params-only run directory of a byte-level model whose config.yaml names the byte tokenizer."""
    from diffjax.checkpoint import save_params

    config = ModelConfig(**{**TINY, "vocab_size": 257, "num_layers": 1})
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    save_params(run_dir, nnx.to_pure_dict(nnx.state(random_model(config, seed=1), nnx.Param)), config)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(
        "data:\n", "data:\n  tokenizer: {kind: byte}\n"))
    return run_dir


def test_cli_prints_each_prompt_and_its_continuation(byte_run_dir, capsys):
    """No --temperature: greedy, the CLI's default as the API's (compared with diffjax.generate's default)."""
    from diffjax.checkpoint import load_model
    from diffjax.generate.__main__ import main
    from diffjax.tokenizers import ByteTokenizer

    prompts = ["def f(x):", "import"]
    assert main(["--checkpoint", str(byte_run_dir), "--prompt", prompts[0], "--prompt", prompts[1],
                 "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    tokenizer = ByteTokenizer()
    new = diffjax.generate(load_model(byte_run_dir), [tokenizer.encode(p) for p in prompts], 6, stop_tokens=[tokenizer.eos_id])
    texts = [p + tokenizer.decode(row[: list(row).index(256) + 1] if 256 in row else row) for p, row in zip(prompts, new)]
    assert out == texts[0] + "\n" + SEPARATOR + "\n" + texts[1] + "\n"
    assert re.search(r"^\d+ tokens: compiled in [\d.]+ s, generated in [\d.]+ s \([\d.]+ tokens/s; first token after "
                     r"[\d.]+ s \(prefill\), then [\d.]+ tokens/s \(2 x \d+ steps\)\)$", err), err

    assert main(["--checkpoint", str(byte_run_dir), "--prompt", prompts[0], "--max-new-tokens", "6"]) == 0  # streamed
    out, err = capsys.readouterr()
    assert out == texts[0] + "\n"
    assert "first token after" in err


def test_cli_without_a_tokenizer_takes_ids_and_names_the_fix(byte_run_dir, tmp_path, capsys):
    from diffjax.generate.__main__ import main

    converted = tmp_path / "converted"  # a conversion's config.yaml: a model section and no data.tokenizer
    (converted / "hf").mkdir(parents=True)
    (converted / "checkpoints").symlink_to(byte_run_dir / "checkpoints")
    (converted / "config.yaml").write_text((byte_run_dir / "config.yaml").read_text().replace("  tokenizer: {kind: byte}\n", ""))
    assert main(["--checkpoint", str(converted), "--prompt", "hi"]) == 2
    assert f"{converted / 'config.yaml'} names no tokenizer (data.tokenizer) (a conversion keeps its source's tokenizer " \
           f"files in {converted / 'hf'})" in capsys.readouterr().err
    assert main(["--checkpoint", str(converted), "--prompt-ids", "104,105", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    printed = [int(x) for x in capsys.readouterr().out.split()]
    assert printed[:2] == [104, 105] and len(printed) == 5


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "absent", "--checkpoint: {} is not a run directory or checkpoint"),
    (lambda tmp: tmp, "--checkpoint: no checkpoint under {}"),
])
def test_cli_bad_checkpoint_is_exit_2_naming_it(make, message, tmp_path, capsys):
    from diffjax.generate.__main__ import main

    path = make(tmp_path)
    assert main(["--checkpoint", str(path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == f"error: {message.format(path)}\n"
