"""Read and write safetensors files with numpy, bfloat16 included (via ml_dtypes), without torch.

The safetensors library's numpy backend rejects bfloat16, and its jax backend copies every
tensor onto the device. Here a file is read one tensor at a time (so a converter holds one
tensor of the source, not a whole shard) and written one tensor at a time (the header is
computed from shapes first, so no shard is ever assembled in memory).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """({name: {"dtype", "shape", "data_offsets"}}, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > os.path.getsize(path):
            raise ValueError(f"{path}: not a safetensors file (header length {header_len} exceeds the file size)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"{path}: not a safetensors file (its header is not valid JSON: {error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is a JSON {type(header).__name__}, not an object)")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= set(info)):
            raise ValueError(f"{path}: not a safetensors file (the header entry of {name!r} is {info!r})")
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}; supported: {sorted(_DTYPES)}")
    return header, 8 + header_len


def read_tensor(path: str | os.PathLike, info: dict, data_start: int) -> np.ndarray:
    """One tensor, memory-mapped read-only on its own: its pages leave memory when the array is
    dropped (a heap copy would leave the allocator holding freed buffers between tensors)."""
    start, end = info["data_offsets"]
    if data_start + end > os.path.getsize(path):
        raise ValueError(f"{path}: truncated file (tensor data ends before byte {data_start + end})")
    if end == start:
        return np.zeros(info["shape"], _DTYPES[info["dtype"]])
    return np.memmap(path, dtype=_DTYPES[info["dtype"]], mode="r", offset=data_start + start, shape=tuple(info["shape"]))


def write_safetensors(
    path: str | os.PathLike,
    entries: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write the tensors `entries` (name, shape, dtype), calling `produce(name)` for each one in
    turn and writing it before asking for the next. Returns the number of data bytes written."""
    entries = list(entries)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype in entries:
        dtype = np.dtype(dtype)
        if dtype not in _CODES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be written to safetensors")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape, dtype in entries:
            array = np.ascontiguousarray(produce(name))
            if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
                raise ValueError(f"tensor {name!r}: produced {array.dtype}{tuple(array.shape)}, planned {np.dtype(dtype)}{tuple(shape)}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
            del array
    return offset
