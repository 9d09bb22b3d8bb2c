"""The route of an attention call, and why: which impl runs it, whether per query chunk over the mesh's context
axis, whether the XLA path runs blockwise. A pure function of the call's shapes, the context axis' size and the
device, so "what would `auto` do on an H100 for these shapes" needs no H100 (`diffjax-train --routes --config ...
--device h100 parallel.context=2` prints it for a model's every attention call).

`choose(call, impl, device) -> Route`; an explicit impl that cannot run the call is a ValueError naming the impl,
the shapes and what to use instead. diffjax.ops' diff_attention / dot_product_attention (and so the KV cache's
decode step) call it with `current_device()`: the device the call is compiled for, or the one `simulated_device`
sets (tests; diffjax.ops.target).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

from diffjax.attention_impls import IMPLS
from diffjax.ops import compositions, context_parallel
from diffjax.ops.reference import check_window
from diffjax.hardware import Device
from diffjax.ops.target import current_device

# The passes a call can run in: "fwd" undifferentiated (eval, generation's prefill), "fwd+bwd" differentiated (the
# train step: the forward rule and the backward), named as benchmarks/attention.py names them.
PASSES = ("fwd", "fwd+bwd")
# What the backward of a differentiated call finds saved of its forward (AttentionCall.saved), and the (impl, op)
# whose residuals a policy keeping the names of names.py ("named": remat="attention") keeps.
SAVED = ("all", "named", "none")
KEPT_BY_NAME = (("pallas_gpu", "dot_product_attention"),)
# Hopper measurements "auto" weighs pallas_gpu against cuDNN by, per pass: milliseconds per (op, d, dv, causal) at
# T = S = 8192, B 2, H 8 differential heads (dot_product_attention: 16 heads of d, dv = d: attention.py's
# baseline rows, pallas_gpu's single-map mode), bf16. The mean of the two H100 runs (jax 0.11.2) committed in
# benchmarks/results/attention_gpu.json (2026-11-26) and benchmarks/results/capture_2026-11-27/attention_capture.json;
# `python benchmarks/attention.py --route-table FILE...` prints it from result files, and tests/test_attention_passes.py
# checks it against those two. A class not here runs pallas_gpu wherever it takes the call.
HOPPER_MS: dict[tuple[str, int, int, bool], dict[str, dict[str, float]]] = {
    ("diff_attention", 128, 256, False): {"fwd": {"cudnn": 4.17, "pallas_gpu": 3.25},
                                          "fwd+bwd": {"cudnn": 13.39, "pallas_gpu": 15.76}},
    ("diff_attention", 128, 256, True): {"fwd": {"cudnn": 2.4, "pallas_gpu": 1.69},
                                         "fwd+bwd": {"cudnn": 7.87, "pallas_gpu": 8.16}},
    ("dot_product_attention", 128, 128, False): {"fwd": {"cudnn": 1.91, "pallas_gpu": 2.1},
                                                 "fwd+bwd": {"cudnn": 6.81, "pallas_gpu": 9.57}},
    ("dot_product_attention", 128, 128, True): {"fwd": {"cudnn": 1.26, "pallas_gpu": 1.09},
                                                "fwd+bwd": {"cudnn": 4.21, "pallas_gpu": 5.51}},
}
TPU_MIN_T = 128  # below one Pallas TPU block, auto takes xla


_SAVED: contextvars.ContextVar[str] = contextvars.ContextVar("saved_by_remat", default="all")


@contextlib.contextmanager
def saved_by_remat(saved: str):
    """The attention calls traced inside are differentiated under a remat policy that saves `saved` (SAVED) of their
    forward for the backward: the model's checkpointed blocks say so (model.transformer), and "auto" counts the
    forward that a backward runs again (AttentionCall.saved)."""
    if saved not in SAVED:
        raise ValueError(f"saved must be one of {SAVED}, got {saved!r}")
    token = _SAVED.set(saved)
    try:
        yield
    finally:
        _SAVED.reset(token)


def current_saved() -> str:
    """What `saved_by_remat` says of the calls traced now ("all" outside it)."""
    return _SAVED.get()


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """An attention op call by its shapes: q [B, T, H, 2, d] (diff_attention) or [B, T, H, d]
    (dot_product_attention), k [B, S, Hkv, G, d] or [B, S, Hkv, d], v [B, S, Hkv, dv]. segments: None, "one"
    (one [B, T] id array, T == S), "pair" (q ids and kv ids: decoding against a cache) or "per_query" (q ids and
    kv ids [B, T, S], a row of them per query: a multi-token decode step, speculative decoding's). window: None or the
    sliding window's keys per query. context: the size of the mesh's context axis the call runs under (1: none).
    saved: what of a differentiated call's forward its backward finds saved (SAVED): "all" (no remat), "named" (a
    remat policy keeping names.OUTPUT_NAME and KERNEL_RESIDUALS_NAME), "none" (the forward runs again)."""

    op: str
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    dtype: str
    causal: bool = True
    segments: str | None = None
    window: int | None = None
    context: int = 1
    saved: str = "all"

    @classmethod
    def of(cls, op, q, k, v, causal, segment_ids, window=None, context=1, saved="all") -> "AttentionCall":
        check_window(window, causal)
        segments = None if segment_ids is None else "one" if not isinstance(segment_ids, (tuple, list)) else (
            "per_query" if jnp.ndim(segment_ids[1]) == 3 else "pair")
        return cls(op, tuple(q.shape), tuple(k.shape), tuple(v.shape), jnp.dtype(q.dtype).name, bool(causal), segments,
                   None if window is None else int(window), int(context), saved)

    def arrays(self):
        """(q, k, v, segment_ids) as ShapeDtypeStructs: what the kernels' `unsupported` checks read."""
        sds = jax.ShapeDtypeStruct
        B, T, S = self.q_shape[0], self.q_shape[1], self.k_shape[1]
        ids = {None: None, "one": sds((B, T), jnp.int32), "pair": (sds((B, T), jnp.int32), sds((B, S), jnp.int32)),
               "per_query": (sds((B, T), jnp.int32), sds((B, T, S), jnp.int32))}
        return (sds(self.q_shape, self.dtype), sds(self.k_shape, self.dtype), sds(self.v_shape, self.dtype),
                ids[self.segments])

    @property
    def is_decode(self) -> bool:
        """A decode step against a KV cache's slots: one query per row (q / kv segment ids), or a few with kv ids of
        their own (speculative decoding's 1 + draft)."""
        return (self.segments == "pair" and self.q_shape[1] == 1) or self.segments == "per_query"

    def describe(self) -> str:
        ids = {None: "", "one": ", segment ids", "pair": ", q / kv segment ids",
               "per_query": ", q / per-query kv segment ids"}[self.segments]
        window = "" if self.window is None else f", window {self.window}"
        context = "" if self.context == 1 else f", context axis of {self.context}"
        return (f"{self.op} q {list(self.q_shape)} k {list(self.k_shape)} v {list(self.v_shape)} {self.dtype}"
                f"{', causal' if self.causal else ''}{ids}{window}{context}")


