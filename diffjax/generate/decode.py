"""Generation with a KV cache: one jitted program runs the prefill over the prompts, then the decode steps in a
`lax.while_loop` on the device, which stops when every row has produced a stop token or at max_new_tokens.

Decode at small batch is bound by memory traffic: each step reads every weight and the cache so far. So the step
reads the blocks' params as per-layer copies made once before the loop (TransformerLM.unstacked_blocks; a
slice of the stacked params inside the step is a copy XLA makes before the matmul, tripling the weight
traffic), keeps one cache buffer per layer in the loop's carry and writes one slot per row into it. The
program compiles once per (batch, padded prompt length, max_new_tokens, sampling) and is cached by jax.jit.
Streaming (`on_tokens`) hands each step's tokens to the host from inside the loop (an io_callback), which can
also stop it. See diffjax.model.kv_cache for the cache's layout.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from diffjax import sharding
from diffjax.generate.sampling import Sampling, next_tokens
from diffjax.kinds import param_stacks
from diffjax.model.kv_cache import KVCache


@functools.partial(jax.tree_util.register_dataclass, data_fields=("cache", "tokens_BN", "done_B", "step", "go_on"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: KVCache
    tokens_BN: jax.Array  # the new tokens; pad_id where not generated (yet, or after the row's stop token)
    done_B: jax.Array  # the row has produced a stop token
    step: jax.Array  # tokens generated so far (the next one goes to tokens_BN[:, step])
    go_on: jax.Array  # False once a streaming receiver asked to stop


@dataclasses.dataclass(frozen=True)
class Choice:
    """How the next token is chosen (static: hashable, part of the compiled program)."""

    sampling: Sampling
    stop_tokens: tuple[int, ...]
    pad_id: int


def compute_cast(dtype):
    """x -> x as the decode loop reads it: floating arrays of 2 or more axes in the compute dtype, vectors as they are."""
    def cast(x):
        return x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x

    return cast


def decoding_model(graphdef, params):
    """(The model, its blocks' params per layer) as the decode loop reads them: the per-layer copies and the embedding
    and head in the compute dtype, made once (the modules cast each matrix to it before its matmul: the same
    arithmetic), so that a step reads every weight without slicing or converting it. Vectors keep their dtype."""
    config = nnx.merge(graphdef, params).config
    cast = compute_cast(jnp.dtype(config.dtype))
    stacks = {segment.name for segment in param_stacks(config)}  # (the MTP depths': speculative.mtp_params)
    model = nnx.merge(graphdef, {name: tree if name in stacks else jax.tree.map(cast, tree) for name, tree in params.items()})
    return model, tuple(jax.tree.map(cast, layer) for layer in model.unstacked_blocks())


def _choose(logits_BV, key, step, done_B, choice: Choice):
    """The step's tokens (pad_id for rows already stopped) and the rows stopped after it."""
    token_B = next_tokens(logits_BV, jax.random.fold_in(key, step), choice.sampling)
    token_B = jnp.where(done_B, choice.pad_id, token_B)
    return token_B, done_B | jnp.isin(token_B, jnp.asarray(choice.stop_tokens, jnp.int32))


def prefill(model, layer_params, prompts_BP, lengths_B, key, *, max_len, max_new_tokens, choice) -> DecodeState:
    """Runs the right-padded prompts, stores their keys and values, picks each row's first new token."""
    B = prompts_BP.shape[0]
    x_BPD, cache, _ = model.hidden_states(prompts_BP, cache=KVCache.empty(B, max_len, lengths_B),
                                          layer_params=layer_params)
    last_BV = model.logits(jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1))[:, 0]
    cache = dataclasses.replace(cache, lengths_B=lengths_B)  # the pad slots are overwritten as rows decode
    token_B, done_B = _choose(last_BV, key, 0, jnp.zeros((B,), bool), choice)
    tokens_BN = jnp.full((B, max_new_tokens), choice.pad_id, jnp.int32).at[:, 0].set(token_B)
    return DecodeState(cache, tokens_BN, done_B, jnp.int32(1), jnp.bool_(True))


