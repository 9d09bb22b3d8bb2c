"""The weight files of a local Hugging Face directory, read one file and one tensor at a time.

safetensors first: `model.safetensors`, or the shards named by `model.safetensors.index.json`.
Only without any safetensors file are PyTorch `pytorch_model*.bin` files read, and only with
`torch.load(weights_only=True)`: a pickle that asks to build any other Python object (which is
how a malicious checkpoint runs code) is refused instead of executed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from diffjax.convert.common import ConversionError, to_numpy
from diffjax.convert.safetensors_io import read_header, read_tensor

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def _indexed_files(directory: Path, index_name: str) -> list[Path] | None:
    index = directory / index_name
    if not index.exists():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as error:
        raise ConversionError(f"{index}: not a valid index file (needs a 'weight_map' object): {error}") from None
    files = [directory / name for name in sorted(set(weight_map.values()))]
    if absent := [f.name for f in files if not f.exists()]:
        raise ConversionError(f"{index} names file(s) that do not exist: {absent}")
    return files


class HFWeights:
    """Names, shapes and values of the tensors in an HF directory's weight files."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        files = _indexed_files(self.directory, SAFE_INDEX)
        if files is None:
            files = sorted(self.directory.glob("model*.safetensors")) or sorted(self.directory.glob("*.safetensors"))
        self.format = "safetensors"
        if not files:
            files = _indexed_files(self.directory, BIN_INDEX) or sorted(self.directory.glob("pytorch_model*.bin"))
            self.format = "bin"
        if not files:
            raise FileNotFoundError(
                f"no .safetensors files (model.safetensors, or shards listed in {SAFE_INDEX}) and no PyTorch "
                f"pytorch_model*.bin files in {self.directory}"
            )
        self.files = files
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of every tensor, from the safetensors headers (or memory-mapped .bin files)."""
        if self._shapes is None:
            shapes: dict[str, tuple[int, ...]] = {}
            for file in self.files:
                for name, shape in self._file_shapes(file).items():
                    if name in shapes:
                        raise ConversionError(f"tensor {name!r} appears in more than one weight file (again in {file.name})")
                    shapes[name] = shape
            self._shapes = shapes
        return self._shapes

    def _file_shapes(self, file: Path) -> dict[str, tuple[int, ...]]:
        if self.format == "safetensors":
            header, _ = read_header(file)
            return {name: tuple(info["shape"]) for name, info in header.items()}
        return {name: tuple(t.shape) for name, t in load_torch_bin(file).items()}

    def tensors(self, file: Path) -> Iterator[tuple[str, np.ndarray]]:
        """(name, numpy array) for each tensor of one file, read one at a time."""
        if self.format == "safetensors":
            header, data_start = read_header(file)
            for name, info in header.items():
                yield name, read_tensor(file, info, data_start)
        else:
            state = load_torch_bin(file)
            for name in list(state):
                yield name, to_numpy(state.pop(name))
            del state  # releases the file's memory map


def load_torch_bin(file: Path) -> dict:
    """A PyTorch state_dict file, tensors only (weights_only=True), memory-mapped where the format allows."""
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch's own advice on the refusal below: ours is one line
            warnings.simplefilter("ignore")
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:  # files in the legacy (pre-zip) format cannot be memory-mapped
                if "mmap" not in str(error):
                    raise
                state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ConversionError(
            f"{file}: refused to load: the file holds Python objects other than tensors, and unpickling them could "
            "run code; convert a safetensors version of the checkpoint, or, only if you trust its source, load it "
            "in torch and save its tensors alone"
        ) from None
    if not isinstance(state, dict):
        raise ConversionError(f"{file}: expected a state_dict (a dict of tensors), found {type(state).__name__}")
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    bad = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise ConversionError(f"{file}: entries that are not tensors: {bad[:10]}")
    return state