@dataclasses.dataclass(frozen=True)
class Route:
    """How diffjax.ops runs a call. impl: the implementation that runs it undifferentiated (eval, generation's
    prefill); grad_impl: the one that runs it differentiated (its forward rule and backward: the train step), the
    same unless "auto" measured another faster there (HOPPER_MS). context: per query chunk over the mesh's context
    axis (K/V all-gathered; impl pallas_tpu / pallas_gpu: the fused kernels with the chunk's place in the sequence
    as their query offset, else blockwise XLA). blockwise: the XLA path attends blockwise (online softmax over key
    blocks, flash-style backward: context_parallel.blockwise_attention) instead of materialising the T x S scores.
    reason, grad_reason: why impl, why grad_impl (None on construction: the same as impl / reason)."""

    impl: str
    context: bool
    blockwise: bool
    reason: str
    grad_impl: str | None = None
    grad_reason: str | None = None

    def __post_init__(self):
        if self.grad_impl is None:
            object.__setattr__(self, "grad_impl", self.impl)
        if self.grad_reason is None:
            object.__setattr__(self, "grad_reason", self.reason)

    def by_pass(self) -> dict[str, tuple[str, str]]:
        """{pass: (impl, why)} for PASSES: "fwd" (undifferentiated) and "fwd+bwd" (differentiated)."""
        return dict(zip(PASSES, ((self.impl, self.reason), (self.grad_impl, self.grad_reason))))

    def describe(self) -> str:
        path = f"{self.impl} blockwise" if self.blockwise else self.impl
        if self.grad_impl != self.impl:
            path = f"{path} (fwd), {self.grad_impl} (fwd+bwd)"
        return f"{path} per query chunk over the context axis" if self.context else path


