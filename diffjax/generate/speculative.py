"""Self-speculative greedy decoding: the model's MTP depths (ModelConfig.mtp_depths = K) draft K tokens, the model
verifies them in one step of K + 1 tokens, and each row keeps the longest prefix the model agrees with plus the
model's own next token. The tokens are plain greedy decoding's (diffjax.generate.decode); a step emits 1 to K + 1
tokens per row for one read of the weights plus a layer and an LM head per depth (where a decode step is bound by
reading the weights, about one step; not on a CPU: benchmarks/results/speculative_cpu.md).

One jitted program per call shape, as plain decoding: the prefill, then a lax.while_loop of verify steps. A verify
step feeds each row's last token and its K drafts at positions n..n + K through the KV cache (kv_cache.py: a decode
step of up to 1 + draft tokens; windowed layers' rings keep W + K slots so that a rejected write evicts nothing still
in the window), then rolls each row's cache back to its accepted length n + a + 1 (slot = position: the rejected
slots are masked until overwritten). Rows advance by their own counts; stop tokens and max_new_tokens cut a row's
accepted tokens exactly where plain decoding would stop.

The drafter: depth k at position t reads depth k - 1's hidden state at t (depth 0: the model's) and token t + k,
and predicts token t + k + 1 (DeepSeek-V3's MTP, as trained: diffjax.losses.mtp_targets). Each depth keeps its own
KV cache over positions (its attention runs over earlier positions' inputs), filled by the prefill and extended by
every verify step over the same K + 1 positions, then rolled back with the model's. Token t + k of depth k's
latest k - 1 positions is not known yet when they run: they read the drafts there (only the drafts depend on it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import sharding
from diffjax.generate.decode import _gather, call_timed, compute_cast, decoding_model
from diffjax.generate.sampling import next_tokens
from diffjax.kinds import MTP_STACK
from diffjax.model.kv_cache import KVCache


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("cache", "mtp_caches", "drafts_BK", "last_B", "tokens_BN", "count_B", "done_B", "steps",
                                "drafted", "accepted"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class SpeculativeState:
    cache: KVCache  # the model's
    mtp_caches: tuple[KVCache, ...]  # one per MTP depth
    drafts_BK: jax.Array  # the next verify step's drafts
    last_B: jax.Array  # each row's latest token (not yet through the model)
    tokens_BN: jax.Array  # the new tokens; pad_id where not generated (yet, or after the row's stop token)
    count_B: jax.Array  # tokens generated per row
    done_B: jax.Array  # the row has produced a stop token or max_new_tokens
    steps: jax.Array  # verify steps run
    drafted: jax.Array  # drafts verified, over the rows still generating
    accepted: jax.Array  # of them, accepted


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """What a speculative generate call drafted and kept: acceptance rate = accepted / drafted."""

    drafted: int  # drafts verified (K per verify step and row still generating)
    accepted: int
    steps: int  # verify steps (the prefill's first token not counted)

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def mtp_params(model) -> tuple[nnx.State, ...]:
    """The MTP depths' params, one pytree per depth (copies, cast as decode.decoding_model casts the layers')."""
    cast = compute_cast(jnp.dtype(model.config.dtype))
    stacked = nnx.state(getattr(model, MTP_STACK))
    return tuple(jax.tree.map(lambda x: cast(x[k]), stacked) for k in range(model.config.mtp_depths))


def _greedy_BT(model, hidden_BTD, choice):
    """The model's greedy token after each position, int32 [B, T] (decode's choice: blocked ids never chosen)."""
    logits_BTV = model.logits(hidden_BTD)
    B, T, V = logits_BTV.shape
    return next_tokens(logits_BTV.reshape(B * T, V), None, choice.sampling).reshape(B, T)


def draft(model, depth_params, caches, hidden_BTD, next_BT, accepted_B, advance_B, choice):
    """(the depths' caches rolled forward by advance_B, the drafts [B, K]). The block's T positions start at the
    caches' lengths; next_BT[b, i] is the token after block position i, right for i <= accepted_B[b] (the rest is
    discarded); depth k at block position i reads token i + k: next_BT's while known, else the depths' drafts."""
    index_1T = jnp.arange(next_BT.shape[1])[None, :]
    a_B1 = accepted_B[:, None]
    drafts, rolled = [], []
    for k, (params, cache) in enumerate(zip(depth_params, caches), start=1):
        j_BT = index_1T + k - 1  # the block position whose next token depth k reads at i
        inputs_BT = jnp.take_along_axis(next_BT, jnp.minimum(j_BT, next_BT.shape[1] - 1), axis=1)
        if drafts:
            drafted_BT = jnp.take_along_axis(jnp.stack(drafts, 1), jnp.clip(j_BT - a_B1 - 1, 0, k - 2), axis=1)
            inputs_BT = jnp.where(j_BT <= a_B1, inputs_BT, drafted_BT)
        hidden_BTD, cache = model.mtp_depth_with_cache(k, hidden_BTD, inputs_BT, cache, params)
        rolled.append(cache.rolled_back(cache.lengths_B - next_BT.shape[1] + advance_B))
        at_a_B1D = jnp.take_along_axis(hidden_BTD, a_B1[:, :, None], axis=1)
        drafts.append(_greedy_BT(model, at_a_B1D, choice)[:, 0])
    return tuple(rolled), jnp.stack(drafts, axis=1)


def prefill(model, layer_params, depth_params, prompts_BP, lengths_B, *, max_len, max_new_tokens, choice):
    """Runs the prompts through the model and the MTP depths, picks each row's first token and its first drafts."""
    B, K = prompts_BP.shape[0], len(depth_params)
    empty = KVCache.empty(B, max_len, lengths_B, draft=K)
    hidden_BPD, cache, _ = model.hidden_states(prompts_BP, cache=empty, layer_params=layer_params)
    greedy_BP = _greedy_BT(model, hidden_BPD, choice)
    first_B = jnp.take_along_axis(greedy_BP, (lengths_B - 1)[:, None], axis=1)[:, 0]
    # the token after each prompt position: the prompt's next one, then the first new token
    next_BP = jnp.concatenate([prompts_BP[:, 1:], prompts_BP[:, :1]], axis=1)
    next_BP = jnp.where(jnp.arange(prompts_BP.shape[1])[None] == (lengths_B - 1)[:, None], first_B[:, None], next_BP)
    mtp_caches, drafts_BK = draft(model, depth_params, (empty,) * K, hidden_BPD, next_BP, lengths_B - 1, lengths_B,
                                  choice)
    tokens_BN = jnp.full((B, max_new_tokens), choice.pad_id, jnp.int32).at[:, 0].set(first_B)
    done_B = jnp.isin(first_B, jnp.asarray(choice.stop_tokens, jnp.int32)) | (max_new_tokens == 1)
    zero = jnp.int32(0)
    return SpeculativeState(cache.rolled_back(lengths_B), mtp_caches, drafts_BK, first_B, tokens_BN,
                            jnp.ones((B,), jnp.int32), done_B, zero, zero, zero)


