"""Compiling for hardware that is not here: TPU slices through libtpu's topologies, H100s through JAX's CUDA plugin
compiling deviceless. Nothing runs on the target: a compile says that the program builds for that chip and how much
memory XLA gives it per device; it says nothing of speed.

    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: this machine runs nothing of it
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from diffjax.ops import aot

    target = aot.target("v5e")                 # 4 "TPU v5 lite" devices; "v5p:4x4x4", "v4", "v6e:2x4", "h100x8"
    mesh = target.mesh((4,), ("fsdp",))        # a jax Mesh of the target's devices
    x = jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    with aot.compile_for(target):              # or compile_for(mesh)
        compiled = jax.jit(f).lower(x).compile()
    compiled.memory_analysis()                 # per device: arguments, outputs, temporaries, generated code
    aot.kernel_calls(compiled.as_text())       # the Pallas kernels in the program, by name

Inside `compile_for` the attention ops see the target as the device they are compiled for (diffjax.ops.target):
`auto` routes as on that chip, the Pallas kernels compile (Mosaic TPU / Mosaic GPU) instead of running interpreted,
and jax's Mosaic lowering reads the chip's generation. It sets only the abstract mesh's device, around tracing and
lowering: eager code inside still runs on this machine (a topology's devices cannot run anything, so they must never
become the default device). Attention over a mesh of several devices runs its kernels per device under
diffjax.sharding.activation_sharding(mesh), as the train step does (XLA cannot partition a Pallas call).

Needs: for a TPU, libtpu at the installed jax's version (`pip install "jax[tpu]==<jax's version>"`, or diffjax's
`aot` extra); for an H100, JAX's CUDA plugin at jax's version and a ptxas (`missing(platform)` names the command).
No TPU or GPU is needed for either.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import os
import re

import jax
import numpy as np

from diffjax import jax_compat
from diffjax.hardware import DEVICES, Device

# generation (its device kind: diffjax.hardware's row of that name): (the default topology: one host's slice, the
# chip configuration). v4 and v5p run as megacore (one device per chip, two cores), as jax sees them on a real host.
TPU_GENERATIONS = {
    "v4": ("2x2x1", "megacore"),
    "v5e": ("2x2", "default"),
    "v5p": ("2x2x1", "default"),
    "v6e": ("2x2", "default"),
}
# What XLA needs to compile for an absent GPU (a GpuTargetConfigProto; fields of xla's specs/h100_sxm.txtpb).
GPU_TARGET_CONFIGS = {
    "h100": """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
""",
}
# An H200 is an H100's SM90 with 141 GB of HBM3e at 4.8 TB/s (NVIDIA's data sheet: 143,771 MiB as the driver reports).
GPU_TARGET_CONFIGS["h200"] = (GPU_TARGET_CONFIGS["h100"]
                              .replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 4800000000000")
                              .replace("device_memory_size: 84942979072", "device_memory_size: 150754820096")
                              .replace("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
# The custom call each platform's Pallas kernels compile to (compiled HLO text).
KERNEL_CALL_TARGETS = {"tpu": "tpu_custom_call", "gpu": "mosaic_gpu"}


@dataclasses.dataclass(frozen=True)
class Target:
    """Hardware to compile for: `name` ("v5e:2x2", "h100x8") and its devices (jax devices that compile, never run)."""

    name: str
    devices: tuple

    @property
    def device(self) -> Device:
        """Its devices' platform and kind, as diffjax.ops routes by them."""
        return Device.of(self.devices[0])

    def mesh(self, shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] = ("devices",)):
        """A Mesh of all the devices (default: one axis over them), laid out on the topology as jax lays out a real
        slice's (mesh_utils.create_device_mesh: neighbours on the fast links)."""
        from jax.experimental import mesh_utils

        shape = (len(self.devices),) if shape is None else tuple(shape)
        if int(np.prod(shape)) != len(self.devices):
            raise ValueError(f"mesh shape {shape} has {int(np.prod(shape))} devices; target {self.name} has "
                             f"{len(self.devices)}")
        return jax.sharding.Mesh(mesh_utils.create_device_mesh(shape, list(self.devices)), axis_names)


