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

import jax

from diffjax import sharding
from diffjax.hardware import Device


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
    """Route the attention calls traced inside as on `device` (e.g. diffjax.ops.DEVICES["h100"]), whatever runs
    them: tests of the dispatch on a machine without that device. The kernels still compile for `compile_device()`
    (interpreted off their platform)."""
    token = _SIMULATED.set(device)
    try:
        yield device
    finally:
        _SIMULATED.reset(token)