def verify_step(model, layer_params, depth_params, state: SpeculativeState, *, choice) -> SpeculativeState:
    """Feeds each row's last token and drafts, keeps the agreeing prefix and the model's next token, drafts again."""
    B, K = state.drafts_BK.shape
    N = state.tokens_BN.shape[1]
    block_BT = jnp.concatenate([state.last_B[:, None], state.drafts_BK], axis=1)
    hidden_BTD, cache, _ = model.hidden_states(block_BT, cache=state.cache, layer_params=layer_params)
    next_BT = _greedy_BT(model, hidden_BTD, choice)  # the model's token after each of the block's
    accepted_B = jnp.sum(jnp.cumprod(state.drafts_BK == next_BT[:, :K], axis=1), axis=1)
    # Emitted: next_BT[:, :a + 1], up to a stop token, up to max_new_tokens; rows already done emit nothing.
    index_1T = jnp.arange(K + 1)[None]
    stop_BT = jnp.isin(next_BT, jnp.asarray(choice.stop_tokens, jnp.int32))
    after_stop_BT = (jnp.cumsum(stop_BT, axis=1) - stop_BT) > 0
    emit_BT = (index_1T <= accepted_B[:, None]) & ~after_stop_BT & ~state.done_B[:, None]
    column_BT = jnp.where(emit_BT, state.count_B[:, None] + index_1T, N)  # N: out of bounds, dropped
    tokens_BN = state.tokens_BN.at[jnp.arange(B)[:, None], column_BT].set(next_BT, mode="drop")
    count_B = state.count_B + jnp.sum(emit_BT & (column_BT < N), axis=1)
    done_B = state.done_B | jnp.any(emit_BT & stop_BT, axis=1) | (count_B >= N)
    advance_B = jnp.where(state.done_B, 0, accepted_B + 1)  # a finished row stays where it is
    mtp_caches, drafts_BK = draft(model, depth_params, state.mtp_caches, hidden_BTD, next_BT, accepted_B, advance_B,
                                  choice)
    live = jnp.sum(~state.done_B)
    return SpeculativeState(cache.rolled_back(state.cache.lengths_B + advance_B), mtp_caches, drafts_BK,
                            jnp.take_along_axis(next_BT, accepted_B[:, None], axis=1)[:, 0], tokens_BN, count_B,
                            done_B, state.steps + 1, state.drafted + K * live,
                            state.accepted + jnp.sum(jnp.where(state.done_B, 0, accepted_B)))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "max_new_tokens", "choice", "mesh"))
def _generate(graphdef, params, prompts_BP, lengths_B, *, max_len, max_new_tokens, choice, mesh):
    """(the new tokens [B, max_new_tokens], verify steps, drafted, accepted)."""
    with sharding.activation_sharding(mesh):
        model, layer_params = decoding_model(graphdef, params)
        depth_params = mtp_params(model)
        state = prefill(model, layer_params, depth_params, prompts_BP, lengths_B, max_len=max_len,
                        max_new_tokens=max_new_tokens, choice=choice)
        state = jax.lax.while_loop(lambda state: ~jnp.all(state.done_B),
                                   lambda state: verify_step(model, layer_params, depth_params, state, choice=choice),
                                   state)
    return state.tokens_BN, state.steps, state.drafted, state.accepted


def run(graphdef, params, prompts_BP, lengths_B, *, max_len: int, max_new_tokens: int, choice, mesh, depths: int,
        timings: list | None = None):
    """The compiled speculative generation on checked, placed inputs: (new tokens [B, max_new_tokens] on the host,
    Acceptance). The caches get `depths` slots past max_len: the drafts past a row's last position. timings: as
    decode.generate's."""
    tokens_BN, steps, drafted, accepted = call_timed(_generate, graphdef, params, prompts_BP, lengths_B,
                                                     timings=timings, max_len=max_len + depths,
                                                     max_new_tokens=max_new_tokens, choice=choice, mesh=mesh)
    return _gather(tokens_BN), Acceptance(int(drafted), int(accepted), int(steps))
