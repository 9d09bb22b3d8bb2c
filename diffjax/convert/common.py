"""Shared pieces of the converters: errors, tensors to numpy, output directories, and
assembling a model (or an nnx pure dict) from named arrays. Imports no jax (the format table reads config.json
without it); build_module imports jax and flax when called."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path as FsPath

import ml_dtypes  # (also makes np.dtype("bfloat16") known)
import numpy as np

from diffjax import storage
from diffjax.convert.hub import refuse_the_cache

Path = tuple  # a parameter path in the NNX state, e.g. ("blocks", "attn", "q_kernel") (stacked over layers)


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message says what and what is allowed."""


def listed(items: Iterable[str], limit: int = 5, separator: str = ", ") -> str:
    """'a, b, c and 7 more': the first `limit` items, then how many more (an error line stays readable)."""
    items = list(items)
    return separator.join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def name_and_shape_problems(shapes: Mapping[str, tuple], expected: Mapping[str, tuple], *, ignored: Callable[[str], bool],
                            missing_what: str, unexpected_what: str) -> str | None:
    """What differs between a checkpoint's tensors (name -> shape) and the ones a config expects: the missing, the
    unexpected (but `ignored` ones and a tied model's lm_head.weight) and the mis-shaped, each the first few and a
    count: a config.json off by one dimension mis-shapes every tensor, and the line stays readable. None: none."""
    problems = []
    if missing := [key for key in expected if key not in shapes]:
        problems.append(f"checkpoint is missing {len(missing)} {missing_what}: {listed(missing)}")
    allowed = set(expected) | {"lm_head.weight"}  # a tied model's file may still carry the head
    if unexpected := sorted(key for key in shapes if key not in allowed and not ignored(key)):
        problems.append(f"checkpoint has {len(unexpected)} {unexpected_what}: {listed(unexpected)}")
    if misshaped := [f"{key!r} has shape {tuple(shapes[key])}, expected {shape}"
                     for key, shape in expected.items() if key in shapes and tuple(shapes[key]) != shape]:
        problems.append(f"{len(misshaped)} checkpoint tensor(s) have another shape than this config's: "
                        f"{listed(misshaped, 3, '; ')}")
    return "; ".join(problems) or None


def to_numpy(x) -> np.ndarray:
    """A torch tensor or array-like as numpy; bfloat16 torch tensors convert exactly (via float32)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            return x.float().numpy().astype(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def np_dtype(dtype) -> np.dtype | None:
    """A dtype name ("bfloat16", "float32", ...) or dtype object as numpy's; None stays None."""
    return None if dtype is None else np.dtype(dtype)


def path_name(path: Path) -> str:
    return ".".join(str(p) for p in path)


def build_module(make_module, params: Mapping[Path, np.ndarray], dtype, *, consume: bool = False):
    """Instantiate `make_module()` abstractly and fill it with `params` (cast to `dtype`).

    Every parameter of the module must be given with exactly its shape: the converters check
    checkpoint keys and shapes first, so a mismatch here is a converter bug and says which path.
    consume: pop each array from `params` once it is on the device (peak memory ~1x the model, not 2x).
    """
    import jax.numpy as jnp
    from flax import nnx

    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
    leaves = []
    for path, variable in nnx.to_flat_state(abstract_state):
        if path not in params:
            raise ValueError(f"no value for parameter {path_name(path)} {variable.shape}")
        value = params.pop(path) if consume else params[path]
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"parameter {path_name(path)} has shape {tuple(value.shape)}, expected {tuple(variable.shape)}")
        leaves.append((path, variable.replace(jnp.asarray(value, dtype=dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def flatten(tree: Mapping, prefix: Path = ()) -> dict[Path, object]:
    """The inverse of `params_checkpoint.nested`; digit-string keys (as Orbax stores layer indices) become ints."""
    flat = {}
    for key, value in tree.items():
        key = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix + (key,)))
        else:
            flat[prefix + (key,)] = value
    return flat


def prepare_output_dir(directory, *, overwrite: bool, owned: Iterable[str]) -> FsPath:
    """Create `directory`, or accept it when empty. A non-empty one is refused unless `overwrite`,
    which removes only the entries a conversion writes (`owned`: names or glob patterns)."""
    refuse_the_cache(directory)
    directory = FsPath(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory")
    if not storage.writable(directory):
        raise PermissionError(f"{directory} is not writable (a read-only file system, or no permission): choose a "
                              "directory the export can write")
    if directory.is_dir() and any(directory.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{directory} is not empty; choose an empty or new directory, or pass --overwrite")
        for pattern in owned:
            for entry in directory.glob(pattern):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def refuse_overlap(source, destination, *, source_name: str = "SRC", destination_name: str = "DST") -> None:
    """A conversion never writes into what it reads: `destination` may not be `source`, lie inside it or hold it,
    with symlinks resolved (--overwrite would replace the files being read, or mix both formats in one directory).
    A source that is no local path (a Hub name, a gs:// URL) is not checked: its files are not in a local directory
    a DST could name."""
    if "://" in str(source) or "://" in str(destination) or not FsPath(source).exists():
        return
    src, dst = FsPath(source).resolve(), FsPath(destination).resolve()
    if src == dst:
        relation = f"is {source_name} {source}"
    elif src in dst.parents:
        relation = f"is inside {source_name} {source}"
    elif dst in src.parents:
        relation = f"holds {source_name} {source}"
    else:
        return
    as_given = (FsPath(os.path.abspath(source)), FsPath(os.path.abspath(destination)))
    links = "" if as_given == (src, dst) else f" (links resolved: {src} and {dst})"
    raise ConversionError(f"{destination_name} {destination} {relation}{links}: a conversion does not write where it "
                          f"reads; choose a {destination_name} outside {source_name}")
