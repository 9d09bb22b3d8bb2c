"""The Pallas TPU kernels lowered for a real TPU, on a machine without one.

Inside `use_abstract_mesh` with an abstract TPU device, `.lower(lowering_platforms=("tpu",))` with
`interpret=False` runs Pallas' Mosaic TPU lowering: block-shape tiling rules, the kernel bodies'
ops and layouts, and serialises each kernel as a `tpu_custom_call`. Interpret mode (the other kernel
tests) checks the numbers; this checks that the compiled path can be built at all, forward and
backward, at the paper's head dims (d = 64, 96, 128 with dv = 2d) and for several TPU generations.
What only a TPU can show: Mosaic's own compilation to the chip, VMEM limits at run time, speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from diffjax.jax_compat import lowering_target
from diffjax.ops.pallas_tpu import diff_attention_pallas, dot_product_attention_pallas

B, T, H, K = 1, 1000, 4, 2  # T not a multiple of the 128 blocks: the padded path; GQA (2 q heads per kv head)


def _lower_for_tpu(loss, args, device_kind="TPU v5p"):
    """The StableHLO text of grad(loss) lowered for `device_kind` (raises what Mosaic's front end raises)."""
    argnums = tuple(range(len(args) - 1))  # every input but the segment ids
    with lowering_target(device_kind, platform="tpu") as target:
        lowered = jax.jit(jax.grad(loss, argnums=argnums)).trace(*args).lower(lowering_platforms=(target,))
    return lowered.as_text()


def _diff_args(d, per_token_lambda, pair_segments):
    spec = jax.ShapeDtypeStruct
    lam = spec((B, T, H), jnp.bfloat16) if per_token_lambda else spec((), jnp.bfloat16)
    ids = (spec((B, T), jnp.int32), spec((B, T), jnp.int32)) if pair_segments else spec((B, T), jnp.int32)
    return (spec((B, T, H, 2, d), jnp.bfloat16), spec((B, T, K, 2, d), jnp.bfloat16),
            spec((B, T, K, 2 * d), jnp.bfloat16), lam, ids)


def _diff_loss(causal, block_sizes=None, window=None):
    def loss(q, k, v, lam, segment_ids):
        o = diff_attention_pallas(q, k, v, lam, causal=causal, segment_ids=segment_ids, block_sizes=block_sizes,
                                  interpret=False, window=window)
        return o.astype(jnp.float32).sum()

    return loss


def _kernel_count(hlo_text):
    return hlo_text.count("tpu_custom_call")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_diff_kernels_lower_for_tpu_at_paper_head_dims(d, causal):
    hlo = _lower_for_tpu(_diff_loss(causal), _diff_args(d, per_token_lambda=False, pair_segments=False))
    assert _kernel_count(hlo) == 3, "forward, dq and dk/dv kernels"


@pytest.mark.parametrize("device_kind", ["TPU v5e", "TPU v6e", "TPU v5p"])
def test_diff_kernels_lower_for_tpu_generations(device_kind):
    """v5e, v6e and v5p, with per-token lambda (V2) and q/kv segment pairs."""
    args = _diff_args(128, per_token_lambda=True, pair_segments=True)
    assert _kernel_count(_lower_for_tpu(_diff_loss(True), args, device_kind)) == 3


def test_sliding_window_kernels_lower_for_tpu():
    """A window of 300 keys (its block skipping and clamped index maps are traced scalar code in the grid)."""
    args = _diff_args(128, per_token_lambda=True, pair_segments=False)
    assert _kernel_count(_lower_for_tpu(_diff_loss(True, window=300), args)) == 3


def test_kernels_with_a_traced_query_offset_lower_for_tpu():
    """The context axis's call: a query chunk placed in the sequence by a traced offset (the scalar-prefetch
    operand that the causal mask, the skipping and the index maps read), against all the keys."""
    spec = jax.ShapeDtypeStruct
    q, k, v, lam, _ = _diff_args(128, per_token_lambda=False, pair_segments=False)
    chunk = spec((B, 256) + q.shape[2:], q.dtype)

    def loss(q, k, v, lam, offset):
        o = diff_attention_pallas(q, k, v, lam, causal=True, q_offset=offset, window=300, interpret=False)
        return o.astype(jnp.float32).sum()

    assert _kernel_count(_lower_for_tpu(loss, (chunk, k, v, lam, spec((), jnp.int32)))) == 3


@pytest.mark.parametrize("device_kind", ["TPU v5e", "TPU v6e", "TPU v5p"])
def test_single_map_kernels_lower_for_tpu(device_kind):
    """The baseline twin's flash path (M = 1) at its head dim 128, causal, packed segments."""
    spec = jax.ShapeDtypeStruct
    args = (spec((B, T, 2 * H, 128), jnp.bfloat16), spec((B, T, K, 128), jnp.bfloat16),
            spec((B, T, K, 128), jnp.bfloat16), spec((B, T), jnp.int32))

    def loss(q, k, v, segment_ids):
        return dot_product_attention_pallas(q, k, v, causal=True, segment_ids=segment_ids, interpret=False).astype(jnp.float32).sum()

    assert _kernel_count(_lower_for_tpu(loss, args, device_kind)) == 3


def test_tpu_lowering_rejects_blocks_mosaic_cannot_tile():
    """The check above is real: blocks of 16 keys break the TPU's (8, 128) tiling and must fail to lower."""
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _lower_for_tpu(_diff_loss(True, block_sizes=(16, 16)), _diff_args(64, per_token_lambda=False, pair_segments=False))
