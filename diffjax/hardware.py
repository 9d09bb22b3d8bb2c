"""The hardware diffjax knows by name, one row each (jax-free): `--device NAME` of `diffjax-train --plan` and
`--routes`, diffjax.ops.DEVICES (the device `auto` routes for), the chips `--topology` names (diffjax.train.topologies)
and the memory plan's budget (diffjax.train.plan) all read this table, so `diffjax-train --help` lists it without
loading jax.

A row: the `Device` (platform and kind, as jax reports them: what a route depends on), the memory as sold in GB (what
`--help` says; None: the host's), and the bytes of it one program may have (the plan's; None: the host's). Those
bytes: the H100's as JAX reports it (bytes_limit 63,763,906,560 at the default fraction 0.75,
benchmarks/results/train_step_gpu_4096_attention.json), the A100 40 GB's as nvidia-smi does (40,536 MiB); a TPU's the
HBM libtpu lets a program have (its out-of-memory error's "available HBM", libtpu 0.0.42.1: v5p 95.74G, G = 2^30
bytes); the others from their specifications. Each name is one memory size (a100: the 80 GB A100).
"""

from __future__ import annotations

import dataclasses

GiB = 2**30
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}  # jax.default_backend()'s names for what a device's platform may say


@dataclasses.dataclass(frozen=True)
class Device:
    """A device as a route depends on it (diffjax.ops.choose): its platform and jax's device kind."""

    platform: str  # "cpu" | "gpu" | "tpu", as jax.default_backend() names it
    kind: str  # jax's device_kind, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite"

    @classmethod
    def of(cls, device) -> "Device":
        """The Device of a jax device (a topology's too) or a jax.sharding.AbstractDevice."""
        return cls(_PLATFORMS.get(device.platform, device.platform), device.device_kind)

    @property
    def is_hopper(self) -> bool:
        return self.platform == "gpu" and any(name in self.kind for name in HOPPER_KINDS)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A row of TABLE (the module docstring)."""

    device: Device
    sold_gb: int | None  # its memory as sold, in GB (None: the host's)
    memory_bytes: float | None  # the memory one program may have on it (None: the host's)


# The TPU kinds are what jax reports for each generation's devices (a v5p is "TPU v5", a v5e "TPU v5 lite": read from
# libtpu's topologies, tests/test_aot.py checks them).
TABLE = {
    "cpu": Hardware(Device("cpu", "cpu"), None, None),
    "h100": Hardware(Device("gpu", "NVIDIA H100 80GB HBM3"), 80, 85_018_542_080),
    "h200": Hardware(Device("gpu", "NVIDIA H200"), 141, 141e9),
    "a100": Hardware(Device("gpu", "NVIDIA A100-SXM4-80GB"), 80, 85_018_542_080),
    "a100-40": Hardware(Device("gpu", "NVIDIA A100-SXM4-40GB"), 40, 42_505_273_344),
    "l4": Hardware(Device("gpu", "NVIDIA L4"), 24, 24e9),
    "v4": Hardware(Device("tpu", "TPU v4"), 32, 30.75 * GiB),
    "v5p": Hardware(Device("tpu", "TPU v5"), 95, 95.74 * GiB),
    "v5e": Hardware(Device("tpu", "TPU v5 lite"), 16, 15.75 * GiB),
    "v6e": Hardware(Device("tpu", "TPU v6 lite"), 32, 31.25 * GiB),
}
DEVICES = {name: row.device for name, row in TABLE.items()}  # short names for the command line and tests