def missing(platform: str) -> str | None:
    """What to install to compile for `platform` ("tpu" or "gpu") here, in one line; None when nothing is missing."""
    if platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            return (f"compiling for a TPU needs libtpu: pip install 'jax[tpu]=={jax.__version__}' (or diffjax's "
                    "extra: pip install 'diffjax[aot]')")
        return None
    if platform != "gpu":
        raise ValueError(f"platform must be 'tpu' or 'gpu', got {platform!r}")
    if why := cuda_plugin_missing():
        return why
    if cuda_tool("ptxas") is None:
        return ("compiling for an H100 needs ptxas: pip install nvidia-cuda-nvcc-cu12, or put a CUDA toolkit's bin/ "
                "on PATH")
    return None


def cuda_plugin_missing() -> str | None:
    """The pip command for JAX's CUDA plugin at jax's version where it is absent (it compiles for a GPU without one)."""
    if importlib.util.find_spec("jax_plugins") and any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}")
                                                        for v in (12, 13)):
        return None
    return (f"compiling for an H100 needs JAX's CUDA plugin: pip install 'jax-cuda12-plugin=={jax.__version__}' "
            f"'jax-cuda12-pjrt=={jax.__version__}' nvidia-cuda-nvcc-cu12 (or diffjax's extra: pip install "
            "'diffjax[aot]')")


def cuda_tool(name: str = "ptxas") -> str | None:
    """A CUDA tool (ptxas, nvdisasm) as XLA and Mosaic GPU find it: on PATH, else pip's nvidia-cuda-nvcc-cu12 (CUDA
    13's nvidia/cu13) bin/."""
    import shutil

    if shutil.which(name):
        return shutil.which(name)
    has_nvidia = importlib.util.find_spec("nvidia") is not None
    packages = [importlib.util.find_spec(p) for p in ("nvidia.cuda_nvcc", "nvidia.cu13")] if has_nvidia else []
    dirs = [os.path.join(d, "bin") for spec in packages if spec for d in spec.submodule_search_locations or []]
    return next((os.path.join(d, name) for d in dirs if os.path.isfile(os.path.join(d, name))), None)


def target(name: str, num_slices: int = 1) -> Target:
    """The Target `name` names: a TPU generation with an optional topology ("v5e" = "v5e:2x2", "v5p:4x4x4", "v4",
    "v6e:2x4"; TPU_GENERATIONS) over `num_slices` slices, or GPUs ("h100" = "h100x1", "h100x8"; GPU_TARGET_CONFIGS).
    A ValueError names what is allowed; a RuntimeError names what to install where libtpu or the CUDA plugin is
    absent."""
    generation, _, topology = name.partition(":")
    if generation in TPU_GENERATIONS:
        return tpu_target(generation, topology or None, num_slices)
    gpu = re.fullmatch(r"([a-z]\w*?)(?:x(\d+))?", name)
    if gpu and gpu.group(1) in GPU_TARGET_CONFIGS and num_slices == 1:
        return gpu_target(int(gpu.group(2) or 1), gpu.group(1))
    raise ValueError(f"target {name!r}: a TPU generation {sorted(TPU_GENERATIONS)} with an optional ':topology' "
                     f"(e.g. 'v5p:2x2x1'), or a GPU {sorted(GPU_TARGET_CONFIGS)} with an optional 'xCOUNT' (e.g. "
                     "'h100x8')")


def tpu_target(generation: str, topology: str | None = None, num_slices: int = 1) -> Target:
    """`num_slices` slices of `topology` chips ("2x2", "4x4x4"; default TPU_GENERATIONS') of a TPU generation, from
    libtpu (no TPU needed)."""
    if generation not in TPU_GENERATIONS:
        raise ValueError(f"TPU generation must be one of {sorted(TPU_GENERATIONS)}, got {generation!r}")
    kind, (default, chip_config) = DEVICES[generation].kind, TPU_GENERATIONS[generation]
    topology = topology or default
    dims = topology.split("x")
    if not all(d.isdigit() and int(d) > 0 for d in dims) or len(dims) not in (2, 3):
        raise ValueError(f"TPU topology must be chips per dimension, e.g. '2x2' or '4x4x4', got {topology!r}")
    if why := missing("tpu"):
        raise RuntimeError(why)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask: this is not a TPU VM
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: other processes may hold libtpu too
    from jax.experimental import topologies

    host = tuple(min(int(d), 2) for d in dims) + (1,) * (3 - len(dims))  # a host holds up to 2 x 2 chips
    devices = topologies.get_topology_desc(platform="tpu", topology_name=f"{generation}:{topology}",
                                           chip_config_name=chip_config, chips_per_host_bounds=host,
                                           num_slices=num_slices).devices
    name = f"{generation}:{topology}" + (f" x {num_slices} slices" if num_slices > 1 else "")
    if devices[0].device_kind != kind:
        raise RuntimeError(f"libtpu describes {name} as {devices[0].device_kind!r}, not {kind!r}: "
                           "diffjax.hardware's row needs its kind")
    return Target(name, tuple(devices))


