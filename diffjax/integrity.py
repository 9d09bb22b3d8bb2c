"""Checkpoint integrity: a digest of every file of a checkpoint, written once its save is complete and
checked before it is restored (Orbax 0.12 keeps no checksums of its own).

A checkpoint that fails the check or cannot be read is moved to <run_dir>/damaged-checkpoints/ (kept
for inspection, out of reach of rotation, and its step free to be saved again).

A checkpoint without a digest is never trusted: where other checkpoints of its run have one, it is damage (a
removed digest would otherwise hide any change); where none has (a run written before diffjax kept digests, or by
hand), it is read only once adopted (diffjax/adoption.py: `diffjax-checkpoint adopt RUN_DIR`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from diffjax import storage
from diffjax.run_dir import COMMIT_FILE, DIGEST_FILE, RunDir

UNDIGESTED = {DIGEST_FILE, "_CHECKPOINT_METADATA"}  # Orbax writes the last one as it commits
ADOPT_COMMAND = "diffjax-checkpoint adopt"
MISSING_DIGEST = f"it has no {DIGEST_FILE}, unlike the other checkpoints of its run"


class NotAdoptedError(ValueError):
    """A checkpoint of a run in which no checkpoint has a digest: it is read only once adopted."""

    def __init__(self, step_dir: Path, prefix: str = ""):
        run = RunDir.of_step(step_dir)
        super().__init__(
            f"{prefix}checkpoint {step_dir} has no {DIGEST_FILE}, nor has any checkpoint of its run (written before "
            f"diffjax kept digests, or by hand), so it cannot be verified: if you trust it, adopt the run (it is "
            f"restored, checked to be finite and given its digest): {ADOPT_COMMAND} {run.path}")


def _files(step_dir: Path) -> list[Path]:
    """The files a digest covers: not the digest, and not Orbax's commit markers (on gs://, in every item too)."""
    return [p for p in storage.files_under(step_dir)
            if str(p.relative_to(step_dir)) not in UNDIGESTED and p.name != COMMIT_FILE]


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def write_digest(step_dir: Path) -> None:
    """{relative path: [size, sha256]} of every file, written atomically (a crash leaves none)."""
    step_dir = storage.as_path(step_dir)
    digest = {str(p.relative_to(step_dir)): [storage.size(p), _sha256(p)] for p in _files(step_dir)}
    storage.write_text_atomically(step_dir / DIGEST_FILE, json.dumps(digest))


def saved_bytes(step_dir: Path) -> int:
    """The size of a checkpoint as its digest records it (0 without one)."""
    try:
        return sum(size for size, _ in _read_digest(storage.as_path(step_dir)).values())
    except (OSError, ValueError):
        return 0


def has_digest(step_dir: Path) -> bool:
    return (storage.as_path(step_dir) / DIGEST_FILE).is_file()


def run_has_digests(run: RunDir) -> bool:
    """Whether any checkpoint of the run, kept or set aside, has a digest (then one without is damage)."""
    return any(directory.is_dir() and any(directory.glob(f"*/{DIGEST_FILE}"))
               for directory in (run.checkpoints, run.damaged_checkpoints))


def _read_digest(step_dir: Path) -> dict[str, tuple[int, str]]:
    """{relative path: (size, sha256)} of a digest.json; ValueError naming what is malformed."""
    digest = json.loads((step_dir / DIGEST_FILE).read_text())
    if not isinstance(digest, dict):
        raise ValueError(f"its {DIGEST_FILE} is malformed (a JSON {type(digest).__name__}, not an object)")
    for name, entry in digest.items():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and isinstance(entry[1], str)):
            raise ValueError(f"its {DIGEST_FILE} is malformed (the entry of {name!r} is {entry!r}, not [size, sha256])")
    return digest


def find_damage(step_dir: Path) -> str | None:
    """What is wrong with a checkpoint's files against its digest (None: intact). A digest that is missing (where
    its run's other checkpoints have one), cannot be read or is malformed is damage, and so is a file it does not
    list. NotAdoptedError when no checkpoint of its run has a digest."""
    step_dir = storage.as_path(step_dir)
    try:
        digest = _read_digest(step_dir)
    except FileNotFoundError:
        if run_has_digests(RunDir.of_step(step_dir)):
            return MISSING_DIGEST
        raise NotAdoptedError(step_dir) from None
    except ValueError as error:  # JSONDecodeError included
        message = str(error)
        return message if message.startswith("its ") else f"its {DIGEST_FILE} is unreadable ({message})"
    except OSError as error:
        return f"its {DIGEST_FILE} is unreadable ({error})"
    for name, (size, sha256) in digest.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if storage.size(path) != size:
            return f"{name} has {storage.size(path)} bytes, {size} were saved"
        if _sha256(path) != sha256:
            return f"{name} differs from what was saved (sha256 mismatch)"
    if unlisted := [str(p.relative_to(step_dir)) for p in _files(step_dir) if str(p.relative_to(step_dir)) not in digest]:
        return f"{unlisted[0]} is not in its {DIGEST_FILE}" + (f" ({len(unlisted) - 1} more files neither)" if len(unlisted) > 1 else "")
    return None


def set_aside(step_dir: Path) -> Path:
    """Moves a damaged step directory to <run_dir>/damaged-checkpoints/<step>[.n]; returns where."""
    step_dir = storage.as_path(step_dir)
    target_dir = RunDir.of_step(step_dir).damaged_checkpoints
    target_dir.mkdir(exist_ok=True)
    target, n = target_dir / step_dir.name, 1
    while target.exists():
        target, n = target_dir / f"{step_dir.name}.{n}", n + 1
    storage.move(step_dir, target)
    return target
