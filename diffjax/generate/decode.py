"""The decode loop: one jitted program runs the prefill over the prompts, then a `Step` (plain decoding, this module's
`Plain`; speculative decoding, diffjax.generate.speculative's `MTPDraft`) in a `lax.while_loop` on the device, which
stops when every row has produced a stop token or at max_new_tokens. diffjax.generate.generation checks a call and
picks its step.

Decode at small batch is bound by memory traffic: each step reads every weight and the cache so far. So the step
reads the blocks' params as per-layer copies made once before the loop (TransformerLM.unstacked_blocks; a
slice of the stacked params inside the step is a copy XLA makes before the matmul, tripling the weight
traffic), keeps one cache buffer per layer in the loop's carry and writes one slot per row into it. The
program compiles once per (step, batch, padded prompt length, max_new_tokens, sampling) and is cached by jax.jit.
Streaming (`on_tokens`) hands each step's tokens to the host from inside the loop (an io_callback), which can
also stop it. See diffjax.model.kv_cache for the cache's layout.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

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


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("cache", "tokens_BN", "done_B", "step", "go_on", "own"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: KVCache  # the model's
    tokens_BN: jax.Array  # the new tokens; pad_id where not generated (yet, or after the row's stop token)
    done_B: jax.Array  # the row has stopped: a stop token (or, for a step emitting several, max_new_tokens)
    step: jax.Array  # prefill and loop steps run (plain decoding: tokens generated, the next one at tokens_BN[:, step])
    go_on: jax.Array  # False once a streaming receiver asked to stop
    own: Any = None  # the step's own state (Step.start)


@dataclasses.dataclass(frozen=True)
class Choice:
    """How the next token is chosen (static: hashable, part of the compiled program)."""

    sampling: Sampling
    stop_tokens: tuple[int, ...]
    pad_id: int


class Step:
    """What the decode loop runs after the prefill, once per loop iteration. Subclasses are frozen dataclasses (static:
    part of the compiled program, one per distinct value)."""

    draft = 0  # tokens past the next one a step writes into the caches and may roll back (KVCache.draft)
    streams = True  # whether on_tokens can watch it (a step that emits one token per row a step)

    def weights(self, model):
        """The step's own weights, made once before the loop (None: it reads the model's blocks only)."""
        return None

    def start(self, model, weights, state: DecodeState, hidden_BPD, prompts_BP, lengths_B,
              choice: Choice) -> DecodeState:
        """The state the loop starts from, given the prefill's (each row's first token chosen, its cache filled) and the
        prompts' final hidden states."""
        return state

    def __call__(self, model, layer_params, weights, state: DecodeState, key, choice: Choice) -> DecodeState:
        raise NotImplementedError

    def summary(self, state: DecodeState):
        """What a call reports besides its tokens and steps (a pytree of scalars, brought to the host as ints)."""
        return None


@dataclasses.dataclass(frozen=True)
class Plain(Step):
    """One token per row a step: each row's last token through the cache, the next one chosen by `Choice`."""

    def __call__(self, model, layer_params, weights, state: DecodeState, key, choice: Choice) -> DecodeState:
        last_B1 = jax.lax.dynamic_slice_in_dim(state.tokens_BN, state.step - 1, 1, axis=1)
        logits_B1V, cache = model(last_B1, cache=state.cache, layer_params=layer_params)
        token_B, done_B = _choose(logits_B1V[:, 0], key, state.step, state.done_B, choice)
        tokens_BN = jax.lax.dynamic_update_slice_in_dim(state.tokens_BN, token_B[:, None], state.step, axis=1)
        return dataclasses.replace(state, cache=cache, tokens_BN=tokens_BN, done_B=done_B, step=state.step + 1)


PLAIN = Plain()


def compute_cast(dtype):
    """x -> x as the decode loop reads it: floating arrays of 2 or more axes in the compute dtype, vectors as they are."""
    def cast(x):
        return x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x

    return cast


def decoding_model(graphdef, params):
    """(The model, its blocks' params per layer) as the decode loop reads them: the per-layer copies and the embedding
    and head in the compute dtype, made once (the modules cast each matrix to it before its matmul: the same
    arithmetic), so that a step reads every weight without slicing or converting it. Vectors keep their dtype. The
    stacks stay as stored (a step's own stacks, the MTP depths', are its `Step.weights`)."""
    config = nnx.merge(graphdef, params).config
    cast = compute_cast(jnp.dtype(config.dtype))
    stacks = {segment.name for segment in param_stacks(config)}
    model = nnx.merge(graphdef, {name: tree if name in stacks else jax.tree.map(cast, tree) for name, tree in params.items()})
    return model, tuple(jax.tree.map(cast, layer) for layer in model.unstacked_blocks())


def _choose(logits_BV, key, step, done_B, choice: Choice):
    """The step's tokens (pad_id for rows already stopped) and the rows stopped after it."""
    token_B = next_tokens(logits_BV, jax.random.fold_in(key, step), choice.sampling)
    token_B = jnp.where(done_B, choice.pad_id, token_B)
    return token_B, done_B | jnp.isin(token_B, jnp.asarray(choice.stop_tokens, jnp.int32))