def pallas_gpu_unsupported(call: AttentionCall) -> str | None:
    """Why the Mosaic GPU kernels cannot run `call` (None: they can; any sliding window too)."""
    from diffjax.ops.pallas_gpu import unsupported

    return unsupported(*call.arrays()[:3])


# impl: (why it cannot run a call, the platform it compiles for, what to use instead)
_PALLAS_COMPOSITIONS = {
    "splash": (compositions.splash_unsupported, "tpu", "'pallas_tpu' or 'xla'"),
    "triton": (compositions.triton_unsupported, "gpu", "'xla'"),
}


def choose(call: AttentionCall, impl: str = "auto", device: Device | None = None) -> Route:
    """The route of `call` on `device` (None: `current_device()`)."""
    device = device or current_device()
    if impl not in IMPLS:
        raise ValueError(f"{call.op}: attention impl must be one of {IMPLS}, got {impl!r}")
    if call.context > 1:
        return _over_the_context_axis(call, impl, device)
    fwd, grad = _auto(call, device) if impl == "auto" else (_asked_for(call, impl, device),) * 2
    why_blockwise = _why_xla_runs_blockwise(call) if fwd[0] == "xla" else None  # (xla is both passes' or neither's)
    if why_blockwise:
        return Route(fwd[0], context=False, blockwise=True, reason=f"{fwd[1]}; blockwise: {why_blockwise}")
    return Route(fwd[0], context=False, blockwise=False, reason=fwd[1], grad_impl=grad[0], grad_reason=grad[1])


def _over_the_context_axis(call: AttentionCall, impl: str, device: Device) -> Route:
    """Over a context axis only the fused kernels take a query chunk's offset; every other impl attends blockwise in
    XLA. So "auto" takes the fused kernels wherever they run the call, with none of its single-device preferences:
    TPU_MIN_T and HOPPER_MS weigh a kernel against the XLA reference and cuDNN, and over a context axis the
    alternative is blockwise XLA."""
    if impl in ("pallas_tpu", "pallas_gpu"):
        reason = _asked_for(call, impl, device)[1]  # raises where the kernel cannot take the call
        return Route(impl, context=True, blockwise=False, reason=reason)
    if impl != "auto":
        return Route("xla", context=True, blockwise=True, reason=f"impl {impl!r} takes no query offset")
    if device.platform == "tpu":
        return Route("pallas_tpu", context=True, blockwise=False, reason="fused Pallas TPU kernel with a query offset")
    why_not = pallas_gpu_unsupported(call) if device.is_hopper else "needs a Hopper GPU"
    if why_not is None:
        return Route("pallas_gpu", context=True, blockwise=False, reason="fused Mosaic GPU kernel with a query offset")
    return Route("xla", context=True, blockwise=True, reason=f"pallas_tpu needs a TPU; pallas_gpu {why_not}")


def _why_xla_runs_blockwise(call: AttentionCall) -> str | None:
    """Self-attention from context_parallel.BLOCKWISE_FROM tokens on, or under a sliding window beyond 4 key blocks
    (blocks outside the window are skipped: cost T x window; at 4 blocks, 2048 tokens with a window of 512, one
    T x T pass was still faster on CPU: benchmarks/sliding_window.py). None: the reference's T x S pass."""
    T, S, block = call.q_shape[1], call.k_shape[1], context_parallel.DEFAULT_BLOCK
    if T != S:
        return None
    if T >= context_parallel.BLOCKWISE_FROM:
        return f"T={T} >= {context_parallel.BLOCKWISE_FROM} (the T x T scores would not fit)"
    if call.window is not None and T > 4 * block:
        return f"window {call.window} over T={T} > 4 key blocks of {block} (blocks outside the window are skipped)"
    return None


