"""The key/value cache of generation: one preallocated buffer of S slots per row, slot = position.

Generation runs the model twice over: a prefill over the prompts (right-padded to a common length P,
positions 0..P-1, ordinary causal attention with any kernel) that stores every prompt token's keys and
values in slots [0, P), then one decode step per new token, whose query attends the cache through a
per-row length mask (the XLA path: one query against S keys). Row b's next token goes to slot
`lengths_B[b]` (its position): a right-padded prompt's pad slots get overwritten by its own generated
tokens before they are ever attended, so rows of different lengths share one static shape.

Every attention module goes through `attention.attend(op, q, k, v, ..., cache=cache)` after projecting and
rotating q, k and v; with a cache it calls `cache.update(k, v, op_kwargs)` and the op gets the keys, values
and keywords that returns, and the module returns `(output, cache)`. The cache takes k and v as the
module shapes them ([B, S, kv heads, ...], any trailing axes), so a new attention variant needs no change
here; it stores the keys with the slot axis last ([B, kv heads, ..., d, S]) and the values with it second to
last ([B, kv heads, ..., S, dv]), the orders in which the decode step's attention reads them without a copy.
TransformerLM holds the layers' buffers stacked ([L, ...], scanned with the stacked params) or, when its layers
run in a loop (generation always: TransformerLM.unstacked_blocks), as one buffer per layer.

Windowed layers in a loop keep a ring (TransformerLM passes each layer's static window to `layer`): W slots for a
window of W keys (when W < S), position p in slot p mod W. A decode step at position p writes slot p mod W, which
then holds p and every other slot s the position p - ((p - s) mod W), all inside the window; a slot is attended
once that position is >= 0 (written). The prefill stores each row's last W real tokens, position q in slot q mod W,
so it needs the rows' real lengths when they differ (`empty(..., prompt_lengths_B)`): the pad positions of a
shorter row would otherwise overwrite its real tokens' slots. A scanned stack keeps S slots on every layer (one
shape for the stack) and masks the window instead.

Speculative decoding (diffjax.generate.speculative) feeds up to 1 + `draft` tokens per row in one decode step, at
positions lengths_B .. lengths_B + draft, each query seeing the slots up to its own position (kv ids [B, T, S]), then
rolls a row back by setting its length (`rolled_back`): slot = position, so the rejected slots are masked until
overwritten; a ring keeps W + draft slots, so that those writes never evict a key still in any query's window.

What a module stores is its own choice: GDLA (attention/gdla.py) stores its compressed kv latent as the "values"
and its shared RoPE key as the "keys", one kv head each, and attends them itself.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from diffjax.sharding import constrain


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v", "lengths_B", "prompt_lengths_B"),
                   meta_fields=("max_len", "window", "draft"))
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v: one layer's buffers ([B, K, ..., d, S] and [B, K, ..., S, dv]: the module's [B, S, K, ...] with the slot
    axis moved, K_SLOT_AXIS / V_SLOT_AXIS), a stack's [L, ...] (scanned layers) or a tuple of L layers' (layers in a
    loop); None before the prefill, which allocates them. lengths_B: tokens stored per row before this call, i.e.
    the position of the row's next token. max_len: S, the positions per row. prompt_lengths_B: the prefill's real
    prompt lengths (None: every row's whole T), for the rings. window: one layer's static sliding window (`layer`;
    None: no ring), a ring of `slots` when it is shorter than max_len. draft: the tokens past the next one that a
    multi-token step may write and then roll back (speculative decoding): a ring keeps W + draft slots, so that a
    rejected write never evicts a key still inside the window."""

    k: jax.Array | None
    v: jax.Array | None
    lengths_B: jax.Array
    max_len: int
    prompt_lengths_B: jax.Array | None = None
    window: int | None = None
    draft: int = 0

    @classmethod
    def empty(cls, batch: int, max_len: int, prompt_lengths_B=None, draft: int = 0) -> "KVCache":
        """The cache a prefill starts from: nothing stored, buffers allocated by the first call. prompt_lengths_B
        [B]: the right-padded prompts' real lengths (needed by the windowed layers' rings when they differ). draft:
        as the class says (0: one token per decode step)."""
        lengths = None if prompt_lengths_B is None else jnp.asarray(prompt_lengths_B, jnp.int32)
        return cls(None, None, jnp.zeros((batch,), jnp.int32), max_len, lengths, draft=draft)

    @property
    def slots(self) -> int:
        """Slots per row of this layer's buffers: the window (+ draft) when it is a ring, else max_len."""
        return self.max_len if self.window is None else min(self.window + self.draft, self.max_len)

    def rolled_back(self, lengths_B) -> "KVCache":
        """This cache holding only each row's first lengths_B positions (speculative decoding's rollback): the slots
        past them are masked until a later step overwrites them."""
        return dataclasses.replace(self, lengths_B=jnp.asarray(lengths_B, jnp.int32))

    def positions(self, num_new: int) -> jax.Array:
        """Positions [B, T] of the T tokens this call adds (for RoPE)."""
        return self.lengths_B[:, None] + jnp.arange(num_new, dtype=jnp.int32)

    def update(self, k_new, v_new, attend: dict, windowed=True):
        """Store this call's keys / values [B, T, K, ...]; returns (cache, k, v, attend): the keys, values ([B, S,
        K, ...] as the module shapes them) and op keywords (`causal`, `segment_ids`, `impl`, `window`) the module's
        attention op is to use.

        Prefill (buffers None): the T prompt tokens go to slots [0, T) and attend one another as without a
        cache (the caller's `attend`). Decode (T = 1, or up to 1 + draft): token t goes to slot lengths_B[b] + t of
        row b and attends slots 0..lengths_B[b] + t of the whole buffer (segment ids mark the slots; several tokens
        get one row of kv ids each, run by the xla op), by the impl diffjax.ops.choose picks for a decode call (xla
        today); under a sliding window W (attend["window"], where `windowed`, a bool or a traced one) only the W
        latest of them. A ring (`window`) stores the prompt's last W (+ draft) real tokens and writes slot position
        mod its slots (module docstring).
        """
        B, T = k_new.shape[:2]
        if self.k is None:
            if T > self.max_len:
                raise ValueError(f"the prompt ({T} tokens) does not fit the cache ({self.max_len} slots per row)")
            def allocated(x_BTK, slot_axis):
                if self.slots < self.max_len:
                    return _to_buffer(self._ring_of(x_BTK), slot_axis)
                widths = [(0, 0)] * x_BTK.ndim
                widths[slot_axis] = (0, self.max_len - T)
                return jnp.pad(_to_buffer(x_BTK, slot_axis), widths)

            k, v = allocated(k_new, K_SLOT_AXIS), allocated(v_new, V_SLOT_AXIS)
            return self._stored(k, v), k_new, v_new, attend
        if T > 1 + self.draft:
            raise ValueError(f"a decode step takes 1 + draft = {1 + self.draft} new tokens per row at most, got {T} (a "
                             f"prompt goes through the prefill)")
        # Each row writes its slots one token at a time (a scatter batched over rows: it partitions like the buffer and
        # updates it in place; a ring's slots may wrap); a select over the whole buffer would rewrite every slot.
        def written(buffer, x_BTK, slot_axis):
            write = jax.vmap(lambda buf, x, slot: jax.lax.dynamic_update_slice_in_dim(buf, x, slot, axis=slot_axis))
            x_BTK = _to_buffer(x_BTK, slot_axis)
            for t in range(T):
                x_B1K = jax.lax.slice_in_dim(x_BTK, t, t + 1, axis=slot_axis % x_BTK.ndim)
                buffer = write(buffer, x_B1K, (self.lengths_B + t) % self.slots)
            return buffer

        k, v = written(self.k, k_new, K_SLOT_AXIS), written(self.v, v_new, V_SLOT_AXIS)
        visible_BTS = self._visible(T, attend.get("window"), windowed)
        q_ids_BT = jnp.ones((B, T), jnp.int32)
        # 1: a slot the token sees, 0: not. One token: kv ids [B, S]; several: one row of kv ids per token, [B, T, S]
        # (the XLA op's per-query mask). impl "auto": diffjax.ops.choose routes a call against the cache (q / kv
        # ids) as a decode step (xla: no fused decode kernel, and only the xla op takes per-query kv ids), whatever the
        # model's impl for full sequences.
        kv_ids = visible_BTS[:, 0] if T == 1 else visible_BTS
        attend = dict(attend, causal=False, segment_ids=(q_ids_BT, kv_ids.astype(jnp.int32)), impl="auto", window=None)
        cache = self._stored(k, v)
        return cache, _from_buffer(cache.k, K_SLOT_AXIS), _from_buffer(cache.v, V_SLOT_AXIS), attend

    def _visible(self, T: int, window, windowed):
        """[B, T, S] bool: the slots the step's token t (at position lengths_B + t) attends, once the step's T tokens
        are written. A ring's slot s holds the position h = last - ((last - s) mod slots), last the step's latest;
        a slot is seen when 0 <= h <= the token's position, and inside the window."""
        slots_11S = jnp.arange(self.slots, dtype=jnp.int32)[None, None, :]
        position_BT1 = self.positions(T)[:, :, None]
        if self.slots < self.max_len:  # a ring
            last_B11 = position_BT1[:, -1:]
            held_BTS = last_B11 - (last_B11 - slots_11S) % self.slots
            return (held_BTS >= 0) & (held_BTS <= position_BT1) & (position_BT1 - held_BTS < self.window)
        visible_BTS = slots_11S <= position_BT1
        if window is not None:  # the window is a mask over slots, like the stored ones
            visible_BTS = visible_BTS & ((position_BT1 - slots_11S < window) | jnp.logical_not(windowed))
        return visible_BTS

    def _stored(self, k, v) -> "KVCache":
        def axes(buffer, slot_axis):
            named = ["batch", "act_kv_heads"] + [None] * (buffer.ndim - 2)
            named[slot_axis] = "length"
            return tuple(named)

        return dataclasses.replace(self, k=constrain(k, axes(k, K_SLOT_AXIS)), v=constrain(v, axes(v, V_SLOT_AXIS)))

    def layer(self, k, v, window: int | None = None) -> "KVCache":
        """This cache with one layer's buffers (a slice of the stack, or None before the prefill); window: the layer's
        static sliding window, kept as a ring (None: S slots, any window masked)."""
        return dataclasses.replace(self, k=k, v=v, window=window)

    def _ring_of(self, x_BTK):
        """The ring a prefill stores, [B, W, ...]: slot s holds the row's latest real position q = s mod W (its
        prompt's last W tokens); slots with no such position (a prompt shorter than W) hold a token never attended."""
        T = x_BTK.shape[1]
        last_B1 = (jnp.full((x_BTK.shape[0],), T, jnp.int32) if self.prompt_lengths_B is None
                   else self.prompt_lengths_B)[:, None] - 1
        slots_1W = jnp.arange(self.slots, dtype=jnp.int32)[None, :]
        position_BW = jnp.clip(last_B1 - (last_B1 - slots_1W) % self.slots, 0, T - 1)
        index = position_BW.reshape(position_BW.shape + (1,) * (x_BTK.ndim - 2))
        return jnp.take_along_axis(x_BTK, index, axis=1)


# Where a buffer keeps its slot axis: the decode step's attention contracts each head's keys over their last axis
# with the slots as the free axis, and the values over the slots; in these orders it reads both buffers as stored (in
# the modules' [B, S, K, ...] order the dots would first copy every buffer each step, and run 2-7x slower on CPU).
K_SLOT_AXIS = -1  # keys [B, K, ..., d, S]
V_SLOT_AXIS = -2  # values [B, K, ..., S, dv]


def _to_buffer(x_BSK, slot_axis):
    return jnp.moveaxis(x_BSK, 1, slot_axis)


def _from_buffer(buffer, slot_axis):
    return jnp.moveaxis(buffer, slot_axis, 1)