def gpu_target(count: int = 1, gpu: str = "h100") -> Target:
    """`count` GPUs (GPU_TARGET_CONFIGS' descriptions, up to 8 a host) through XLA's deviceless CUDA compiler."""
    if gpu not in GPU_TARGET_CONFIGS:
        raise ValueError(f"GPU must be one of {sorted(GPU_TARGET_CONFIGS)}, got {gpu!r}")
    if count < 1 or (count > 8 and count % 8):
        raise ValueError(f"GPU count must be 1 to 8, or a multiple of 8 (hosts of 8), got {count}")
    if why := missing("gpu"):
        raise RuntimeError(why)
    from jax.experimental import topologies

    hosts, per_host = (count // 8, 8) if count > 8 else (1, count)
    devices = topologies.get_topology_desc(platform="cuda", topology_name="cuda",
                                           target_config=GPU_TARGET_CONFIGS[gpu],
                                           topology=f"1x{hosts}x{per_host}").devices
    return Target(f"{gpu}x{count}", tuple(devices))


@contextlib.contextmanager
def compile_for(where):
    """Around `jax.jit(...).lower(...)` / `.compile()`: calls traced inside are compiled for `where` (a Target, a
    Mesh, a device or devices), as the module docstring says."""
    devices = (where.devices if isinstance(where, (Target, jax.sharding.Mesh)) else
               where if isinstance(where, (list, tuple)) else [where])
    first = np.asarray(devices, dtype=object).flat[0]
    current = jax.sharding.get_abstract_mesh()
    wanted = jax_compat.abstract_device_of(first)
    if not current.empty:  # under jax.set_mesh: its mesh already carries its device
        if current.abstract_device != wanted:
            raise ValueError(f"compile_for({Device.of(first).kind!r}) inside a mesh of {current.abstract_device}")
        yield
        return
    with jax_compat.lowering_device(wanted):
        yield


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One Pallas kernel call of a compiled program: its pallas_call's `name`, its `op_name` (the named scopes and
    transformations it was traced under, e.g. "jit(f)/case/transpose(jvp(diffjax_flash_fwd_m2))/pallas_call") and, for
    a Mosaic TPU kernel, the scoped VMEM libtpu gave it (its used_scoped_memory_configs; None elsewhere)."""

    name: str
    op_name: str
    scoped_vmem_bytes: int | None = None

    def within(self, scope: str) -> bool:
        """Whether it was traced under `jax.named_scope(scope)`."""
        return re.search(rf"(?:^|[/(]){re.escape(scope)}(?:[)/]|$)", self.op_name) is not None


def compiled_kernels(hlo_text: str) -> list[KernelCall]:
    """The Pallas kernels (Mosaic TPU's and Mosaic GPU's custom calls) of a compiled program's HLO text
    (`compiled.as_text()`), in its order."""
    targets = "|".join(re.escape(t) for t in KERNEL_CALL_TARGETS.values())
    calls = []
    for line in hlo_text.splitlines():
        if not re.search(rf'custom_call_target="(?:{targets})', line):
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        op_name = op_name.group(1) if op_name else ""
        # the part before the call's own ("pallas_call" / "mpmd_map"), without the transformations around it
        name = re.sub(r"^(?:[\w-]+\()+|\)+$", "", op_name.split("/")[-2]) if op_name.count("/") else "?"
        vmem = re.search(r'"used_scoped_memory_configs":\[([^\]]*)\]', line)
        vmem = sum(int(size) for size in re.findall(r'"size":"(\d+)"', vmem.group(1))) if vmem else None
        calls.append(KernelCall(name, op_name, vmem))
    return calls


def kernel_calls(hlo_text: str, scope: str | None = None) -> collections.Counter:
    """{kernel name: calls} of compiled_kernels(hlo_text); with `scope`, only those traced under
    `jax.named_scope(scope)`."""
    return collections.Counter(call.name for call in compiled_kernels(hlo_text) if scope is None or call.within(scope))
