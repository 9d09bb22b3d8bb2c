"""The device an attention call is compiled for: what the kernels compile for and what `auto` routes by.

Not the machine's first device: compiling ahead of time on a CPU for a TPU topology or a deviceless H100
(diffjax.ops.aot), the call is compiled for that hardware, and Pallas' Mosaic lowering asks the same question the
same way (jax's tpu_info.get_device_kind: the abstract mesh's device, then the default device). `compile_device()`:

1. the abstract mesh's device: `aot.compile_for(...)`, `jax.set_mesh(mesh)` with a mesh of real or topology devices,
   jax_compat.lowering_target, and the body of a jax.shard_map over such a mesh;
2. the first device of diffjax.sharding.activation_sharding's mesh (the train and eval steps trace under it);
3. jax's default device (`jax.default_device(...)`), else the first device.

The Pallas impls run compiled where that device is their platform's and interpreted elsewhere (CPU tests), and
`auto` routes by it, so compiling under a v5e topology here gives the Mosaic kernels `auto` picks on a v5e.
`current_device()` is what routes: `simulated_device(d)`'s device where one is set (tests of the route on a machine
without `d`: the kernels still compile, or run interpreted, as `compile_device()` says), else `compile_device()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

from diffjax import sharding

HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}  # jax.default_backend()'s names for what a device's platform may say


@dataclasses.dataclass(frozen=True)
class Device:
    platform: str  # "cpu" | "gpu" | "tpu", as jax.default_backend() names it
    kind: str  # jax's device_kind, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite"

    @classmethod
    def of(cls, device) -> "Device":
        """The Device of a jax device (a topology's too) or a jax.sharding.AbstractDevice."""
        return cls(_PLATFORMS.get(device.platform, device.platform), device.device_kind)

    @property
    def is_hopper(self) -> bool:
        return self.platform == "gpu" and any(name in self.kind for name in HOPPER_KINDS)


# Short names for the command line and tests; the TPU kinds are what jax reports for each generation's devices
# (a v5p is "TPU v5", a v5e "TPU v5 lite": read from libtpu's topologies, tests/test_aot_kernels.py checks them).
DEVICES = {
    "cpu": Device("cpu", "cpu"),
    "h100": Device("gpu", "NVIDIA H100 80GB HBM3"),
    "h200": Device("gpu", "NVIDIA H200"),
    "a100": Device("gpu", "NVIDIA A100-SXM4-80GB"),
    "a100-40": Device("gpu", "NVIDIA A100-SXM4-40GB"),
    "l4": Device("gpu", "NVIDIA L4"),
    "v4": Device("tpu", "TPU v4"),
    "v5e": Device("tpu", "TPU v5 lite"),
    "v5p": Device("tpu", "TPU v5"),
    "v6e": Device("tpu", "TPU v6 lite"),
}


def compile_device() -> Device:
    """The device the calls traced now are compiled for (the module docstring's order)."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return Device.of(abstract)
    mesh = sharding.active_mesh(single_device=True)
    if mesh is not None:
        return Device.of(mesh.devices.flat[0])
    return Device.of(_default_device())


def _default_device():
    default = jax.config.jax_default_device  # a device, a platform name or None
    if default is None or isinstance(default, str):
        return jax.devices(default)[0] if default else jax.devices()[0]
    return default


def interpreted(platform: str) -> bool:
    """Whether a Pallas kernel for `platform` ("tpu": Mosaic TPU, "gpu": Mosaic GPU / Triton) traced now runs in
    interpret mode: the device it is compiled for is not of that platform."""
    return compile_device().platform != platform


_SIMULATED: contextvars.ContextVar[Device | None] = contextvars.ContextVar("simulated_device", default=None)


def current_device() -> Device:
    """The device calls are routed for: the one `simulated_device` sets, else `compile_device()`."""
    return _SIMULATED.get() or compile_device()


@contextlib.contextmanager
def simulated_device(device: Device):
    """Route the attention calls traced inside as on `device` (e.g. DEVICES["h100"]), whatever runs them: tests of
    the dispatch on a machine without that device. The kernels still compile for `compile_device()` (interpreted
    off their platform)."""
    token = _SIMULATED.set(device)
    try:
        yield device
    finally:
        _SIMULATED.reset(token)
