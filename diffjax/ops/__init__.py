"""Attention operators behind one interface, selected by `impl`.

impl:
  "xla"         the reference (einsum + fp32 softmax), every platform; materialises T x S scores, except for
                self-attention from context_parallel.BLOCKWISE_FROM (8192) tokens on, or beyond 2048 under a sliding
                window, which runs blockwise (online softmax over key blocks, blocks outside the window skipped,
                flash-style backward: memory of one query piece x one key block).
  window=W (a sliding window: each query sees its W latest keys) runs on xla, pallas_tpu, pallas_gpu, splash and
  cudnn; triton refuses it, and "auto" passes over it.
  "pallas_tpu"  our fused flash kernels (diffjax.ops.pallas_tpu): one pass over K/V for both maps,
                custom-VJP backward. Compiled by Mosaic when the call is compiled for a TPU (a TPU host, or
                a topology's device: diffjax.ops.aot, no TPU needed); Pallas interpret mode otherwise
                (correct but slow: for tests). Likewise below: "off GPU" / "elsewhere" means the device the
                call is compiled for (target.compile_device()), not this machine's.
  "pallas_gpu"  our fused Mosaic GPU kernels for Hopper (diffjax.ops.pallas_gpu); standard attention runs
                their single-map mode (d, dv each 64, 128 or 192: Motif 3's 192 / 128 too; segment ids too).
                Mosaic GPU interpret mode off GPU (for tests).
  "splash"      composition of JAX's splash attention (TPU; interpret mode elsewhere): one call per map.
  "triton"      composition of JAX's Pallas Triton flash attention (any CUDA GPU; interpret mode elsewhere),
                which takes segment ids: packed batches' flash path on GPUs without the fused kernel.
  Under diffjax.sharding.activation_sharding (the train step on a mesh) the Pallas impls (triton too) run inside
  jax.shard_map over the batch and head axes; cudnn and xla are partitioned by the compiler.
  "cudnn"       composition of jax.nn.dot_product_attention(implementation="cudnn") (GPU): V split
                into d-wide pieces, both maps folded into the head axis.
  "auto"        TPU -> "pallas_tpu" (T >= 128). GPU -> "pallas_gpu" on Hopper for every shape it runs,
                with or without segment ids, except where cuDNN takes the call (no segment ids) and was
                measured faster (HOPPER_MS, per pass: undifferentiated, as in eval and generation's prefill,
                and differentiated, as in the train step: a call may run pallas_gpu forward and train through
                cuDNN); else "cudnn" when it takes the call; else "triton" (segment ids, any CUDA GPU); "xla"
                only when none of them runs; a decode step (one query against a KV cache) runs "xla".
A mesh with a context axis (parallel.context > 1; context_parallel.py) splits the sequence: attention all-gathers
K/V over that axis, and each device attends its two query chunks. "pallas_tpu" / "pallas_gpu", and "auto" on a TPU
/ on a Hopper GPU where the Mosaic GPU kernels take the call, run the fused kernels per chunk (the chunk's place in
the sequence as their query offset); every other impl attends blockwise in XLA.

The whole route of a call (impl per pass, context axis, blockwise) is `diffjax.ops.choose(call, impl, device) ->
Route`, a pure function of the shapes, the context axis' size and the device (choice.py; `diffjax-train --routes
--config ... --device h100 parallel.context=2` prints it per attention call); auto's choice and its reason are logged
once per (op, platform, choice, reason), "xla" on an accelerator as a warning. One table (_KERNELS) says how each impl
is called. A call whose passes take different impls is a custom VJP (_by_pass): the primal runs the forward's impl,
the forward rule the differentiated one's, so differentiation itself picks (nothing to pass, nothing to go stale).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from diffjax import sharding
from diffjax.attention_impls import IMPLS, config_problems
from diffjax.hardware import DEVICES, Device
from diffjax.ops import compositions, context_parallel
from diffjax.ops.choice import HOPPER_MS, PASSES, AttentionCall, Route, choose, current_saved, saved_by_remat
from diffjax.ops.names import OUTPUT_NAME
from diffjax.ops.reference import attention_mask, diff_attention_xla, dot_product_attention_xla
from diffjax.ops.target import compile_device, current_device, simulated_device

logger = logging.getLogger(__name__)
_LOGGED: set[tuple] = set()


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """How an impl is called: diff_attention's and dot_product_attention's function in diffjax.ops.<module>
    (imported on first use: the Pallas modules load only where they run), the keywords it takes beside causal,
    segment_ids and scale (from the op's window and block_sizes, and the platform the call is compiled for:
    target.compile_device()), whether it runs per device under shard_map (XLA cannot partition a Pallas call), and
    whether it names its own output for remat (names.OUTPUT_NAME, inside its custom VJP: pallas_gpu; the dispatch
    names the others')."""

    module: str
    functions: tuple[str, str]  # (diff_attention's, dot_product_attention's)
    keywords: Callable[..., dict]  # (window, block_sizes, platform) -> keywords
    per_device: bool
    names_output: bool = False

    def function(self, op: str):
        return getattr(importlib.import_module(f"diffjax.ops.{self.module}"), self.functions[op != "diff_attention"])


_KERNELS = {
    "xla": _Kernel("reference", ("diff_attention_xla", "dot_product_attention_xla"),
                   lambda window, **_: dict(window=window), per_device=False),
    "cudnn": _Kernel("compositions", ("diff_attention_cudnn", "dot_product_attention_cudnn"),
                     lambda window, **_: dict(window=window), per_device=False),
    "pallas_tpu": _Kernel("pallas_tpu", ("diff_attention_pallas", "dot_product_attention_pallas"),
                          lambda window, block_sizes, **_: dict(block_sizes=block_sizes, window=window),
                          per_device=True),
    "pallas_gpu": _Kernel("pallas_gpu", ("diff_attention_pallas_gpu", "dot_product_attention_pallas_gpu"),
                          lambda window, block_sizes, **_: dict(tuning=block_sizes, window=window), per_device=True,
                          names_output=True),
    "splash": _Kernel("compositions", ("diff_attention_splash", "dot_product_attention_splash"),
                      lambda window, platform, **_: dict(window=window, interpret=platform != "tpu"), per_device=True),
    "triton": _Kernel("compositions", ("diff_attention_triton", "dot_product_attention_triton"),
                      lambda platform, **_: dict(interpret=platform != "gpu"), per_device=True),
}


def _log_once(level, key, message):
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, message)


