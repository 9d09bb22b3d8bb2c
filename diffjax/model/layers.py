"""Small building blocks: parameters with logical axes, RMSNorm, the MLP activations, token embedding."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.sharding import constrain


FLAT_DRAW_MIN, FLAT_DRAW_MAX = 2**14, 2**20  # elements (normal_param)


def normal_param(rngs: nnx.Rngs, shape, std: float, dtype, axes) -> nnx.Param:
    """A normally initialized parameter tagged with logical axis names (used by the sharding rules).

    Up to FLAT_DRAW_MAX elements it is the head of a flat draw of a power-of-two length, reshaped: the same values
    as drawing `shape` directly (JAX's partitionable threefry numbers elements in row-major order, so a flat
    draw's prefix is the shaped draw; tests/test_model.py checks it), but XLA compiles a rank-1 draw 3-5x faster
    than a rank-3 / -4 one, and the power-of-two lengths let parameters of different sizes share one compiled draw:
    a new tiny model is built in 1.8-2.0 s on CPU, was 6.2-6.4 s. Larger parameters keep their shape, so that a sharded
    init generates each device's shard only (a flat draw cannot be split along an inner axis)."""
    size, shape, dtype = math.prod(shape), tuple(shape), jnp.dtype(dtype)
    if size > FLAT_DRAW_MAX:
        value = (std * jax.random.normal(rngs.params(), shape, dtype=jnp.float32)).astype(dtype)
    else:
        flat = jax.random.normal(rngs.params(), (max(FLAT_DRAW_MIN, 1 << (size - 1).bit_length()),), dtype=jnp.float32)
        if isinstance(flat, jax.core.Tracer):  # under vmap / jit
            value = _scaled_head(flat, std, shape=shape, dtype=dtype)
        else:  # the same float32 multiply and rounding on the host: no compile per shape
            value = jnp.asarray((np.float32(std) * np.asarray(flat)[:size].reshape(shape)).astype(dtype))
    return nnx.Param(value, logical_axes=axes)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _scaled_head(flat, std, *, shape, dtype):
    """std * flat[:prod(shape)] in `shape` and `dtype`: one compiled op per shape, not four."""
    return (std * flat[: math.prod(shape)].reshape(shape)).astype(dtype)


def ones_param(shape, dtype, axes) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype=dtype), logical_axes=axes)


def prepend_axis(module: nnx.Module, name: str) -> None:
    """Name the leading axis that nnx.vmap added to every parameter of `module` (in `logical_axes`)."""
    for _, param in nnx.iter_graph(module):
        if isinstance(param, nnx.Param):
            param.set_metadata(logical_axes=(name,) + tuple(param.get_metadata()["logical_axes"]))


def rms_normalize(x, eps: float):
    """x / rms(x) over the last axis with float32 statistics, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learnable scale; the cast to the input dtype comes before the scale (as in Llama and unilm)."""

    def __init__(self, dim: int, eps: float, param_dtype, axes=("embed",)):
        self.eps = eps
        self.scale = ones_param((dim,), param_dtype, axes)

    def __call__(self, x):
        return rms_normalize(x, self.eps) * self.scale[...].astype(x.dtype)


ACTIVATIONS = {  # ModelConfig.activation -> function ("polynorm" has parameters: polynorm())
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


POLYNORM_EPS = 1e-6  # Motif's (vLLM's PolyNorm default, which Motif's MLP keeps)


def polynorm(x, weight_3, bias_1):
    """PolyNorm (Zhuo et al., arXiv:2411.03884; Motif's MLP activation):
    w0 N(x^3) + w1 N(x^2) + w2 N(x) + b, N(z) = z / sqrt(mean(z^2) + 1e-6) over the last axis, in float32 (with
    the weights and bias) and returned in x's dtype, as vLLM's PolyNorm.forward_native computes it."""
    x32 = x.astype(jnp.float32)
    x2 = x32 * x32
    x3 = x2 * x32
    w, b = weight_3.astype(jnp.float32), bias_1.astype(jnp.float32)

    def norm(z, mean_square):
        return z / jnp.sqrt(mean_square + POLYNORM_EPS)

    mean = functools.partial(jnp.mean, axis=-1, keepdims=True)
    out = w[0] * norm(x3, mean(x3 * x3)) + w[1] * norm(x2, mean(x2 * x2)) + w[2] * norm(x32, mean(x2)) + b
    return out.astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, std: float, param_dtype, *, rngs: nnx.Rngs):
        self.vocab_size = vocab_size
        self.embedding = normal_param(rngs, (vocab_size, dim), std, param_dtype, ("vocab", "embed"))

    def __call__(self, tokens_BT, dtype):
        tokens_BT = jnp.asarray(tokens_BT)
        if not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
            raise TypeError(f"tokens must be an integer array, got dtype {tokens_BT.dtype}")
        try:
            ids = np.asarray(tokens_BT)
        except jax.errors.TracerArrayConversionError:
            # Under jit the ids are not known: out-of-range ids then read NaN rows (below) instead of
            # a silently clamped row, so the error still surfaces in the loss.
            ids = None
        if ids is not None and ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return embedding_lookup(self.embedding[...], tokens_BT, jnp.dtype(dtype))

    def attend(self, x_BTD):
        """Logits against the embedding matrix (tied LM head), float32."""
        logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, self.embedding[...].astype(x_BTD.dtype), preferred_element_type=jnp.float32)
        return constrain(logits_BTV, ("batch", "length", "act_vocab"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def embedding_lookup(table_VD, ids_BT, dtype):
    """table_VD's rows ids_BT in `dtype` ([B, T, D]; NaN rows for ids outside the table, so that an out-of-range id
    surfaces in the loss). The table is cast to `dtype` first, then its fsdp shards gathered (as FSDP does for every
    weight: the lookup's output then follows the tokens' batch sharding instead of the table's embed sharding).

    The gradient is the float32 sum of each id's row cotangents, in the table's dtype: a scatter-add into a float32
    table. Differentiating the cast-then-take directly scatters in `dtype`: with bfloat16 that sums thousands of
    cotangents of a frequent token in bfloat16, and XLA:GPU emits one system-scope bfloat16 atomic per element,
    where the float32 scatter takes one vectorised float32 atomic per 4 elements (the H100 capture of 2026-11-27:
    16.1 ms per step at 100,288 x 2048; benchmarks/results/step_tail_h100.md)."""
    table_VD = constrain(table_VD.astype(dtype), ("vocab", None))
    return jnp.take(table_VD, ids_BT, axis=0, mode="fill", fill_value=jnp.nan)


def _embedding_lookup_fwd(table_VD, ids_BT, dtype):
    return embedding_lookup(table_VD, ids_BT, dtype), (table_VD, ids_BT)


def _embedding_lookup_bwd(dtype, residuals, rows_BTD):
    table_VD, ids_BT = residuals
    # the transpose of a float32 take: a float32 scatter-add that drops the ids the forward filled
    take = lambda t_VD: jnp.take(t_VD, ids_BT, axis=0, mode="fill", fill_value=0)  # noqa: E731
    (grad_VD,) = jax.linear_transpose(take, jax.ShapeDtypeStruct(table_VD.shape, jnp.float32))(
        rows_BTD.astype(jnp.float32))
    return constrain(grad_VD, ("vocab", None)).astype(table_VD.dtype), None


embedding_lookup.defvjp(_embedding_lookup_fwd, _embedding_lookup_bwd)
