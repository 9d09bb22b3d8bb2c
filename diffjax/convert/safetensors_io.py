"""Read safetensors files into numpy without torch, bfloat16 included (via ml_dtypes).

The safetensors library's numpy backend rejects bfloat16, and its jax backend copies every
tensor onto the device; this reader memory-maps the file and hands out numpy views.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """name -> array (read-only, memory-mapped) for every tensor in one .safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}; supported: {sorted(_DTYPES)}")
        start, end = info["data_offsets"]
        tensors[name] = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors
