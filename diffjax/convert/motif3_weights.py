"""Motif 3's checkpoint tensors <-> diffjax params: one plan row per checkpoint name (tests/motif3_published.py's
checkpoint_shapes lists them), transposes, reshapes and one split only, read shard by shard.

A row maps a checkpoint tensor to one or two diffjax leaves (experts.gate_up_proj is the gate and up kernels), each a
layer's slice of a stacked leaf ("blocks" from layer 0, "blocks_from_<start>" after the dense first layers:
diffjax.kinds.layer_segments) or a whole leaf (embedding, final norm, lm_head). The names inside a layer follow the
modules' docstrings (diffjax.model.attention.gdla, .residual.mhc, .mlp.moe, .mlp.polynorm). The multi-token-
prediction block (model.mtp_layers.*) is skipped with one note: the modeling code never builds it.

Peak host memory of params_from_hf_dir: the converted params (the model) plus one source tensor and its converted
copy (a tensor is at most a shard); files are memory-mapped one at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import jax
import numpy as np

from diffjax.config import ModelConfig
from diffjax.convert.common import ConversionError, name_and_shape_problems, to_numpy
from diffjax.convert.hf_files import HFWeights
from diffjax.kinds import layer_segments
from diffjax.model.rope import interleaved_from_rotate_half

log = logging.getLogger(__name__)

MTP_PREFIX = "model.mtp_layers."
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Row:
    """A checkpoint tensor: `key` of `shape` <-> diffjax leaves [(stacked path, layer index in it or None)]."""

    key: str
    shape: tuple[int, ...]
    leaves: tuple[tuple[tuple, int | None], ...]
    to_ours: Callable  # checkpoint array -> tuple of arrays, one per leaf (numpy or jax: shapes can be traced)
    to_hf: Callable  # arrays, one per leaf -> checkpoint array


def _same(w):
    return (w,)


def _identity(w):
    return w


def _transposed(w):
    return (w.T,)


def _untransposed(w):
    return w.T


def _linear(out_dims: tuple, perm=None) -> tuple[Callable, Callable]:
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


def _out_projection(D: int, heads: int, width: int) -> tuple[Callable, Callable]:
    """wo [D, S dv] <-> o_kernel (S, dv, D)."""
    return (lambda w: (w.reshape(D, heads, width).transpose(1, 2, 0),),
            lambda w: w.transpose(2, 0, 1).reshape(D, heads * width))


def _rope_perm(plain: int, rope: int, permute: bool):
    """Channel order of [plain | rope] channels: rotate_half RoPE channels interleaved when `permute`."""
    if not permute:
        return None
    return np.concatenate([np.arange(plain), plain + interleaved_from_rotate_half(rope)])


def _attention_rows(config: ModelConfig, hf: str, leaf: Callable) -> list[Row]:
    o, D, H, K = config.attention_options, config.d_model, config.num_heads, config.num_kv_heads
    S, dv, dn, dr = H - o.num_noise_heads, o.v_head_dim, o.qk_nope_head_dim, o.qk_rope_head_dim
    permute = config.rope_style == "interleaved"
    rows = [
        ("wq_a.weight", (o.q_lora_rank, D), "q_down_kernel", _linear((o.q_lora_rank,))),
        ("q_norm.weight", (o.q_lora_rank,), "q_norm_scale", (_same, _identity)),
        ("wq_b.weight", (H * config.head_dim, o.q_lora_rank), "q_up_kernel",
         _linear((H, config.head_dim), _rope_perm(dn, dr, permute))),
        ("wkv_a.weight", (o.kv_lora_rank + dr, D), "kv_down_kernel",
         _linear((o.kv_lora_rank + dr,), _rope_perm(o.kv_lora_rank, dr, permute))),
        ("kv_norm.weight", (o.kv_lora_rank,), "kv_norm_scale", (_same, _identity)),
        ("wkv_b.weight", (K * (dn + dv), o.kv_lora_rank), "kv_up_kernel", _linear((K, dn + dv))),
        ("lambda_proj.weight", (S, D), "lambda_kernel", _linear((S,))),
        ("wo.weight", (D, S * dv), "o_kernel", _out_projection(D, S, dv)),
    ]
    if o.output_gate:
        rows.append(("wq_b_gate.weight", (S * dv, o.q_lora_rank), "gate_kernel", _linear((S, dv))))
    return [Row(hf + name, shape, (leaf("attn", ours),), *fns) for name, shape, ours, fns in rows]


def _polynorm_rows(hf: str, leaf: Callable, D: int, inner: int, *prefix: str) -> list[Row]:
    t = (_transposed, _untransposed)
    return [Row(hf + "gate_proj.weight", (inner, D), (leaf(*prefix, "gate_kernel"),), *t),
            Row(hf + "up_proj.weight", (inner, D), (leaf(*prefix, "up_kernel"),), *t),
            Row(hf + "down_proj.weight", (D, inner), (leaf(*prefix, "down_kernel"),), *t),
            Row(hf + "act_fn.weight", (3,), (leaf(*prefix, "polynorm_weight"),), _same, _identity),
            Row(hf + "act_fn.bias", (1,), (leaf(*prefix, "polynorm_bias"),), _same, _identity)]


def _moe_rows(config: ModelConfig, hf: str, leaf: Callable) -> list[Row]:
    o, D = config.mlp_options, config.d_model
    E, inner = o.num_experts, o.expert_inner
    swap = (0, 2, 1)
    rows = [
        Row(hf + "router.gate.weight", (E, D), (leaf("mlp", "router_kernel"),), _transposed, _untransposed),
        Row(hf + "experts.gate_up_proj", (E, 2 * inner, D),
            (leaf("mlp", "expert_gate_kernel"), leaf("mlp", "expert_up_kernel")),
            lambda w: (w[:, :inner].transpose(swap), w[:, inner:].transpose(swap)),
            lambda gate, up: np.concatenate([gate.transpose(swap), up.transpose(swap)], axis=1)),
        Row(hf + "experts.down_proj", (E, D, inner), (leaf("mlp", "expert_down_kernel"),),
            lambda w: (w.transpose(swap),), lambda w: w.transpose(swap)),
        Row(hf + "experts.act_fn.weight", (E, 3), (leaf("mlp", "expert_polynorm_weight"),), _same, _identity),
        Row(hf + "experts.act_fn.bias", (E, 1), (leaf("mlp", "expert_polynorm_bias"),), _same, _identity),
    ]
    if o.expert_bias:
        rows.append(Row(hf + "expert_bias", (E,), (leaf("mlp", "expert_bias"),), _same, _identity))
    if o.num_shared_experts:
        rows += _polynorm_rows(hf + "shared_experts.", leaf, D, o.shared_inner, "mlp", "shared_expert")
    return rows


def _mhc_rows(config: ModelConfig, hf: str, leaf: Callable, ours: str) -> list[Row]:
    E, D = config.residual_options.streams, config.d_model
    rows = [Row(hf + "rms_norm.weight", (E * D,), (leaf(ours, "norm", "scale"),), _same, _identity)]
    for part, width in (("pre", E), ("post", E), ("res", E * E)):
        rows += [Row(f"{hf}proj_{part}.weight", (width, E * D), (leaf(ours, f"{part}_kernel"),), _transposed,
                     _untransposed),
                 Row(f"{hf}bias_{part}", (E, E) if part == "res" else (E,), (leaf(ours, f"{part}_bias"),), _same,
                     _identity),
                 Row(f"{hf}alpha_{part}", (1,), (leaf(ours, f"{part}_alpha"),), lambda w: (w.reshape(()),),
                     lambda w: w.reshape(1))]
    return rows


def _layer_rows(config: ModelConfig, segment_config: ModelConfig, depth: int, leaf: Callable) -> list[Row]:
    hf, D = f"model.layers.{depth}.", config.d_model
    rows = [Row(hf + "input_layernorm.weight", (D,), (leaf("attn_norm", "scale"),), _same, _identity),
            Row(hf + "post_attention_layernorm.weight", (D,), (leaf("mlp_norm", "scale"),), _same, _identity)]
    rows += _attention_rows(config, hf + "self_attn.", leaf)
    if segment_config.mlp == "moe":
        rows += _moe_rows(segment_config, hf + "moe.", leaf)
    else:
        rows += _polynorm_rows(hf + "mlp.", leaf, D, segment_config.mlp_dim, "mlp")
    if config.residual == "mhc":
        rows += _mhc_rows(config, hf + "mhc_attn.", leaf, "attn_residual")
        rows += _mhc_rows(config, hf + "mhc_ffn.", leaf, "mlp_residual")
    return rows


def plan(config: ModelConfig) -> list[Row]:
    """Every checkpoint tensor of `config`'s Motif 3 (but the MTP block's), in the checkpoint's order."""
    V, D = config.vocab_size, config.d_model
    rows = [Row("model.embed_tokens.weight", (V, D), ((("embed", "embedding"), None),), _same, _identity)]
    for segment in layer_segments(config):
        for depth in range(segment.start, segment.stop):
            def leaf(*path, name=segment.name, index=depth - segment.start):
                return (name,) + path, index
            rows += _layer_rows(config, segment.config, depth, leaf)
    rows.append(Row("model.norm.weight", (D,), ((("final_norm", "scale"), None),), _same, _identity))
    if not config.tie_embeddings:
        rows.append(Row("lm_head.weight", (V, D), ((("lm_head",), None),), _transposed, _untransposed))
    return rows


