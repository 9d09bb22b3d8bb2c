"""The route of an attention call, and why: which impl runs it, whether per query chunk over the mesh's context
axis, whether the XLA path runs blockwise. A pure function of the call's shapes, the context axis' size and the
device, so "what would `auto` do on an H100 for these shapes" needs no H100 (`python -m diffjax.ops --config ...
--device h100 --context 2` prints it for a model's every attention call).

`choose(call, impl, device) -> Route`; an explicit impl that cannot run the call is a ValueError naming the impl,
the shapes and what to use instead. diffjax.ops' diff_attention / dot_product_attention (and so the KV cache's
decode step) call it with `current_device()`: the running device, or the one `simulated_device` sets (tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from diffjax.attention_impls import IMPLS
from diffjax.ops import compositions, context_parallel
from diffjax.ops.reference import check_window

# (op, d, dv, causal) where the cuDNN composition was measured faster than pallas_gpu on Hopper (fwd+bwd,
# bf16, T = 8192): for these "auto" takes cuDNN when cuDNN takes the call (no segment ids; packed training
# batches keep pallas_gpu). H100, jax 0.11.2, 2026-11-26 (benchmarks/results/attention_gpu.json), TFLOP/s
# pallas_gpu vs cuDNN: diff d 128 / dv 256 causal 357 vs 368, non-causal 376 vs 433; standard attention
# (the single-map mode) d 128 causal 352 vs 469, non-causal 406 vs 566. pallas_gpu's forward alone is faster
# in three of the four (1.18-1.39x; single-map non-causal 0.97x): the backward decides.
CUDNN_FASTER_ON_HOPPER: frozenset[tuple[str, int, int, bool]] = frozenset({
    ("diff_attention", 128, 256, True), ("diff_attention", 128, 256, False),
    ("dot_product_attention", 128, 128, True), ("dot_product_attention", 128, 128, False),
})
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
# The best pallas_gpu Tuning per shape class, measured on a Hopper GPU by benchmarks/pallas_gpu_sweep.py --table
# (copied here from a GPU session's output); absent: pallas_gpu.default_tuning's shared-memory rule alone.
TUNING_TABLE = Path(__file__).with_name("pallas_gpu_tuning.json")
TPU_MIN_T = 128  # below one Pallas TPU block, auto takes xla


@dataclasses.dataclass(frozen=True)
class Device:
    platform: str  # "cpu" | "gpu" | "tpu", as jax.default_backend() names it
    kind: str  # jax's device_kind, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite"

    @property
    def is_hopper(self) -> bool:
        return self.platform == "gpu" and any(name in self.kind for name in HOPPER_KINDS)


DEVICES = {  # short names for the command line and tests
    "cpu": Device("cpu", "cpu"),
    "h100": Device("gpu", "NVIDIA H100 80GB HBM3"),
    "h200": Device("gpu", "NVIDIA H200"),
    "a100": Device("gpu", "NVIDIA A100-SXM4-80GB"),
    "l4": Device("gpu", "NVIDIA L4"),
    "v5e": Device("tpu", "TPU v5 lite"),
    "v5p": Device("tpu", "TPU v5p"),
    "v6e": Device("tpu", "TPU v6 lite"),
}


_SIMULATED: contextvars.ContextVar[Device | None] = contextvars.ContextVar("simulated_device", default=None)


def current_device() -> Device:
    """The device calls are routed for: the one `simulated_device` sets, else the running one."""
    return _SIMULATED.get() or Device(jax.default_backend(), jax.devices()[0].device_kind)


@contextlib.contextmanager
def simulated_device(device: Device):
    """Route the attention calls traced inside as on `device` (e.g. DEVICES["h100"]), whatever runs them: tests of
    the dispatch on a machine without that device. The kernels still run as the running device can (interpreted
    off their platform)."""
    token = _SIMULATED.set(device)
    try:
        yield device
    finally:
        _SIMULATED.reset(token)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """An attention op call by its shapes: q [B, T, H, 2, d] (diff_attention) or [B, T, H, d]
    (dot_product_attention), k [B, S, Hkv, G, d] or [B, S, Hkv, d], v [B, S, Hkv, dv]. segments: None, "one"
    (one [B, T] id array, T == S) or "pair" (q ids and kv ids: decoding against a cache). window: None or the
    sliding window's keys per query. context: the size of the mesh's context axis the call runs under (1: none)."""

    op: str
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    dtype: str
    causal: bool = True
    segments: str | None = None
    window: int | None = None
    context: int = 1

    @classmethod
    def of(cls, op, q, k, v, causal, segment_ids, window=None, context=1) -> "AttentionCall":
        check_window(window, causal)
        segments = None if segment_ids is None else "pair" if isinstance(segment_ids, (tuple, list)) else "one"
        return cls(op, tuple(q.shape), tuple(k.shape), tuple(v.shape), jnp.dtype(q.dtype).name, bool(causal), segments,
                   None if window is None else int(window), int(context))

    def arrays(self):
        """(q, k, v, segment_ids) as ShapeDtypeStructs: what the kernels' `unsupported` checks read."""
        sds = jax.ShapeDtypeStruct
        B, T, S = self.q_shape[0], self.q_shape[1], self.k_shape[1]
        ids = {None: None, "one": sds((B, T), jnp.int32), "pair": (sds((B, T), jnp.int32), sds((B, S), jnp.int32))}
        return (sds(self.q_shape, self.dtype), sds(self.k_shape, self.dtype), sds(self.v_shape, self.dtype),
                ids[self.segments])

    @property
    def is_decode(self) -> bool:
        """One query per row against a KV cache's slots (q / kv segment ids)."""
        return self.segments == "pair" and self.q_shape[1] == 1

    def describe(self) -> str:
        ids = {None: "", "one": ", segment ids", "pair": ", q / kv segment ids"}[self.segments]
        window = "" if self.window is None else f", window {self.window}"
        context = "" if self.context == 1 else f", context axis of {self.context}"
        return (f"{self.op} q {list(self.q_shape)} k {list(self.k_shape)} v {list(self.v_shape)} {self.dtype}"
                f"{', causal' if self.causal else ''}{ids}{window}{context}")


