"""The Hugging Face cache written by hand in the layout huggingface_hub's downloads leave
(<type>s--org--name/{refs/<revision>, snapshots/<commit>/<file> -> ../../blobs/<sha256>}), so tests read Hub names
offline and with no network, as users whose cache holds them do."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_of(revision: str) -> str:
    return hashlib.sha1(revision.encode()).hexdigest()


def write_cached_repo(cache: Path, name: str, files_by_revision: dict[str, Path], *, repo_type: str = "model") -> None:
    """Cache the files of each directory (subdirectories too) as the `repo_type` repository `name` at that revision
    (a branch: refs/<revision> names its commit)."""
    repo = cache / f"{repo_type}s--{name.replace('/', '--')}"
    for revision, directory in files_by_revision.items():
        snapshot = repo / "snapshots" / commit_of(revision)
        for file in sorted(p for p in directory.rglob("*") if p.is_file()):
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / file.relative_to(directory)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit_of(revision))
