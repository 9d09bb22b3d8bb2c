"""Self-speculative greedy decoding: the model's MTP depths (ModelConfig.mtp_depths = K) draft K tokens, the model
verifies them in one step of K + 1 tokens, and each row keeps the longest prefix the model agrees with plus the
model's own next token. The tokens are plain greedy decoding's (diffjax.generate.decode); a step emits 1 to K + 1
tokens per row for one read of the weights plus a layer and an LM head per depth (where a decode step is bound by
reading the weights, about one step; not on a CPU: benchmarks/results/speculative_cpu.md).

`MTPDraft` is a step of the decode loop (diffjax.generate.decode): the loop's prefill, then a verify step per loop
iteration, in one jitted program per call shape as plain decoding. A verify step feeds each row's last token and its
K drafts at positions n..n + K through the KV cache (kv_cache.py: a decode step of up to 1 + draft tokens; windowed
layers' rings keep W + K slots so that a rejected write evicts nothing still in the window), then rolls each row's
cache back to its accepted length n + a + 1 (slot = position: the rejected slots are masked until overwritten). Rows
advance by their own counts; stop tokens and max_new_tokens cut a row's accepted tokens exactly where plain decoding
would stop.

The drafter: depth k at position t reads depth k - 1's hidden state at t (depth 0: the model's) and token t + k,
and predicts token t + k + 1 (DeepSeek-V3's MTP, as trained: diffjax.model.mtp). Each depth keeps its own
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

from diffjax.generate.decode import Choice, DecodeState, Step, compute_cast
from diffjax.generate.sampling import next_tokens
from diffjax.kinds import MTP_STACK
from diffjax.model import mtp
from diffjax.model.kv_cache import KVCache


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("mtp_caches", "drafts_BK", "last_B", "count_B", "drafted", "accepted"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Drafting:
    """MTPDraft's own part of the loop's state (DecodeState.own)."""

    mtp_caches: tuple[KVCache, ...]  # one per MTP depth
    drafts_BK: jax.Array  # the next verify step's drafts
    last_B: jax.Array  # each row's latest token (not yet through the model)
    count_B: jax.Array  # tokens generated per row
    drafted: jax.Array  # drafts verified, over the rows still generating
    accepted: jax.Array  # of them, accepted


@functools.partial(jax.tree_util.register_dataclass, data_fields=("drafted", "accepted", "steps"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Acceptance:
    """What a speculative generate call drafted and kept: acceptance rate = accepted / drafted."""

    drafted: int  # drafts verified (K per verify step and row still generating)
    accepted: int
    steps: int  # verify steps (the prefill's first token not counted)

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclasses.dataclass(frozen=True)
class MTPDraft(Step):
    """The decode loop's speculative step: the model's `depths` MTP depths draft, the model verifies (greedy)."""

    depths: int
    streams = False  # (a step emits 1 to K + 1 tokens per row)

    @property
    def draft(self) -> int:
        return self.depths

    def weights(self, model):
        return mtp_params(model)

    def start(self, model, weights, state: DecodeState, hidden_BPD, prompts_BP, lengths_B, choice: Choice):
        """The depths run over the prompts (each position reads the next prompt token; the last, the first new token)
        and draft the first verify step's tokens."""
        B, K = prompts_BP.shape[0], self.depths
        first_B = state.tokens_BN[:, 0]
        next_BP = jnp.concatenate([prompts_BP[:, 1:], prompts_BP[:, :1]], axis=1)
        next_BP = jnp.where(jnp.arange(prompts_BP.shape[1])[None] == (lengths_B - 1)[:, None], first_B[:, None], next_BP)
        empty = KVCache.empty(B, state.cache.max_len, lengths_B, draft=K)
        mtp_caches, drafts_BK = run_depths(model, weights, (empty,) * K, hidden_BPD, next_BP, lengths_B - 1, lengths_B,
                                           choice)
        zero = jnp.int32(0)
        return dataclasses.replace(state, own=Drafting(mtp_caches, drafts_BK, first_B, jnp.ones((B,), jnp.int32), zero,
                                                       zero))

    def __call__(self, model, layer_params, weights, state: DecodeState, key, choice: Choice) -> DecodeState:
        """Feeds each row's last token and drafts, keeps the agreeing prefix and the model's next token, drafts again."""
        own: Drafting = state.own
        B, K = own.drafts_BK.shape
        N = state.tokens_BN.shape[1]
        block_BT = jnp.concatenate([own.last_B[:, None], own.drafts_BK], axis=1)
        hidden_BTD, cache, _ = model.hidden_states(block_BT, cache=state.cache, layer_params=layer_params)
        next_BT = _greedy_BT(model, hidden_BTD, choice)  # the model's token after each of the block's
        accepted_B = jnp.sum(jnp.cumprod(own.drafts_BK == next_BT[:, :K], axis=1), axis=1)
        # Emitted: next_BT[:, :a + 1], up to a stop token, up to max_new_tokens; rows already done emit nothing.
        index_1T = jnp.arange(K + 1)[None]
        stop_BT = jnp.isin(next_BT, jnp.asarray(choice.stop_tokens, jnp.int32))
        after_stop_BT = (jnp.cumsum(stop_BT, axis=1) - stop_BT) > 0
        emit_BT = (index_1T <= accepted_B[:, None]) & ~after_stop_BT & ~state.done_B[:, None]
        column_BT = jnp.where(emit_BT, own.count_B[:, None] + index_1T, N)  # N: out of bounds, dropped
        tokens_BN = state.tokens_BN.at[jnp.arange(B)[:, None], column_BT].set(next_BT, mode="drop")
        count_B = own.count_B + jnp.sum(emit_BT & (column_BT < N), axis=1)
        done_B = state.done_B | jnp.any(emit_BT & stop_BT, axis=1) | (count_B >= N)
        advance_B = jnp.where(state.done_B, 0, accepted_B + 1)  # a finished row stays where it is
        mtp_caches, drafts_BK = run_depths(model, weights, own.mtp_caches, hidden_BTD, next_BT, accepted_B, advance_B,
                                           choice)
        live = jnp.sum(~state.done_B)
        own = Drafting(mtp_caches, drafts_BK, jnp.take_along_axis(next_BT, accepted_B[:, None], axis=1)[:, 0], count_B,
                       own.drafted + K * live, own.accepted + jnp.sum(jnp.where(state.done_B, 0, accepted_B)))
        return dataclasses.replace(state, cache=cache.rolled_back(state.cache.lengths_B + advance_B), tokens_BN=tokens_BN,
                                   done_B=done_B, step=state.step + 1, own=own)

    def summary(self, state: DecodeState) -> Acceptance:
        return Acceptance(state.own.drafted, state.own.accepted, state.step - 1)


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


def run_depths(model, depth_params, caches, hidden_BTD, next_BT, accepted_B, advance_B, choice):
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
        hidden_BTD, cache = mtp.depth_with_cache(model, k, hidden_BTD, inputs_BT, cache, params)
        rolled.append(cache.rolled_back(cache.lengths_B - next_BT.shape[1] + advance_B))
        at_a_B1D = jnp.take_along_axis(hidden_BTD, a_B1[:, :, None], axis=1)
        drafts.append(_greedy_BT(model, at_a_B1D, choice)[:, 0])
    return tuple(rolled), jnp.stack(drafts, axis=1)
