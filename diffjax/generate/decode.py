"""Generation with a KV cache: one jitted prefill over the prompts, then one jitted decode step per token.

The decode step's state (the cache, the tokens so far, which rows have stopped) is donated, so each step
updates the preallocated buffers in place; every step has the same shapes, so it compiles once per
(batch, prompt length + max_new_tokens). See diffjax.model.kv_cache for the cache's layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from diffjax import sharding
from diffjax.generate.sampling import Sampling, next_tokens
from diffjax.model.kv_cache import KVCache

STOP_CHECK_EVERY = 8  # decode steps between host reads of "every row has stopped" (each read waits for the device)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("cache", "tokens_BN", "done_B", "step"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: KVCache
    tokens_BN: jax.Array  # the new tokens; pad_id where not generated (yet, or after the row's stop token)
    done_B: jax.Array  # the row has produced a stop token
    step: jax.Array  # tokens generated so far (the next one goes to tokens_BN[:, step])


@dataclasses.dataclass(frozen=True)
class Choice:
    """How the next token is chosen (static: hashable, part of the compiled steps)."""

    sampling: Sampling
    stop_tokens: tuple[int, ...]
    pad_id: int


def _choose(logits_BV, key, step, done_B, choice: Choice):
    """The step's tokens (pad_id for rows already stopped) and the rows stopped after it."""
    token_B = next_tokens(logits_BV, jax.random.fold_in(key, step), choice.sampling)
    token_B = jnp.where(done_B, choice.pad_id, token_B)
    return token_B, done_B | jnp.isin(token_B, jnp.asarray(choice.stop_tokens, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "max_new_tokens", "choice", "mesh"))
def _prefill(graphdef, params, prompts_BP, lengths_B, key, *, max_len, max_new_tokens, choice, mesh):
    """Runs the right-padded prompts, stores their keys and values, picks each row's first new token."""
    B, model = prompts_BP.shape[0], nnx.merge(graphdef, params)
    with sharding.activation_sharding(mesh):
        x_BPD, cache = model.hidden_states(prompts_BP, cache=KVCache.empty(B, max_len))
        last_BV = model.logits(jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1))[:, 0]
    cache = dataclasses.replace(cache, lengths_B=lengths_B)  # the pad slots are overwritten as rows decode
    token_B, done_B = _choose(last_BV, key, 0, jnp.zeros((B,), bool), choice)
    tokens_BN = jnp.full((B, max_new_tokens), choice.pad_id, jnp.int32).at[:, 0].set(token_B)
    return DecodeState(cache, tokens_BN, done_B, jnp.int32(1))


@functools.partial(jax.jit, static_argnames=("graphdef", "choice", "mesh"), donate_argnames=("state",))
def _decode_step(graphdef, params, state: DecodeState, key, *, choice, mesh):
    """Feeds each row's last token through the cache and appends the next one."""
    last_B1 = jax.lax.dynamic_slice_in_dim(state.tokens_BN, state.step - 1, 1, axis=1)
    with sharding.activation_sharding(mesh):
        logits_B1V, cache = nnx.merge(graphdef, params)(last_B1, cache=state.cache)
    token_B, done_B = _choose(logits_B1V[:, 0], key, state.step, state.done_B, choice)
    tokens_BN = jax.lax.dynamic_update_slice_in_dim(state.tokens_BN, token_B[:, None], state.step, axis=1)
    return DecodeState(cache, tokens_BN, done_B, state.step + 1)


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


def _gather(array: jax.Array) -> np.ndarray:
    """A host copy, also of an array spread over other processes' devices."""
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def generate(model, tokens, max_new_tokens: int, *, lengths=None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, stop_tokens: Sequence[int] = (), pad_id: int | None = None, key=None,
             mesh: Mesh | None = None) -> np.ndarray:
    """`max_new_tokens` new tokens per prompt, int32 [B, max_new_tokens].

    tokens: an int array [B, P] (with `lengths` [B]: row b's prompt is tokens[b, :lengths[b]], the rest
    ignored) or a list of B 1-D sequences of any lengths. temperature 0 (the default) is greedy; otherwise
    `key` is needed, and top_k / top_p filter the tempered distribution (diffjax.generate.sampling). A row
    stops after it produces one of `stop_tokens`; its later positions hold `pad_id` (default: the first stop
    token). mesh: place the params by the sharding rules and split the prompts over the mesh's batch axes
    (data parallel generation); without one, the params stay where they are.
    Prompt + new tokens must fit the model's max_seq_len.
    """
    config = model.config
    prompts_BP, lengths_B = _prompt_batch(tokens, lengths, config.vocab_size)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    max_len = prompts_BP.shape[1] + max_new_tokens
    if max_len > config.max_seq_len:
        raise ValueError(f"prompt ({prompts_BP.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {max_len} exceeds "
                         f"the model's max_seq_len {config.max_seq_len}")
    sampling = Sampling(temperature, top_k, top_p)
    if key is None:
        if not sampling.greedy:
            raise ValueError(f"temperature {temperature} samples: pass key=jax.random.key(seed) (or temperature=0 for greedy)")
        key = jax.random.key(0)  # unused by greedy decoding
    stop_tokens = tuple(int(t) for t in stop_tokens)
    for token in stop_tokens + (() if pad_id is None else (pad_id,)):
        if not 0 <= token < config.vocab_size:
            raise ValueError(f"stop / pad token {token} is outside the model's vocabulary [0, {config.vocab_size})")
    choice = Choice(sampling, stop_tokens, stop_tokens[0] if pad_id is None and stop_tokens else int(pad_id or 0))

    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    prompts, row_lengths = jnp.asarray(prompts_BP), jnp.asarray(lengths_B)
    if mesh is not None:
        params = jax.device_put(params, sharding.param_shardings(nnx.state(model, nnx.Param), mesh))
        prompts = jax.device_put(prompts_BP, NamedSharding(mesh, sharding.logical_spec(("batch", None), prompts_BP.shape, mesh)))
        row_lengths = jax.device_put(lengths_B, NamedSharding(mesh, sharding.logical_spec(("batch",), lengths_B.shape, mesh)))
    state = _prefill(graphdef, params, prompts, row_lengths, key, max_len=max_len, max_new_tokens=max_new_tokens,
                     choice=choice, mesh=mesh)
    for step in range(1, max_new_tokens):
        if stop_tokens and step % STOP_CHECK_EVERY == 0 and bool(_gather(state.done_B).all()):
            break
        state = _decode_step(graphdef, params, state, key, choice=choice, mesh=mesh)
    return _gather(state.tokens_BN)


def sample(model, prompt_ids, num_tokens: int, *, key, temperature: float = 0.8, **options) -> np.ndarray:
    """`num_tokens` ids sampled after one prompt (1-D; temperature 0: greedy); options as for `generate`."""
    prompt = np.asarray(prompt_ids).reshape(-1)
    if prompt.size == 0:
        raise ValueError("sample needs a prompt of at least one token")
    return generate(model, prompt[None], num_tokens, temperature=temperature, key=key, **options)[0]