def stack_sizes(config: ModelConfig) -> dict[str, int]:
    return {segment.name: segment.stop - segment.start for segment in layer_segments(config)}


def is_skipped(name: str) -> bool:
    """Checkpoint tensors diffjax does not build: the MTP block, RoPE buffers."""
    return name.startswith(MTP_PREFIX) or name.endswith(_IGNORED_SUFFIXES)


def check_names(shapes: dict[str, tuple], rows: list[Row]) -> list[str]:
    """The checkpoint's skipped names; raises ConversionError listing missing, unexpected and mis-shaped ones."""
    if problems := name_and_shape_problems(shapes, {row.key: row.shape for row in rows}, ignored=is_skipped,
                                           missing_what="Motif 3 tensor(s)",
                                           unexpected_what="tensor(s) this Motif 3 config does not have"):
        raise ConversionError(problems)
    return sorted(name for name in shapes if is_skipped(name))


def note_skipped(skipped: list[str]) -> None:
    mtp = [name for name in skipped if name.startswith(MTP_PREFIX)]
    if mtp:
        log.warning("note: skipped the %d multi-token-prediction tensors (%s*): Motif 3's modeling code never builds "
                    "that block", len(mtp), MTP_PREFIX)


class Converter:
    """Checkpoint tensors, fed one at a time in any order -> write(diffjax path, layer index or None, array), by
    default into self.params ({diffjax path: array}, contiguous copies: nothing keeps a source buffer alive)."""

    def __init__(self, config: ModelConfig, dtype: np.dtype | None, write: Callable | None = None):
        self.rows = {row.key: row for row in plan(config)}
        self.sizes, self.dtype, self.params = stack_sizes(config), dtype, {}
        self.write = write or self._keep

    def add(self, key: str, value) -> None:
        row = self.rows.get(key)
        if row is None:
            return  # skipped, or a tied model's lm_head
        for (path, index), array in zip(row.leaves, row.to_ours(to_numpy(value))):
            self.write(path, index, array.astype(self.dtype or array.dtype, copy=False))

    def _keep(self, path: tuple, index: int | None, array: np.ndarray) -> None:
        if index is None:
            self.params[path] = np.array(array, order="C", copy=True)
            return
        if path not in self.params:  # the stacked [layers, ...] leaf, allocated at its first layer
            self.params[path] = np.empty((self.sizes[path[0]],) + array.shape, array.dtype)
        self.params[path][index] = array


