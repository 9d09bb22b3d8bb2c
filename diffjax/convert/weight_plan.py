"""A checkpoint format's weight plan, and reading and writing by it: one `Row` per checkpoint tensor, saying which
diffjax leaves it becomes and how (transposes, reshapes, channel permutations, splits). Every format's import,
streaming import and export run the same code over its rows (numpy only: no jax until a plan's shapes are traced).

A row maps a checkpoint tensor to one or more diffjax leaves (Motif 3's experts.gate_up_proj is the gate and up
kernels; DiffLlama's o_proj is o and the per-head norm's scale, which DiffLlama folds into o_proj), each a layer's slice
of a stacked leaf ("blocks", or "blocks_from_<start>" after a segment boundary: diffjax.kinds.layer_segments) or a
whole leaf (embedding, final norm, lm_head). Peak host memory of a read: the converted params (or, streamed into a
checkpoint, nothing of them) plus one source tensor and its converted copy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

import numpy as np

from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError, name_and_shape_problems, to_numpy
from diffjax.kinds import layer_segments, param_stacks

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that are recomputed from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Row:
    """A checkpoint tensor: `key` of `shape` <-> diffjax leaves [(stacked path, layer index in it or None)]."""

    key: str
    shape: tuple[int, ...]
    leaves: tuple[tuple[tuple, int | None], ...]
    to_ours: Callable  # checkpoint array -> tuple of arrays, one per leaf (numpy or jax: shapes can be traced)
    to_hf: Callable  # arrays, one per leaf -> checkpoint array


# ------------------------------------------------------------------------------ transforms (to_ours, to_hf)


def _same(w):
    return (w,)


def _identity(w):
    return w


def _transposed(w):
    return (w.T,)


def _untransposed(w):
    return w.T


COPY = (_same, _identity)  # a tensor as it is (norm scales, vectors)
TRANSPOSED = (_transposed, _untransposed)  # a torch Linear's [out, in] weight as a diffjax (in, out) kernel


def linear(out_dims: tuple, perm=None) -> tuple[Callable, Callable]:
    """A torch Linear weight [prod(out_dims), in] <-> diffjax (in, *out_dims); perm: reorder the last out dim."""
    inverse = None if perm is None else np.argsort(perm)

    def to_ours(w):
        w = w.reshape(*out_dims, w.shape[-1])
        w = w.transpose((w.ndim - 1,) + tuple(range(w.ndim - 1)))
        return (w if perm is None else w[..., perm],)

    def to_hf(w):
        w = w if inverse is None else w[..., inverse]
        return w.transpose(tuple(range(1, w.ndim)) + (0,)).reshape(-1, w.shape[0])

    return to_ours, to_hf


def out_projection(D: int, heads: int, width: int) -> tuple[Callable, Callable]:
    """A torch output projection [D, heads width] <-> o_kernel (heads, width, D)."""
    return (lambda w: (w.reshape(D, heads, width).transpose(1, 2, 0),),
            lambda w: w.transpose(2, 0, 1).reshape(D, heads * width))


def interleaved_from_rotate_half(d: int) -> np.ndarray:
    """Index map: channel c of the interleaved layout takes channel idx[c] of the rotate_half layout.

    Interleaved channel 2i is the first element of pair i (rotate_half channel i); 2i + 1 is the second (rotate_half
    channel i + d/2). Interleaved RoPE on weights permuted so equals rotate_half RoPE on the original ones, so a model
    never branches on where its weights came from.
    """
    idx = np.empty(d, dtype=np.int64)
    idx[0::2] = np.arange(d // 2)
    idx[1::2] = np.arange(d // 2) + d // 2
    return idx


def rope_perm(plain: int, rope: int, permute: bool) -> np.ndarray | None:
    """Channel order of [plain | rope] channels: the rotate_half RoPE channels interleaved when `permute`."""
    if not permute:
        return None
    return np.concatenate([np.arange(plain), plain + interleaved_from_rotate_half(rope)])


# ------------------------------------------------------------------------------ a causal LM's plan


def causal_lm_plan(config: ModelConfig, layer_rows: Callable) -> list[Row]:
    """The rows of an HF `*ForCausalLM` checkpoint (model.embed_tokens, model.layers.<i>., model.norm, lm_head):
    layer_rows(segment config, depth, prefix "model.layers.<depth>.", leaf) gives a layer's, where leaf(*path) names
    that layer's slice of the stacked leaf `path` in its segment."""
    V, D = config.vocab_size, config.d_model
    rows = [Row("model.embed_tokens.weight", (V, D), ((("embed", "embedding"), None),), *COPY)]
    for segment in layer_segments(config):
        for depth in range(segment.start, segment.stop):
            def leaf(*path, name=segment.name, index=depth - segment.start):
                return (name,) + path, index
            rows += layer_rows(segment.config, depth, f"model.layers.{depth}.", leaf)
    rows.append(Row("model.norm.weight", (D,), ((("final_norm", "scale"), None),), *COPY))
    if not config.tie_embeddings:
        rows.append(Row("lm_head.weight", (V, D), ((("lm_head",), None),), *TRANSPOSED))
    return rows