def _route(op: str, impl: str, q, k, v, causal, segment_ids, window) -> Route:
    """choose's route for this call on current_device(), under the active mesh's context axis; logged once per
    (op, platform, choice, reason) for auto ("xla" on an accelerator is a warning), for an explicit impl that runs
    interpreted, and per context route."""
    call = AttentionCall.of(op, q, k, v, causal, segment_ids, window, context_parallel.context_size(), current_saved())
    device = current_device()
    route = choose(call, impl, device)
    if route.context:
        path = "blockwise XLA attention" if route.blockwise else {
            "pallas_tpu": "the fused Pallas TPU kernels", "pallas_gpu": "the fused Mosaic GPU kernels"}[route.impl]
        _log_once(logging.INFO, ("context", impl, None if route.blockwise else route.impl),
                  f"attention over the context axis: all-gathered K/V, {path} per query chunk "
                  f"(diffjax.ops.context_parallel; impl={impl!r})")
    elif impl == "auto":
        slow = device.platform in ("tpu", "gpu") and route.impl == "xla" and not call.is_decode
        why = route.reason if route.grad_reason == route.reason else f"fwd: {route.reason}; fwd+bwd: {route.grad_reason}"
        _log_once(logging.WARNING if slow else logging.INFO, (op, device.platform, route.describe(), why),
                  f"{op}: impl='auto' on {device.platform} chose {route.describe()!r} ({why})")
    elif "interpret" in route.reason:
        _log_once(logging.INFO if impl == "pallas_tpu" else logging.WARNING, (op, device.platform, impl),
                  f"{op}: impl={impl!r} on {device.platform} {route.reason.removeprefix('asked for; ')}")
    return route