def decode_step(model, layer_params, state: DecodeState, key, *, choice) -> DecodeState:
    """Feeds each row's last token through the cache and appends the next one."""
    last_B1 = jax.lax.dynamic_slice_in_dim(state.tokens_BN, state.step - 1, 1, axis=1)
    logits_B1V, cache = model(last_B1, cache=state.cache, layer_params=layer_params)
    token_B, done_B = _choose(logits_B1V[:, 0], key, state.step, state.done_B, choice)
    tokens_BN = jax.lax.dynamic_update_slice_in_dim(state.tokens_BN, token_B[:, None], state.step, axis=1)
    return dataclasses.replace(state, cache=cache, tokens_BN=tokens_BN, done_B=done_B, step=state.step + 1)


# Streaming: the compiled program calls _deliver with its stream id, so that one compile serves every receiver.
_receivers: dict[int, "_Receiver"] = {}
_stream_ids = itertools.count()


@dataclasses.dataclass
class _Receiver:
    on_tokens: Callable
    error: BaseException | None = None


def _deliver(stream_id, step, tokens_B) -> np.ndarray:
    """Hands one step's tokens to the generate call's receiver; False stops the loop (it asked to, or raised)."""
    receiver = _receivers[int(stream_id)]
    try:
        go_on = receiver.on_tokens(int(step), np.asarray(tokens_B)) is not False
    except BaseException as error:  # noqa: BLE001 (KeyboardInterrupt too: re-raised by generate once the loop stops)
        receiver.error, go_on = error, False
    return np.bool_(go_on)


def _streamed(state: DecodeState, stream_id, mesh) -> DecodeState:
    token_B = jax.lax.dynamic_index_in_dim(state.tokens_BN, state.step - 1, axis=1, keepdims=False)
    if mesh is not None:  # the callback runs on one device: gather the row-split tokens first
        token_B = jax.lax.with_sharding_constraint(token_B, NamedSharding(mesh, PartitionSpec()))
    go_on = io_callback(_deliver, jax.ShapeDtypeStruct((), jnp.bool_), stream_id, state.step - 1, token_B, ordered=True)
    return dataclasses.replace(state, go_on=state.go_on & go_on)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "max_new_tokens", "choice", "mesh", "streaming"))
def _generate(graphdef, params, prompts_BP, lengths_B, key, stream_id, *, max_len, max_new_tokens, choice, mesh,
              streaming) -> tuple[jax.Array, jax.Array]:
    """(The new tokens [B, max_new_tokens], the steps run): prefill, then decode steps in a while loop."""
    with sharding.activation_sharding(mesh):
        model, layer_params = decoding_model(graphdef, params)
        state = prefill(model, layer_params, prompts_BP, lengths_B, key, max_len=max_len, max_new_tokens=max_new_tokens,
                        choice=choice)
        maybe_streamed = functools.partial(_streamed, stream_id=stream_id, mesh=mesh) if streaming else lambda state: state

        def step(state):
            return maybe_streamed(decode_step(model, layer_params, state, key, choice=choice))

        def going_on(state):
            return (state.step < max_new_tokens) & ~jnp.all(state.done_B) & state.go_on

        state = jax.lax.while_loop(going_on, step, maybe_streamed(state))
    return state.tokens_BN, state.step