def params_from_hf(tensors: dict, config: ModelConfig, dtype=None) -> dict:
    """A Motif 3 state dict (name -> tensor or array) -> {diffjax path: numpy array}."""
    note_skipped(check_names({k: tuple(v.shape) for k, v in tensors.items()}, plan(config)))
    converter = Converter(config, dtype)
    for key, value in tensors.items():
        converter.add(key, value)
    return converter.params


def params_from_hf_dir(directory: str | os.PathLike, config: ModelConfig, dtype=None, *, progress=None) -> dict:
    """The params of a Motif 3 directory, one weight file and one tensor at a time."""
    converter = Converter(config, dtype)
    convert_files(checked_weights(directory, config), converter, progress=progress)
    return converter.params


def checked_weights(directory: str | os.PathLike, config: ModelConfig) -> HFWeights:
    """A Motif 3 directory's weight files, their tensors' names and shapes checked from the headers."""
    weights = HFWeights(directory)
    note_skipped(check_names(weights.shapes(), plan(config)))
    return weights


def convert_files(weights: HFWeights, converter: Converter, *, progress=None) -> None:
    """Feed every tensor to `converter`, one weight file at a time; each is dropped once converted."""
    for index, file in enumerate(weights.files):
        if progress:
            progress(file.name, index, len(weights.files))
        for name, array in weights.tensors(file):
            converter.add(name, array)
            del array


def leaf_shapes(config: ModelConfig, shapes: dict[str, tuple]) -> dict[tuple, tuple]:
    """{diffjax path: shape} of what a checkpoint with these tensor shapes converts to (traced: nothing is read)."""
    sizes, leaves = stack_sizes(config), {}
    for row in plan(config):
        traced = jax.eval_shape(row.to_ours, jax.ShapeDtypeStruct(shapes[row.key], np.float32))
        for (path, index), leaf in zip(row.leaves, traced):
            leaves[path] = tuple(leaf.shape) if index is None else (sizes[path[0]],) + tuple(leaf.shape)
    return leaves


def export_plan(config: ModelConfig, read, read_layer, dtypes: dict, dtype=None) -> list[tuple]:
    """[(checkpoint name, shape, dtype, produce())] for save_hf: read(path) a whole leaf, read_layer(path, i) a layer's
    slice of a stacked one; nothing is read before produce() is called."""
    entries = []
    for row in plan(config):
        out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(dtypes[row.leaves[0][0]])

        def produce(row=row, out_dtype=out_dtype):
            arrays = [np.asarray(read(path) if index is None else read_layer(path, index)) for path, index in row.leaves]
            return np.ascontiguousarray(row.to_hf(*arrays)).astype(out_dtype, copy=False)

        entries.append((row.key, row.shape, out_dtype, produce))
    return entries
