"""Hardware by name, as its vendor spells it: `--topology v5p-128` (a TPU slice), `2xv5p-256` (two slices),
`h100x64` (64 GPUs, 8 a host). Pure (no jax): what `diffjax-train --plan --compile --topology NAME` compiles for.

Cloud TPU names v4 and v5p slices by TensorCores (2 a chip: v5p-8 is 4 chips, 4 jax devices) and v5e / v6e slices
by chips (v5e-8 is 8 chips); a slice's chips form the grid Cloud TPU documents (v5p-128: 4x4x4, v5e-8: 2x4).
"""

from __future__ import annotations

import dataclasses
import math
import re

from diffjax.config_values import did_you_mean


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    chip: str  # the chip's name in diffjax.hardware and in jax's topology names (v5p:4x4x4)
    cores_in_name: bool  # Cloud TPU counts TensorCores (2 a chip) in the slice's name
    grid_dims: int  # 3: a torus of chips (v4, v5p); 2: a plane (v5e, v6e)
    chip_counts: tuple[int, ...]  # the slice sizes in chips this parser takes

    def named_count(self, chips: int) -> int:
        """The N of a slice of `chips` chips in its name (v5p-N: 2 a chip; v5e-N: N chips)."""
        return chips * (2 if self.cores_in_name else 1)


TPU_GENERATIONS = {
    "v4": TpuGeneration("v4", True, 3, tuple(2**k for k in range(2, 13))),
    "v5p": TpuGeneration("v5p", True, 3, tuple(2**k for k in range(2, 13))),
    "v5e": TpuGeneration("v5e", False, 2, (1, 4, 8, 16, 32, 64, 128, 256)),
    "v6e": TpuGeneration("v6e", False, 2, (1, 4, 8, 16, 32, 64, 128, 256)),
}
GPUS = ("h100", "h200")
GPUS_PER_HOST = 8
ACCEPTED = ("v4-N and v5p-N (N TensorCores, 2 a chip: v5p-8 = 4 chips), v5e-N and v6e-N (N chips: 1, 4, 8, ..., 256), "
            "MxNAME for M slices (2xv5p-256), h100xN and h200xN (N GPUs: up to 8, or a multiple of 8)")


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as given (Cloud TPU's spelling, or h100x64)
    platform: str  # "tpu" | "gpu"
    chip: str  # a diffjax.hardware name: v5p, v5e, h100, ...
    grid: tuple[int, ...]  # one slice's chips (TPU: 4x4x4, 2x4); GPU: (hosts, GPUs a host)
    num_slices: int = 1

    @property
    def devices_per_slice(self) -> int:
        return math.prod(self.grid)

    @property
    def devices(self) -> int:
        """jax devices in all (a TPU chip is one device: v4 and v5p's two cores act as one)."""
        return self.num_slices * self.devices_per_slice

    @property
    def grid_name(self) -> str:
        return "x".join(map(str, self.grid))

    def describe(self) -> str:
        slices = f"{self.num_slices} slices of " if self.num_slices > 1 else ""
        unit = "chips" if self.platform == "tpu" else "GPUs"
        where = f"{self.grid_name} {unit}" if self.platform == "tpu" else f"{self.grid[0]} host(s) x {self.grid[1]}"
        return f"{self.name}: {slices}{where}, {self.devices} {self.chip} device(s)"


def chip_grid(chips: int, dims: int) -> tuple[int, ...]:
    """Cloud TPU's grid for a slice of `chips` chips: from 2x2(x1), the last of the smallest sides doubles (v5p:
    8 -> 2x2x2, 32 -> 2x4x4, 128 -> 4x4x8; v5e: 8 -> 2x4, 128 -> 8x16)."""
    if chips == 1:
        return (1,) * dims
    grid = [2, 2] + [1] * (dims - 2)
    while math.prod(grid) < chips:
        smallest = min(grid)
        grid[max(i for i, side in enumerate(grid) if side == smallest)] *= 2
    return tuple(grid)


_TPU = re.compile(r"(?:(\d+)x)?(v\d+[a-z]*)-(\d+)")
_GPU = re.compile(r"([a-z]\d+)x(\d+)")


def parse_topology(name: str) -> Topology:
    """The hardware `name` names; a ValueError of one line listing the accepted forms otherwise."""
    spelled = name.strip().lower().replace("v5litepod", "v5e")  # (v5litepod-8: the Cloud TPU API's v5e-8)
    if tpu := _TPU.fullmatch(spelled):
        slices, generation, count = int(tpu[1] or 1), tpu[2], int(tpu[3])
        if generation in TPU_GENERATIONS and slices >= 1:
            gen = TPU_GENERATIONS[generation]
            chips, odd = (count // 2, count % 2) if gen.cores_in_name else (count, 0)
            if not odd and chips in gen.chip_counts:
                return Topology(name, "tpu", gen.chip, chip_grid(chips, gen.grid_dims), slices)
            unit = "TensorCores, 2 a chip" if gen.cores_in_name else "chips"
            sizes = [gen.named_count(n) for n in gen.chip_counts]
            raise ValueError(f"--topology {name!r}: {generation} slices are {generation}-N with N {unit}, one of "
                             f"{', '.join(map(str, sizes))}")
    if gpu := _GPU.fullmatch(spelled):
        chip, count = gpu[1], int(gpu[2])
        if chip in GPUS and count >= 1 and (count <= GPUS_PER_HOST or count % GPUS_PER_HOST == 0):
            hosts = max(1, count // GPUS_PER_HOST)
            return Topology(name, "gpu", chip, (hosts, count // hosts))
    examples = ("v4-32", "v5p-8", "v5p-128", "v5e-8", "v6e-256", "2xv5p-256", "h100x8", "h100x64", "h200x8")
    raise ValueError(f"--topology {name!r} is not one this trainer knows; it takes {ACCEPTED}"
                     f"{did_you_mean(spelled, dict.fromkeys(examples + _near_names(spelled)))}")


def _near_names(spelled: str) -> tuple[str, ...]:
    """Valid names of the same generation or GPU as a misspelt one (v5p8 -> v5p-8): did_you_mean's candidates."""
    names = []
    for generation, gen in TPU_GENERATIONS.items():
        if generation in spelled:
            names += [f"{generation}-{gen.named_count(n)}" for n in gen.chip_counts]
    for chip in GPUS:
        if chip in spelled:
            names += [f"{chip}x{n}" for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    return tuple(names)