def _prompt_batch(tokens, lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompts [B, P] int32, right-padded; lengths [B] int32) from an array [B, P] (+ lengths) or a list
    of 1-D sequences of any lengths."""
    if isinstance(tokens, (list, tuple)) and lengths is None:
        rows = [np.asarray(row) for row in tokens]
        if not rows or any(row.ndim != 1 for row in rows):
            raise ValueError("tokens must be an array [batch, length] or a non-empty list of 1-D token sequences")
        lengths = np.array([row.size for row in rows])
        dtype = np.result_type(*(row.dtype for row in rows if row.size)) if lengths.any() else np.int32
        prompts = np.zeros((len(rows), max(lengths)), dtype)
        for prompt, row in zip(prompts, rows):
            prompt[: row.size] = row
    else:
        prompts = np.asarray(tokens)
        if prompts.ndim != 2 or prompts.shape[0] == 0:
            raise ValueError(f"tokens must be an array [batch, length] (one row per prompt), got shape {prompts.shape}")
        lengths = np.full(prompts.shape[0], prompts.shape[1]) if lengths is None else np.asarray(lengths)
    if not np.issubdtype(prompts.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {prompts.dtype}")
    if lengths.shape != prompts.shape[:1] or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be integers, one per prompt ({prompts.shape[0]}), got {lengths!r}")
    if lengths.min() < 1 or lengths.max() > prompts.shape[1]:
        raise ValueError(f"every prompt needs 1 to {prompts.shape[1]} tokens (the padded length), got lengths {lengths.tolist()}")
    real = np.arange(prompts.shape[1])[None, :] < lengths[:, None]
    bad = real & ((prompts < 0) | (prompts >= vocab_size))
    if bad.any():
        row, column = np.argwhere(bad)[0]
        raise ValueError(f"token id {int(prompts[row, column])} (prompt {row}, position {column}) is outside the "
                         f"model's vocabulary [0, {vocab_size})")
    return np.where(real, prompts, 0).astype(np.int32), lengths.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Timing:
    """A generate call's seconds (generate(..., timings=[])): compiling its program, then running it (prefill and
    every step, waited for); `began`: time.perf_counter() when it began running (where a stream's clock starts)."""

    compile_seconds: float
    generate_seconds: float
    began: float


def call_timed(jitted, graphdef, *args, timings: list | None, **static):
    """jitted(graphdef, *args, **static) (graphdef and `static`: its static arguments); with `timings` (a list) the
    program is compiled first, and a Timing of the compilation and of the run is appended to it."""
    if timings is None:
        return jitted(graphdef, *args, **static)
    start = time.perf_counter()
    compiled = jitted.lower(graphdef, *args, **static).compile()
    began = time.perf_counter()
    outputs = jax.block_until_ready(compiled(*args))  # (a compiled program takes the traced arguments only)
    timings.append(Timing(began - start, time.perf_counter() - began, began))
    return outputs


def _gather(array: jax.Array) -> np.ndarray:
    """A host copy, also of an array spread over other processes' devices."""
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def generate(model, tokens, max_new_tokens: int, *, lengths=None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, stop_tokens: Sequence[int] = (), pad_id: int | None = None, key=None,
             mesh: Mesh | None = None, on_tokens: Callable[[int, np.ndarray], bool | None] | None = None,
             allowed_vocab_size: int | None = None, blocked_ids: Sequence[int] = (), draft: str | None = None,
             acceptance: list | None = None, timings: list | None = None) -> np.ndarray:
    """`max_new_tokens` new tokens per prompt, int32 [B, max_new_tokens].

    tokens: an int array [B, P] (with `lengths` [B]: row b's prompt is tokens[b, :lengths[b]], the rest
    ignored) or a list of B 1-D sequences of any lengths. temperature 0 (the default) is greedy; otherwise
    `key` is needed, and top_k / top_p filter the tempered distribution (diffjax.generate.sampling). A row
    stops after it produces one of `stop_tokens`; its later positions hold `pad_id` (default: the first stop
    token). mesh: place the params by the sharding rules and split the prompts over the mesh's batch axes
    (data parallel generation); without one, the params stay where they are.
    on_tokens: streaming: called as on_tokens(step, tokens [B]) with each step's tokens as they come off the
    device (step 0 first; pad_id for stopped rows); returning False stops generation there (the rest of the
    result stays pad_id), and an exception it raises stops it and is raised here.
    allowed_vocab_size: only ids below it are generated (pass the tokenizer's vocab_size when the model's
    vocabulary is padded past it); None: any id of the model's vocabulary. blocked_ids: ids never generated either
    (the tokenizer's undecodable_ids()).
    draft "mtp": self-speculative decoding (diffjax.generate.speculative): the model's MTP depths draft, the model
    verifies; the same tokens as greedy decoding (greedy only; no on_tokens). acceptance: a list that gets the call's
    speculative.Acceptance appended (drafted, accepted, verify steps).
    timings: a list that gets the call's Timing appended: its program is then compiled before it runs (not within
    the call), so the compilation's seconds and the generation's are apart.
    Prompt + new tokens must fit the model's max_seq_len. While it runs, generation holds a per-layer copy of
    the blocks' params (TransformerLM.unstacked_blocks: what makes a decode step read each weight once).
    """
    config = model.config
    prompts_BP, lengths_B = _prompt_batch(tokens, lengths, config.vocab_size)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    max_len = prompts_BP.shape[1] + max_new_tokens
    if max_len > config.max_seq_len:
        raise ValueError(f"prompt ({prompts_BP.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {max_len} exceeds "
                         f"the model's max_seq_len {config.max_seq_len}")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be a function (step, tokens) -> bool | None, got {on_tokens!r}")
    if allowed_vocab_size is not None and allowed_vocab_size >= config.vocab_size:
        allowed_vocab_size = None  # every id: the same compiled program as without
    sampling = Sampling(temperature, top_k, top_p, allowed_vocab_size, tuple(sorted(int(i) for i in blocked_ids)))
    if key is None:
        if not sampling.greedy:
            raise ValueError(f"temperature {temperature} samples: pass key=jax.random.key(seed) (or temperature=0 for greedy)")
        key = jax.random.key(0)  # unused by greedy decoding
    stop_tokens = tuple(int(t) for t in stop_tokens)
    for token in stop_tokens + (() if pad_id is None else (pad_id,)):
        if not 0 <= token < config.vocab_size:
            raise ValueError(f"stop / pad token {token} is outside the model's vocabulary [0, {config.vocab_size})")
    choice = Choice(sampling, stop_tokens, stop_tokens[0] if pad_id is None and stop_tokens else int(pad_id or 0))
    _check_draft(draft, config, sampling, on_tokens)

    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    prompts, row_lengths = jnp.asarray(prompts_BP), jnp.asarray(lengths_B)
    if mesh is not None:
        params = jax.device_put(params, sharding.param_shardings(nnx.state(model, nnx.Param), mesh))
        prompts = jax.device_put(prompts_BP, NamedSharding(mesh, sharding.logical_spec(("batch", None), prompts_BP.shape, mesh)))
        row_lengths = jax.device_put(lengths_B, NamedSharding(mesh, sharding.logical_spec(("batch",), lengths_B.shape, mesh)))
    if draft is not None:
        from diffjax.generate import speculative

        tokens_BN, accepted = speculative.run(graphdef, params, prompts, row_lengths, max_len=max_len,
                                              max_new_tokens=max_new_tokens, choice=choice, mesh=mesh,
                                              depths=config.mtp_depths, timings=timings)
        if acceptance is not None:
            acceptance.append(accepted)
        return tokens_BN
    return run(graphdef, params, prompts, row_lengths, key, max_len=max_len, max_new_tokens=max_new_tokens, choice=choice,
               mesh=mesh, on_tokens=on_tokens, timings=timings)[0]


def _check_draft(draft, config, sampling: Sampling, on_tokens) -> None:
    """One-line refusals of a speculative call decoding cannot make."""
    if draft is None:
        return
    if draft != "mtp":
        raise ValueError(f"draft must be None or 'mtp' (the model's MTP depths draft), got {draft!r}")
    if not config.mtp_depths:
        raise ValueError("draft='mtp' needs a model with MTP depths (ModelConfig.mtp_depths is 0)")
    if not sampling.greedy:
        raise ValueError(f"draft='mtp' decodes greedily: temperature must be 0, got {sampling.temperature}")
    if on_tokens is not None:
        raise ValueError("draft='mtp' does not stream: pass no on_tokens")


def run(graphdef, params, prompts_BP, lengths_B, key, *, max_len: int, max_new_tokens: int, choice: Choice,
        mesh: Mesh | None, on_tokens=None, timings: list | None = None) -> tuple[np.ndarray, int]:
    """The compiled generation on checked, placed inputs (generate's work after its checks; the lm-eval adapter's
    entry): (the new tokens [B, max_new_tokens] on the host, the steps that ran: fewer than max_new_tokens when
    every row stopped or on_tokens stopped the loop)."""
    stream_id = next(_stream_ids)
    receiver = _receivers[stream_id] = _Receiver(on_tokens)
    try:
        tokens_BN, steps = call_timed(_generate, graphdef, params, prompts_BP, lengths_B, key, np.int32(stream_id),
                                      timings=timings, max_len=max_len, max_new_tokens=max_new_tokens, choice=choice,
                                      mesh=mesh, streaming=on_tokens is not None)
        tokens_BN, steps = _gather(tokens_BN), int(steps)
    finally:
        del _receivers[stream_id]
    if receiver.error is not None:
        raise receiver.error
    return tokens_BN, steps


def sample(model, prompt_ids, num_tokens: int, *, key, temperature: float = 0.8, **options) -> np.ndarray:
    """`num_tokens` ids sampled after one prompt (1-D; temperature 0: greedy); options as for `generate`."""
    prompt = np.asarray(prompt_ids).reshape(-1)
    if prompt.size == 0:
        raise ValueError("sample needs a prompt of at least one token")
    return generate(model, prompt[None], num_tokens, temperature=temperature, key=key, **options)[0]