@dataclasses.dataclass(frozen=True)
class Route:
    """How diffjax.ops runs a call. impl: the implementation that runs it. context: per query chunk over the
    mesh's context axis (K/V all-gathered; impl pallas_tpu / pallas_gpu: the fused kernels with the chunk's place
    in the sequence as their query offset, else blockwise XLA). blockwise: the XLA path attends blockwise (online
    softmax over key blocks, flash-style backward: context_parallel.blockwise_attention) instead of materialising
    the T x S scores. reason: why."""

    impl: str
    context: bool
    blockwise: bool
    reason: str

    def describe(self) -> str:
        path = f"{self.impl} blockwise" if self.blockwise else self.impl
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
    impl, reason = _auto(call, device) if impl == "auto" else _asked_for(call, impl, device)
    why_blockwise = _why_xla_runs_blockwise(call) if impl == "xla" else None
    if why_blockwise:
        return Route(impl, context=False, blockwise=True, reason=f"{reason}; blockwise: {why_blockwise}")
    return Route(impl, context=False, blockwise=False, reason=reason)


def _over_the_context_axis(call: AttentionCall, impl: str, device: Device) -> Route:
    """Over a context axis only the fused kernels take a query chunk's offset; every other impl attends blockwise in
    XLA. So "auto" takes the fused kernels wherever they run the call, with none of its single-device preferences:
    TPU_MIN_T and CUDNN_FASTER_ON_HOPPER weigh a kernel against the XLA reference and cuDNN, and over a context
    axis the alternative is blockwise XLA."""
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


def _auto(call: AttentionCall, device: Device) -> tuple[str, str]:
    T, d, dv = call.q_shape[1], call.q_shape[-1], call.v_shape[-1]
    if call.is_decode:
        return "xla", "decode: one query against the KV cache (no fused decode kernel yet)"
    if device.platform == "tpu":
        return ("pallas_tpu", "fused Pallas TPU kernel") if T >= TPU_MIN_T else ("xla", f"T={T} < {TPU_MIN_T} is below one kernel block")
    if device.platform != "gpu":
        return "xla", f"platform {device.platform!r} has no compiled flash kernel (the Pallas impls would run interpreted)"
    q, k, v, segment_ids = call.arrays()
    why_not = {
        "pallas_gpu": pallas_gpu_unsupported(call) if device.is_hopper else "needs a Hopper GPU",
        "cudnn": compositions.cudnn_unsupported(q, k, v, call.causal, segment_ids, device.platform),
    }
    if why_not["pallas_gpu"] is None:
        if why_not["cudnn"] is None and (call.op, d, dv, call.causal) in CUDNN_FASTER_ON_HOPPER:
            return "cudnn", "cuDNN flash composition, measured faster than pallas_gpu for this shape"
        return "pallas_gpu", "fused Mosaic GPU kernel"
    if why_not["cudnn"] is None:
        return "cudnn", "cuDNN flash composition"
    why_not["triton"] = compositions.triton_unsupported(q, k, v, call.causal, segment_ids, device.platform,
                                                        window=call.window)
    if why_not["triton"] is None:
        return "triton", f"Pallas Triton flash composition; cudnn {why_not['cudnn']}"
    return "xla", "; ".join(f"{name} {why}" for name, why in why_not.items())


def tuning_class(d: int, dv: int, single: bool, dtype) -> str:
    """The shape class a swept pallas_gpu Tuning is kept under, e.g. "diff d128 dv256 bfloat16"."""
    return f"{'single' if single else 'diff'} d{d} dv{dv} {jnp.dtype(dtype).name}"


def swept_tuning(d: int, dv: int, single: bool, dtype, table: Path | None = None) -> dict | None:
    """The Tuning fields benchmarks/pallas_gpu_sweep.py measured best for this shape class on a Hopper GPU (the
    table `table`, default TUNING_TABLE), or None: no table, no entry, or a table from a dry run / another GPU."""
    table = TUNING_TABLE if table is None else Path(table)
    if not table.exists():
        return None
    try:
        content = json.loads(table.read_text())
        entry = content["best"].get(tuning_class(d, dv, single, dtype))
        measured = not content.get("dry_run") and any(kind in content["device"] for kind in HOPPER_KINDS)
        return dict(entry["tuning"]) if entry is not None and measured else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{table}: not a pallas_gpu tuning table as benchmarks/pallas_gpu_sweep.py --table writes "
                         f"(device, best: {{class: {{tuning: {{...}}}}}}): {type(e).__name__}: {e}") from None
