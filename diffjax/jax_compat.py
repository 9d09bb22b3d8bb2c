"""What differs between the JAX versions diffjax supports, in one place.

Tested range: jax 0.10.2 (the oldest: CI's Python 3.11 leg) to 0.12.x (the newest: CI's Python 3.13 leg;
what Python 3.12+ installs). The GPU image diffjax's GPU runs use has 0.11.2. `pyproject.toml` pins the
same range; `check_jax_version()` (called when diffjax is imported) refuses an older jax and warns once
for a newer one, in one line, before any kernel module is loaded.

The differences themselves:
- Mosaic GPU `plgpu.load`: 0.10 takes a required `idx` (pass `()` for the whole ref); 0.11+ has none.
- Mosaic GPU interpret mode: `plgpu.InterpretGPUParams` from 0.11; 0.10 keeps it in a private module.
- Lowering for an accelerator that is not present: from 0.12 the Pallas Triton lowering reads the GPU's
  compute capability from the device, so without a GPU it needs an abstract one
  (`jax.sharding.use_abstract_mesh` with an `AbstractDevice`), as Pallas TPU lowering always did.
  `lowering_target` / `lowering_device` give that context for every version.

This module imports only the standard library at import time (jax where a function needs it), so the
version check runs before JAX itself is imported.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import re
import warnings

OLDEST_JAX = (0, 10, 2)  # CI's Python 3.11 leg
FIRST_UNTESTED_JAX = (0, 13)  # CI's newest leg runs 0.12.x
SUPPORTED_JAX = ">=0.10.2,<0.13"  # as pyproject.toml pins it


class UntestedJaxWarning(UserWarning):
    """jax is newer than the newest version diffjax's CI tests."""


def _release(version: str) -> tuple[int, ...]:
    """(0, 12, 0, 1) from '0.12.0.1'; pre-release / dev suffixes are dropped ('0.13.0.dev20261101' -> (0, 13, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("dev")[0].split("rc")[0])[:4])


def jax_version_problem(version: str) -> tuple[str, str] | None:
    """('old' | 'new', message) when `version` lies outside the tested range, else None."""
    release = _release(version)
    if release < OLDEST_JAX:
        return "old", (f"diffjax needs jax {SUPPORTED_JAX} (tested: 0.10.2 to 0.12.x); this environment has jax {version}. "
                       f"Upgrade: pip install -U 'jax{SUPPORTED_JAX}'")
    if release >= FIRST_UNTESTED_JAX:
        return "new", (f"diffjax is tested with jax {SUPPORTED_JAX}; jax {version} is newer and untested: the Pallas "
                       f"kernels (diffjax.ops) may fail to import or lower. pip install 'jax{SUPPORTED_JAX}' to be safe")
    return None


def check_jax_version(version: str | None = None) -> None:
    """ImportError for a jax older than the tested range, one UntestedJaxWarning for a newer one."""
    if version is None:
        try:
            version = importlib.metadata.version("jax")
        except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path, say
            import jax

            version = jax.__version__
    problem = jax_version_problem(version)
    if problem is None:
        return
    kind, message = problem
    if kind == "old":
        raise ImportError(message)
    warnings.warn(message, UntestedJaxWarning, stacklevel=3)


# ------------------------------------------------------------------------------ Mosaic GPU


def mosaic_gpu_load(plgpu, ref, layout):
    """`plgpu.load` of the whole ref in `layout`, on every supported version."""
    parameters = inspect.signature(plgpu.load).parameters
    if "idx" in parameters and parameters["idx"].default is inspect.Parameter.empty:  # jax 0.10
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def mosaic_gpu_interpret_params(plgpu):
    """The params that make a Mosaic GPU pallas_call run in interpret mode."""
    if hasattr(plgpu, "InterpretGPUParams"):  # jax >= 0.11
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret import params  # jax 0.10

    return params.InterpretGPUParams()


# ------------------------------------------------------------------------------ lowering without a device

LOWERING_PLATFORM = {"gpu": "cuda", "tpu": "tpu"}  # what `.lower(lowering_platforms=...)` calls them
H100 = "NVIDIA H100 80GB HBM3"  # device_kind strings as jax reports them


@contextlib.contextmanager
def lowering_target(device_kind: str = H100, platform: str = "gpu"):
    """Inside: `jitted.trace(...).lower(lowering_platforms=(platform_name,))` lowers for a `device_kind`
    device of `platform` ('gpu' or 'tpu') with no such device present. Yields the lowering platform name
    ('cuda' or 'tpu')."""
    from jax.sharding import AbstractDevice

    if platform not in LOWERING_PLATFORM:
        raise ValueError(f"platform must be one of {sorted(LOWERING_PLATFORM)}, got {platform!r}")
    with lowering_device(AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)):
        yield LOWERING_PLATFORM[platform]


@contextlib.contextmanager
def lowering_device(abstract_device):
    """Inside: calls are traced and lowered for `abstract_device` (a jax.sharding.AbstractDevice; a device's own:
    `abstract_device_of`): the abstract mesh carries it, with no axes, so shardings and eager ops are untouched
    (a topology's device cannot run code, so it must not become the default device)."""
    import jax
    from jax.sharding import AbstractMesh

    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=abstract_device)):
        yield


def abstract_device_of(device):
    """The jax.sharding.AbstractDevice of a jax device (a topology's too), as jax's own Mesh.abstract_mesh makes it
    (its num_cores: a TPU's cores, a GPU's SMs)."""
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array([device]), ("one",)).abstract_mesh.abstract_device
