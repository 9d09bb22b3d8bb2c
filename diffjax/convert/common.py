"""Shared pieces of the converters: tensors to numpy, and assembling a model from named arrays."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

Path = tuple  # a parameter path in the NNX state, e.g. ("blocks", 0, "attn", "q_kernel")


def to_numpy(x) -> np.ndarray:
    """A torch tensor or array-like as numpy; bfloat16 torch tensors convert exactly (via float32)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            return x.float().numpy().astype(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def path_name(path: Path) -> str:
    return ".".join(str(p) for p in path)


def build_module(make_module, params: Mapping[Path, np.ndarray], dtype):
    """Instantiate `make_module()` abstractly and fill it with `params` (cast to `dtype`).

    Every parameter of the module must be given with exactly its shape: the converters check
    checkpoint keys and shapes first, so a mismatch here is a converter bug and says which path.
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
    leaves = []
    for path, variable in nnx.to_flat_state(abstract_state):
        if path not in params:
            raise ValueError(f"no value for parameter {path_name(path)} {variable.shape}")
        value = params[path]
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"parameter {path_name(path)} has shape {tuple(value.shape)}, expected {tuple(variable.shape)}")
        leaves.append((path, variable.replace(jnp.asarray(value, dtype=dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))
