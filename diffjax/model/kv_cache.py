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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from diffjax.sharding import constrain


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v", "lengths_B"), meta_fields=("max_len",))
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v: one layer's buffers ([B, K, ..., d, S] and [B, K, ..., S, dv]: the module's [B, S, K, ...] with the slot
    axis moved, K_SLOT_AXIS / V_SLOT_AXIS), a stack's [L, ...] (scanned layers) or a tuple of L layers' (layers in a
    loop); None before the prefill, which allocates them. lengths_B: tokens stored per row before this call, i.e.
    the position of the row's next token. max_len: S, the slots per row."""

    k: jax.Array | None
    v: jax.Array | None
    lengths_B: jax.Array
    max_len: int

    @classmethod
    def empty(cls, batch: int, max_len: int) -> "KVCache":
        """The cache a prefill starts from: nothing stored, buffers allocated by the first call."""
        return cls(None, None, jnp.zeros((batch,), jnp.int32), max_len)

    def positions(self, num_new: int) -> jax.Array:
        """Positions [B, T] of the T tokens this call adds (for RoPE)."""
        return self.lengths_B[:, None] + jnp.arange(num_new, dtype=jnp.int32)

    def update(self, k_new, v_new, attend: dict, windowed=True):
        """Store this call's keys / values [B, T, K, ...]; returns (cache, k, v, attend): the keys, values ([B, S,
        K, ...] as the module shapes them) and op keywords (`causal`, `segment_ids`, `impl`, `window`) the module's
        attention op is to use.

        Prefill (buffers None): the T prompt tokens go to slots [0, T) and attend one another as without a
        cache (the caller's `attend`). Decode (T must be 1): the token goes to slot lengths_B[b] of row b and
        attends slots 0..lengths_B[b] of the whole buffer (segment ids mark the slots), by the impl
        diffjax.ops.choose picks for a decode call (xla today); under a sliding window W (attend["window"], where
        `windowed`, a bool or a traced one) only slots lengths_B[b] - W + 1 .. lengths_B[b].
        """
        B, T = k_new.shape[:2]
        if self.k is None:
            if T > self.max_len:
                raise ValueError(f"the prompt ({T} tokens) does not fit the cache ({self.max_len} slots per row)")
            def allocated(x_BTK, slot_axis):
                widths = [(0, 0)] * x_BTK.ndim
                widths[slot_axis] = (0, self.max_len - T)
                return jnp.pad(_to_buffer(x_BTK, slot_axis), widths)

            k, v = allocated(k_new, K_SLOT_AXIS), allocated(v_new, V_SLOT_AXIS)
            return self._stored(k, v), k_new, v_new, attend
        if T != 1:
            raise ValueError(f"a decode step takes one new token per row, got {T} (a prompt goes through the prefill)")
        # Each row writes its one slot (a scatter batched over rows: it partitions like the buffer and updates it in
        # place); a select over the whole buffer would rewrite every slot each step.
        def written(buffer, x_B1K, slot_axis):
            write = jax.vmap(lambda buf, x, slot: jax.lax.dynamic_update_slice_in_dim(buf, x, slot, axis=slot_axis))
            return write(buffer, _to_buffer(x_B1K, slot_axis), self.lengths_B)

        k, v = written(self.k, k_new, K_SLOT_AXIS), written(self.v, v_new, V_SLOT_AXIS)
        slots_BS = jnp.arange(self.max_len, dtype=jnp.int32)[None, :]
        visible_BS = slots_BS <= self.lengths_B[:, None]
        if attend.get("window") is not None:  # the window is a mask over slots, like the stored ones
            visible_BS = visible_BS & ((self.lengths_B[:, None] - slots_BS < attend["window"]) | jnp.logical_not(windowed))
        kv_ids_BS = visible_BS.astype(jnp.int32)  # 1: a slot the token sees, 0: not
        q_ids_B1 = jnp.ones((B, 1), jnp.int32)
        # impl "auto": diffjax.ops.choose picks the decode path (xla: no fused decode kernel yet), whatever the
        # model's impl for full sequences.
        attend = dict(attend, causal=False, segment_ids=(q_ids_B1, kv_ids_BS), impl="auto", window=None)
        cache = self._stored(k, v)
        return cache, _from_buffer(cache.k, K_SLOT_AXIS), _from_buffer(cache.v, V_SLOT_AXIS), attend

    def _stored(self, k, v) -> "KVCache":
        def axes(buffer, slot_axis):
            named = ["batch", "act_kv_heads"] + [None] * (buffer.ndim - 2)
            named[slot_axis] = "length"
            return tuple(named)

        return dataclasses.replace(self, k=constrain(k, axes(k, K_SLOT_AXIS)), v=constrain(v, axes(v, V_SLOT_AXIS)))

    def layer(self, k, v) -> "KVCache":
        """This cache with one layer's buffers (a slice of the stack, or None before the prefill)."""
        return dataclasses.replace(self, k=k, v=v)


# Where a buffer keeps its slot axis: the decode step's attention contracts each head's keys over their last axis
# with the slots as the free axis, and the values over the slots; in these orders it reads both buffers as stored (in
# the modules' [B, S, K, ...] order the dots would first copy every buffer each step, and run 2-7x slower on CPU).
K_SLOT_AXIS = -1  # keys [B, K, ..., d, S]
V_SLOT_AXIS = -2  # values [B, K, ..., S, dv]


def _to_buffer(x_BSK, slot_axis):
    return jnp.moveaxis(x_BSK, 1, slot_axis)


def _from_buffer(buffer, slot_axis):
    return jnp.moveaxis(buffer, slot_axis, 1)