def _partitioned(kernel, q, k, v, lam, segment_ids):
    """kernel(q, k, v, lam, segment_ids), under diffjax.sharding.activation_sharding run per device with
    jax.shard_map over the batch and head axes: XLA cannot partition a Pallas call itself."""
    mesh = sharding.active_mesh()
    if mesh is None:
        return kernel(q, k, v, lam, segment_ids)
    heads = ("batch", "length", "act_heads", None, None)[: q.ndim]
    kv_heads = ("batch", "length", "act_kv_heads", None, None)
    arrays = [(q, heads), (k, kv_heads[: k.ndim]), (v, kv_heads[: v.ndim])]
    if lam is not None:
        arrays.append((jnp.asarray(lam), () if jnp.ndim(lam) == 0 else ("batch", "length", "act_heads")))
    ids = () if segment_ids is None else (segment_ids if isinstance(segment_ids, tuple) else (segment_ids,))
    arrays += [(jnp.asarray(x), ("batch", "length")) for x in ids]
    n = 4 if lam is not None else 3

    def per_device(*local):
        local_ids = local[n:]
        local_segments = None if not local_ids else (local_ids if isinstance(segment_ids, tuple) else local_ids[0])
        return kernel(*local[:3], local[3] if lam is not None else None, local_segments)

    return sharding.shard_map_by_logical_axes(per_device, mesh, arrays, ("batch", "length", "act_heads", None))


def _context_fused(kernel, q, k, v, lam, segment_ids):
    """kernel(q, k, v, lam, segment_ids, q_offset) per query chunk over the context axis (context_parallel_fused)."""
    heads = ("batch", "length", "act_heads") + (None,) * (q.ndim - 3)
    kv_heads = ("batch", "length", "act_kv_heads") + (None,) * (k.ndim - 3)
    lam_axes = () if lam is None or jnp.ndim(lam) == 0 else ("batch", "length", "act_heads")
    return context_parallel.context_parallel_fused(kernel, q, k, v, lam, segment_ids=segment_ids,
                                                   mesh=sharding.active_mesh(), q_axes=heads, kv_axes=kv_heads,
                                                   lam_axes=lam_axes)


def _blockwise(op, q, k, v, lam, *, over_context, causal, segment_ids, scale, window):
    """Blockwise XLA attention (context_parallel.py): over the active mesh's context axis, or on one device. Both
    ops attend as per-map outputs [B, T, K, R, M, dv] (K kv heads, R query heads per kv head, M maps)."""
    B, T, H, d = q.shape[0], q.shape[1], q.shape[2], q.shape[-1]
    maps = 2 if op == "diff_attention" else 1
    q_BTKRMd = q.reshape(B, T, k.shape[2], -1, maps, d)
    k_BSKGd = k if maps == 2 else k[:, :, :, None]
    kwargs = dict(causal=causal, segment_ids=segment_ids, scale=d ** -0.5 if scale is None else scale, window=window)
    if over_context:
        o_BTKRMv = context_parallel.context_parallel_attention(q_BTKRMd, k_BSKGd, v, mesh=sharding.active_mesh(),
                                                               **kwargs)
    else:
        o_BTKRMv = context_parallel.blockwise_xla_attention(q_BTKRMd, k_BSKGd, v, **kwargs)
    if maps == 1:
        return o_BTKRMv.reshape(B, T, H, v.shape[-1])
    return compositions.lam_epilogue(o_BTKRMv.reshape(B, T, H, 2, v.shape[-1]), lam, v.dtype)


def _attention(op, q, k, v, lam, *, causal, segment_ids, scale, impl, block_sizes, window):
    """Both ops' dispatch: the call's route, then its impl's row of _KERNELS (lam None for dot_product_attention),
    differentiated through route.grad_impl where that differs (_by_pass); the output named names.OUTPUT_NAME for
    remat (pallas_gpu names its own)."""
    route = _route(op, impl, q, k, v, causal, segment_ids, window)
    run = functools.partial(_run, op, causal=causal, segment_ids=segment_ids, scale=scale, block_sizes=block_sizes,
                            window=window)
    if route.grad_impl == route.impl:
        out = run(route, q, k, v, lam)
        if not route.blockwise and _KERNELS[route.impl].names_output:
            return out
    else:
        args = (q, k, v) if lam is None else (q, k, v, jnp.asarray(lam))
        grad_route = dataclasses.replace(route, impl=route.grad_impl)
        out = _by_pass(functools.partial(run, route), functools.partial(run, grad_route), *args)
    return checkpoint_name(out, OUTPUT_NAME)


