"""Where run directories and data live: a local path, or a gs:// URL (Google Cloud Storage), behind one small API.

Local paths are pathlib.Path. A gs:// URL is an etils.epath.Path on gcsfs (fsspec): what reads and writes the
run's own files (config.yaml, metrics.jsonl, digests, the trainer lock record) and the data files. Orbax's
checkpoints go to gs:// through tensorstore's own GCS driver; TensorBoard's events are written locally and copied
up (diffjax.train.metrics). Credentials: Google's application-default ones (on a TPU VM, the VM's service account).

Object stores differ from a file system in three ways this module hides: there is no rename (a move is copy and
delete), no append, and no partial object (a written object appears whole or not at all: the atomic write a
local file gets from write-then-rename).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Union

AnyPath = Union[Path, "epath.Path"]  # noqa: F821 (etils is imported only for URLs)
SCHEMES = ("gs",)


def is_url(path) -> bool:
    return "://" in os.fspath(path)


def as_path(path) -> AnyPath:
    """pathlib.Path for a local path; etils.epath.Path for a gs:// URL (clear errors for other schemes, a missing
    gcsfs)."""
    if isinstance(path, Path):
        return path
    text = os.fspath(path)
    if not is_url(text):
        return Path(text)
    scheme = text.split("://", 1)[0]
    if scheme not in SCHEMES:
        raise ValueError(f"{text}: {scheme}:// is not supported; use a local path or a gs:// URL")
    try:
        import fsspec
        import gcsfs  # noqa: F401 (etils.epath reads gs:// through it)
        from etils import epath
    except ImportError as error:
        raise ImportError(f"{text}: gs:// paths need gcsfs: pip install 'diffjax[gcs]'") from error
    # gcsfs caches listings; Orbax (tensorstore) and the other processes of a run write past it, and a stale listing
    # hides a checkpoint or a lock record: list afresh (before epath makes its one gcsfs instance).
    fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)
    return epath.Path(text)


def absolute(path) -> AnyPath:
    path = as_path(path)
    return path if is_url(path) else path.absolute()


def writable(path) -> bool:
    """Whether this process can write `path`, or create it in the nearest directory above it that exists (a read-only
    file system, no permission: False). A gs:// URL: True (its permissions show when it is written)."""
    if is_url(path):
        return True
    existing = next(p for p in (Path(path).absolute(), *Path(path).absolute().parents) if p.exists())
    return os.access(existing, os.W_OK | os.X_OK)


def files_under(directory: AnyPath) -> list[AnyPath]:
    """Every file below `directory`, at any depth, sorted (epath's rglob refuses gs://: walked here)."""
    directory = as_path(directory)
    if not is_url(directory):
        return sorted(p for p in directory.rglob("*") if p.is_file())
    prefix = os.fspath(directory).split("://", 1)[1].rstrip("/")
    files = []
    for root, _, names in directory.walk():
        relative = os.fspath(root).split("://", 1)[-1][len(prefix):].strip("/")
        files += [directory / relative / name if relative else directory / name for name in names]
    return sorted(files, key=os.fspath)


def size(path: AnyPath) -> int:
    stat = as_path(path).stat()
    return stat.st_size if hasattr(stat, "st_size") else stat.length


def modified(path: AnyPath) -> int:
    """When `path` last changed: nanoseconds locally, seconds on gs:// (where objects are rewritten whole)."""
    stat = as_path(path).stat()
    return stat.st_mtime_ns if hasattr(stat, "st_mtime_ns") else stat.mtime


def write_text_atomically(path: AnyPath, text: str) -> None:
    """`path` holds `text`, or (after a crash) what it held before, never a cut file."""
    path = as_path(path)
    if is_url(path):
        path.write_text(text)  # an object is written whole or not at all
        return
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
    except OSError:
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)


def move(source: AnyPath, target: AnyPath) -> None:
    """A file or directory to a new name (on gs://, copied object by object and then deleted: no rename there)."""
    source, target = as_path(source), as_path(target)
    if not is_url(source):
        shutil.move(source, target)
        return
    if not source.is_dir():
        source.copy(target)
        source.unlink()
        return
    copy_tree(source, target)
    source.rmtree()


def copy_tree(source: AnyPath, target: AnyPath) -> None:
    """Every file below `source` to the same relative path below `target` (local or gs://, either way)."""
    source, target = as_path(source), as_path(target)
    for file in files_under(source):
        destination = target / str(file.relative_to(source))
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(file.read_bytes())


def rmtree(path: AnyPath, ignore_errors: bool = False) -> None:
    path = as_path(path)
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=ignore_errors)
        return
    try:
        path.rmtree()
    except OSError:
        if not ignore_errors:
            raise


def free_bytes(path: AnyPath) -> int | None:
    """Free space where `path` lives (None on an object store: no such limit to check)."""
    path = as_path(path)
    return None if is_url(path) else shutil.disk_usage(path).free