def _asked_for(call: AttentionCall, impl: str, device: Device) -> tuple[str, str]:
    """(impl, why) for an explicit impl, or a ValueError where it cannot run `call`."""
    q, k, v, segment_ids = call.arrays()
    where = f"shapes q {call.q_shape}, k {call.k_shape}, v {call.v_shape}"
    if call.segments == "per_query" and impl != "xla":
        raise ValueError(f"{call.op}: impl={impl!r} takes no per-query kv segment ids ([B, T, S]: a multi-token decode "
                         f"step); {where}. Use impl='xla' or 'auto'.")
    if impl == "cudnn":
        why_not = compositions.cudnn_unsupported(q, k, v, call.causal, segment_ids, device.platform)
        if why_not:
            raise ValueError(f"{call.op}: impl='cudnn' {why_not}; {where}, dtype {call.dtype}. "
                             "Use impl='xla' (any platform) or 'pallas_tpu'.")
        return impl, "asked for"
    if impl in _PALLAS_COMPOSITIONS:  # JAX's own Pallas kernels: interpreted off their platform
        unsupported, home, instead = _PALLAS_COMPOSITIONS[impl]
        why_not = unsupported(q, k, v, call.causal, segment_ids, device.platform, interpret=True, window=call.window)
        if why_not:
            raise ValueError(f"{call.op}: impl={impl!r} {why_not}; {where}. Use impl={instead}.")
        return impl, "asked for" if device.platform == home else "asked for; runs in Pallas interpret mode (slow)"
    if impl == "pallas_gpu":
        why_not = pallas_gpu_unsupported(call)
        if why_not:
            raise ValueError(f"{call.op}: impl='pallas_gpu' {why_not}; {where}, dtype {call.dtype}.")
        return impl, "asked for" if device.platform == "gpu" else "asked for; runs in Mosaic GPU interpret mode (very slow)"
    if impl == "pallas_tpu" and device.platform != "tpu":
        return impl, "asked for; runs in Pallas interpret mode (slow)"
    return impl, "asked for"


def _auto(call: AttentionCall, device: Device) -> tuple[tuple[str, str], tuple[str, str]]:
    """((impl, why) undifferentiated, (impl, why) differentiated): the same pair but where HOPPER_MS measured
    pallas_gpu and cuDNN apart."""
    T, d, dv = call.q_shape[1], call.q_shape[-1], call.v_shape[-1]
    if call.is_decode:
        return (("xla", "decode: queries against the KV cache (no fused decode kernel yet; per-query kv ids: the xla "
                        "op's alone)"),) * 2
    if device.platform == "tpu":
        return (("pallas_tpu", "fused Pallas TPU kernel") if T >= TPU_MIN_T else
                ("xla", f"T={T} < {TPU_MIN_T} is below one kernel block"),) * 2
    if device.platform != "gpu":
        return (("xla", f"platform {device.platform!r} has no compiled flash kernel (the Pallas impls would run "
                        "interpreted)"),) * 2
    q, k, v, segment_ids = call.arrays()
    why_not = {
        "pallas_gpu": pallas_gpu_unsupported(call) if device.is_hopper else "needs a Hopper GPU",
        "cudnn": compositions.cudnn_unsupported(q, k, v, call.causal, segment_ids, device.platform),
    }
    if why_not["pallas_gpu"] is None:
        measured = HOPPER_MS.get((call.op, d, dv, call.causal)) if why_not["cudnn"] is None else None
        if measured:
            return tuple(_faster(call, measured, p) for p in PASSES)
        return (("pallas_gpu", "fused Mosaic GPU kernel"),) * 2
    if why_not["cudnn"] is None:
        return (("cudnn", f"cuDNN flash composition; pallas_gpu {why_not['pallas_gpu']}"),) * 2
    why_not["triton"] = compositions.triton_unsupported(q, k, v, call.causal, segment_ids, device.platform,
                                                        window=call.window)
    if why_not["triton"] is None:
        return (("triton", f"Pallas Triton flash composition; pallas_gpu {why_not['pallas_gpu']}; cudnn "
                           f"{why_not['cudnn']}"),) * 2
    return (("xla", "; ".join(f"{name} {why}" for name, why in why_not.items())),) * 2


def _faster(call: AttentionCall, measured: dict[str, dict[str, float]], pass_: str) -> tuple[str, str]:
    """(impl, why): the one of pallas_gpu and cuDNN HOPPER_MS measured faster in this pass; differentiated, with
    its forward once more where the backward does not find the forward's residuals saved (call.saved)."""
    def ms(impl):
        kept = call.saved == "all" or (call.saved == "named" and (impl, call.op) in KEPT_BY_NAME)
        return round(measured[pass_][impl] + (measured["fwd"][impl] if pass_ == "fwd+bwd" and not kept else 0.0), 2)

    impl, other = sorted(("pallas_gpu", "cudnn"), key=ms)
    what = {"pallas_gpu": "fused Mosaic GPU kernel", "cudnn": "cuDNN flash composition"}[impl]
    rerun = ", with the forward its backward runs again where remat saves none of it" * (pass_ == "fwd+bwd" and
                                                                                         call.saved != "all")
    return impl, f"{what}, measured faster {pass_} on Hopper{rerun} ({ms(impl)} vs {ms(other)} ms at T 8192)"