def _by_pass(forward, differentiated, *args):
    """forward(*args), whose derivative is differentiated's: a custom VJP whose primal runs `forward` and whose
    forward rule runs `differentiated` and keeps its VJP. Differentiation itself picks the impl of each pass (the
    train step's fwd+bwd, eval's and generation's forward), so no caller says which pass it is in."""

    @jax.custom_vjp
    def call(*args):
        return forward(*args)

    def call_fwd(*args):
        return jax.vjp(differentiated, *args)

    call.defvjp(call_fwd, lambda vjp, g: vjp(g))
    return call(*args)


def _run(op, route, q, k, v, lam=None, *, causal, segment_ids, scale, block_sizes, window):
    """The op on `route`."""
    if route.blockwise:
        return _blockwise(op, q, k, v, lam, over_context=route.context, causal=causal, segment_ids=segment_ids,
                          scale=scale, window=window)
    kernel = _KERNELS[route.impl]
    function = kernel.function(op)
    keywords = dict(causal=causal, scale=scale, **kernel.keywords(window=window, block_sizes=block_sizes,
                                                                   platform=compile_device().platform))

    def attend(q, k, v, lam, ids, **offset):  # (lam is a placeholder for dot_product_attention)
        return function(q, k, v, *((lam,) if op == "diff_attention" else ()), segment_ids=ids, **keywords, **offset)

    if route.context:
        return _context_fused(lambda q, k, v, lam, ids, offset: attend(q, k, v, lam, ids, q_offset=offset),
                              q, k, v, lam, segment_ids)
    if kernel.per_device:
        return _partitioned(attend, q, k, v, lam, segment_ids)
    return attend(q, k, v, lam, segment_ids)


def diff_attention(q, k, v, lam, *, causal=True, segment_ids=None, scale=None, impl="auto", block_sizes=None,
                   window=None):
    """o[B, T, H, dv] = softmax(q1 k1^T scale) v - lam softmax(q2 k2^T scale) v.

    q: [B, T, H, 2, d]; k: [B, S, Hkv, G, d] (G = 2, or 1 when both maps share keys);
    v: [B, S, Hkv, dv]; lam: scalar or [B, T, H]; scale defaults to d ** -0.5.
    segment_ids: None, [B, T] (T == S) or a pair (q ids [B, T], kv ids [B, S]).
    block_sizes: (block_q, block_k) for impl="pallas_tpu" (default 128, 128); a
    diffjax.ops.pallas_gpu.Tuning for impl="pallas_gpu" (default: pallas_gpu.default_tuning).
    window: None, or W: a sliding window, each query sees its W latest keys (itself included; causal only).
    Under an activation-sharding mesh with a context axis, the sequence is split over it (context_parallel.py).
    """
    return _attention("diff_attention", q, k, v, lam, causal=causal, segment_ids=segment_ids, scale=scale, impl=impl,
                      block_sizes=block_sizes, window=window)


def dot_product_attention(q, k, v, *, causal=True, segment_ids=None, scale=None, impl="auto", block_sizes=None,
                          window=None):
    """o[B, T, N, dv] = softmax(q k^T scale) v with q: [B, T, N, d], k: [B, S, K, d], v: [B, S, K, dv].

    The baseline Transformer's op; every impl name works ("pallas_tpu" and "pallas_gpu" run the
    single-map mode of the fused kernels, "cudnn" calls jax.nn.dot_product_attention directly).
    block_sizes, window: as for diff_attention. A context axis splits the sequence as for diff_attention.
    """
    return _attention("dot_product_attention", q, k, v, None, causal=causal, segment_ids=segment_ids, scale=scale,
                      impl=impl, block_sizes=block_sizes, window=window)


__all__ = [
    "DEVICES", "HOPPER_MS", "IMPLS", "PASSES", "AttentionCall", "Device", "Route", "attention_mask", "choose",
    "compile_device", "config_problems", "current_device", "diff_attention", "diff_attention_xla",
    "dot_product_attention", "dot_product_attention_xla", "saved_by_remat", "simulated_device",
]