def prefill(model, layer_params, prompts_BP, lengths_B, key, *, max_len, max_new_tokens, choice, draft=0):
    """Runs the right-padded prompts, stores their keys and values, picks each row's first new token from its last
    prompt position's logits: (the state, the prompts' final hidden states [B, P, D]). draft: as Step.draft."""
    B = prompts_BP.shape[0]
    x_BPD, cache, _ = model.hidden_states(prompts_BP, cache=KVCache.empty(B, max_len, lengths_B, draft=draft),
                                          layer_params=layer_params)
    last_BV = model.logits(jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1))[:, 0]
    cache = cache.rolled_back(lengths_B)  # the pad slots are overwritten as rows decode
    token_B, done_B = _choose(last_BV, key, 0, jnp.zeros((B,), bool), choice)
    tokens_BN = jnp.full((B, max_new_tokens), choice.pad_id, jnp.int32).at[:, 0].set(token_B)
    return DecodeState(cache, tokens_BN, done_B, jnp.int32(1), jnp.bool_(True)), x_BPD


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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "max_new_tokens", "choice", "mesh", "streaming",
                                             "step"))
def _generate(graphdef, params, prompts_BP, lengths_B, key, stream_id, *, max_len, max_new_tokens, choice, mesh,
              streaming, step: Step):
    """(The new tokens [B, max_new_tokens], the steps run, the step's summary): prefill, then `step` in a while loop."""
    with sharding.activation_sharding(mesh):
        model, layer_params = decoding_model(graphdef, params)
        weights = step.weights(model)
        state, hidden_BPD = prefill(model, layer_params, prompts_BP, lengths_B, key, max_len=max_len + step.draft,
                                    max_new_tokens=max_new_tokens, choice=choice, draft=step.draft)
        state = step.start(model, weights, state, hidden_BPD, prompts_BP, lengths_B, choice)
        maybe_streamed = functools.partial(_streamed, stream_id=stream_id, mesh=mesh) if streaming else lambda state: state

        def body(state):
            return maybe_streamed(step(model, layer_params, weights, state, key, choice))

        def going_on(state):
            return (state.step < max_new_tokens) & ~jnp.all(state.done_B) & state.go_on

        state = jax.lax.while_loop(going_on, body, maybe_streamed(state))
    return state.tokens_BN, state.step, step.summary(state)


def to_host(array: jax.Array) -> np.ndarray:
    """A host copy, also of an array spread over other processes' devices."""
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


@dataclasses.dataclass(frozen=True)
class Timing:
    """A generate call's seconds (generate(..., timings=[])): compiling its program, then running it (prefill and
    every step, waited for); `began`: time.perf_counter() when it began running (where a stream's clock starts)."""

    compile_seconds: float
    generate_seconds: float
    began: float


def _compiled_and_timed(args: tuple, static: dict, timings: list):
    """_generate(*args, **static), compiled before it runs: its Timing is appended to `timings`."""
    start = time.perf_counter()
    compiled = _generate.lower(*args, **static).compile()
    began = time.perf_counter()
    outputs = jax.block_until_ready(compiled(*args[1:]))  # (a compiled program takes the traced arguments: no graphdef)
    timings.append(Timing(began - start, time.perf_counter() - began, began))
    return outputs


class Decoded(NamedTuple):
    """What `run` returns."""

    tokens_BN: np.ndarray  # the new tokens [B, max_new_tokens] on the host
    steps: int  # prefill and loop steps run: fewer than max_new_tokens when every row stopped or on_tokens stopped it
    summary: Any  # the step's summary (Step.summary), its scalars as ints


def run(graphdef, params, prompts_BP, lengths_B, key, *, max_len: int, max_new_tokens: int, choice: Choice,
        mesh: Mesh | None, on_tokens=None, step: Step = PLAIN, timings: list | None = None) -> Decoded:
    """The compiled generation on checked, placed inputs (diffjax.generate's work after its checks; the lm-eval
    adapter's entry). max_len: prompt + new tokens (the caches get step.draft slots more). timings: a list that gets
    the call's Timing appended (its program compiled before it runs, so the compilation is timed apart)."""
    if on_tokens is not None and not step.streams:
        raise ValueError(f"{type(step).__name__} does not stream: pass no on_tokens")
    stream_id = next(_stream_ids)
    receiver = _receivers[stream_id] = _Receiver(on_tokens)
    try:
        args = (graphdef, params, prompts_BP, lengths_B, key, np.int32(stream_id))
        static = dict(max_len=max_len, max_new_tokens=max_new_tokens, choice=choice, mesh=mesh,
                      streaming=on_tokens is not None, step=step)
        tokens_BN, steps, summary = _generate(*args, **static) if timings is None else \
            _compiled_and_timed(args, static, timings)
        decoded = Decoded(to_host(tokens_BN), int(steps), jax.tree.map(int, summary))
    finally:
        del _receivers[stream_id]
    if receiver.error is not None:
        raise receiver.error
    return decoded