def stack_sizes(config: ModelConfig) -> dict[str, int]:
    return {segment.name: segment.num_layers for segment in param_stacks(config)}


def canonical_names(names) -> dict[str, str]:
    """checkpoint name -> its `*ForCausalLM` name: a bare `*Model` checkpoint has no "model." prefix (and no head)."""
    names = list(names)
    if "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names:
        return {n: n if n.startswith("lm_head") else "model." + n for n in names}
    return {n: n for n in names}


# ------------------------------------------------------------------------------ reading by a plan


def check_names(shapes: Mapping[str, tuple], rows: list[Row], fmt) -> list[str]:
    """Raise ConversionError listing every missing, unexpected and mis-shaped tensor of a checkpoint (name -> shape,
    in `*ForCausalLM` naming) against the plan `rows` of the format `fmt`; returns the names the format skips (noted
    once per skipped part)."""
    expected = {row.key: row.shape for row in rows}
    skipped = {prefix: sorted(name for name in shapes if name.startswith(prefix)) for prefix in fmt.skipped}
    ignored = lambda key: key.endswith(IGNORED_SUFFIXES) or key.startswith(tuple(fmt.skipped))  # noqa: E731
    if problems := name_and_shape_problems(shapes, expected, ignored=ignored, missing_what="key(s)",
                                           unexpected_what=f"unexpected key(s) that a {fmt.label} of this config does not have"):
        raise ConversionError(problems)
    for prefix, names in skipped.items():
        if names:
            log.warning("note: skipped the %d tensors %s*: %s", len(names), prefix, fmt.skipped[prefix])
    return [name for names in skipped.values() for name in names]


class Converter:
    """Checkpoint tensors, fed one at a time in any order -> write(diffjax path, layer index or None, array), by
    default into self.params ({diffjax path: array}, contiguous copies: nothing keeps a source buffer alive)."""

    def __init__(self, config: ModelConfig, rows: list[Row], dtype: np.dtype | None, write: Callable | None = None):
        self.rows = {row.key: row for row in rows}
        self.sizes, self.dtype, self.params = stack_sizes(config), dtype, {}
        self.write = write or self._keep

    def add(self, key: str, value) -> None:
        row = self.rows.get(key)
        if row is None:
            return  # skipped, an ignored buffer, or a tied model's lm_head
        for (path, index), array in zip(row.leaves, row.to_ours(to_numpy(value)), strict=True):
            self.write(path, index, array.astype(self.dtype or array.dtype, copy=False))

    def _keep(self, path: tuple, index: int | None, array: np.ndarray) -> None:
        if index is None:
            self.params[path] = np.array(array, order="C", copy=True)
            return
        if path not in self.params:  # the stacked [layers, ...] leaf, allocated at its first layer
            self.params[path] = np.empty((self.sizes[path[0]],) + array.shape, array.dtype)
        self.params[path][index] = array


def leaf_shapes(config: ModelConfig, rows: list[Row]) -> dict[tuple, tuple]:
    """{diffjax path: shape} of what the tensors of a plan convert to (traced: nothing is read or allocated)."""
    import jax

    sizes, leaves = stack_sizes(config), {}
    for row in rows:
        traced = jax.eval_shape(row.to_ours, jax.ShapeDtypeStruct(row.shape, np.float32))
        for (path, index), leaf in zip(row.leaves, traced, strict=True):
            leaves[path] = tuple(leaf.shape) if index is None else (sizes[path[0]],) + tuple(leaf.shape)
    return leaves


# ------------------------------------------------------------------------------ writing by a plan


def export_plan(rows: list[Row], read, read_layer, dtypes: Mapping, dtype=None) -> list[tuple]:
    """[(checkpoint name, shape, dtype, produce())] for save_hf: read(path) a whole leaf, read_layer(path, i) a layer's
    slice of a stacked one; nothing is read before produce() is called. dtype None: the first leaf's."""
    entries = []
    for row in rows:
        out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(dtypes[row.leaves[0][0]])

        def produce(row=row, out_dtype=out_dtype):
            arrays = [np.asarray(read(path) if index is None else read_layer(path, index))
                      for path, index in row.leaves]
            return np.ascontiguousarray(row.to_hf(*arrays)).astype(out_dtype, copy=False)

        entries.append((row.key, row.shape, out_dtype, produce))
    return entries
