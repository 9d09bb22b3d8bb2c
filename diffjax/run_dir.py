"""The run directory: every path in it, in one place, and how it is opened (pure pathlib: no jax, no Orbax).

    <run_dir>/config.yaml                     the run config (a conversion's: its `model` section)
    <run_dir>/checkpoints/<step>/state        Orbax: params (+ optimizer state, step, RNG for the trainer's)
    <run_dir>/checkpoints/<step>/data         the data iterator's state (the trainer's checkpoints)
    <run_dir>/checkpoints/<step>/digest.json  size and SHA-256 of every file, written when a save is complete
    <run_dir>/damaged-checkpoints/<step>      checkpoints that failed their digest, moved aside, never deleted
    <run_dir>/incomplete-checkpoint/<step>    a params-only checkpoint being written (a conversion, a merge), moved
                                              to checkpoints/ with its digest once complete: never read
    <run_dir>/metrics.jsonl                   one JSON record per logged step / eval
    <run_dir>/tensorboard/                    TensorBoard events
    <run_dir>/hf/                             a Hugging Face conversion's config.json, tokenizer and generation files
    <run_dir>/trainer.lock                    held while a trainer runs here: its host, pid and start time
    <run_dir>/wandb/                          Weights & Biases' own files (train.wandb; W&B names the directory)
    <run_dir>/wandb-run.json                  the W&B run this run logs to and its last logged step (for resumes)

A run directory is a local path or a gs:// URL (diffjax.storage: pathlib.Path or etils.epath.Path); everything
here works on both, except the conversion's (a local directory: transformers writes hf/) and the lock (on gs://
a record, not an flock: TrainerLock).

Opened five ways: `RunDir.for_training(path)` (a new run or a resume: created if absent; then
`lock_for_training()` makes it one trainer's, which holds this RunDir: diffjax.train.run's Run.directory),
`RunDir.for_reading(path, what)` (a run directory, its checkpoints/ or one step: the step to load, with one-line
errors naming `what`), `RunDir.for_conversion(path, overwrite=)`
(an empty directory the converter fills, once it holds the lock: `lock_for_writing(command)`, which adopt takes
too), `RunDir.for_params(path)` (where save_params writes a params-only checkpoint: no checkpoints there yet), and
`RunDir.of_step(step_dir)` (the run a checkpoint belongs to).
Who writes what: diffjax.params_checkpoint (params-only checkpoints and config.yaml), diffjax.train.state_checkpoints
(the trainer's Orbax checkpoints, digests via diffjax.integrity), diffjax.train.metrics (metrics.jsonl,
TensorBoard), diffjax.convert.hf_directories (hf/), diffjax.train.wandb_log (wandb-run.json; W&B writes wandb/).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path

from diffjax import storage

CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
STATE_ITEM = "state"  # Orbax item names inside a step directory
DATA_ITEM = "data"
DIGEST_FILE = "digest.json"
TEMPORARY_MARK = ".orbax-checkpoint-tmp"  # Orbax's name for a save in progress: <step>.orbax-checkpoint-tmp-<n>
COMMIT_FILE = "commit_success.txt"  # on gs:// Orbax saves in place and writes this when a save is complete
DAMAGED_DIR = "damaged-checkpoints"
INCOMPLETE_DIR = "incomplete-checkpoint"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
HF_DIR = "hf"
LOCK_FILE = "trainer.lock"
WANDB_DIR = "wandb"  # W&B's name for its directory under wandb.init(dir=<run_dir>)
WANDB_RUN_FILE = "wandb-run.json"
CONVERSION_OUTPUTS = (CONFIG_FILE, CHECKPOINTS_DIR, INCOMPLETE_DIR, HF_DIR)  # what a conversion writes (--overwrite: removes)


@dataclasses.dataclass(frozen=True)
class RunDir:
    path: storage.AnyPath

    def __post_init__(self):
        object.__setattr__(self, "path", storage.as_path(self.path))

    # ---- opening

    @classmethod
    def for_training(cls, path: str | Path) -> "RunDir":
        """A new run's or a resumed run's directory, created if absent."""
        path = storage.as_path(path)
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"train.run_dir {path} exists and is not a directory")
        path.mkdir(parents=True, exist_ok=True)
        if not storage.is_url(path) and not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"train.run_dir {path} is not writable: a run writes its checkpoints "
                                  "and metrics there (copy it somewhere writable to train on from it)")
        return cls(path)

    @classmethod
    def for_reading(cls, path: str | Path, what: str = "checkpoint") -> tuple["RunDir", Path]:
        """(the run, the step directory to load) from a run directory or its checkpoints/ directory (the newest
        complete step) or one step directory. `what` names the setting in errors (e.g. "train.init_from")."""
        path = storage.absolute(path)
        if (path / CHECKPOINTS_DIR).is_dir():
            path = path / CHECKPOINTS_DIR
        if not (path.name.isdigit() and (path / STATE_ITEM).is_dir()):
            if not path.is_dir():
                raise FileNotFoundError(f"{what}: {path} is not a run directory or checkpoint")
            steps = _complete_steps(path)
            if not steps:
                incomplete = path.parent / INCOMPLETE_DIR if path.name == CHECKPOINTS_DIR else path / INCOMPLETE_DIR
                unfinished = (f" ({incomplete} holds a conversion that did not finish: convert again with --overwrite)"
                              if incomplete.is_dir() else "")
                raise FileNotFoundError(f"{what}: no checkpoint under {path}{unfinished}")
            path = path / str(steps[-1])
        return cls.of_step(path), path

    @classmethod
    def for_conversion(cls, path: str | Path, *, overwrite: bool) -> "RunDir":
        """An empty (or new) directory for a conversion, created; a non-empty one is refused unless `overwrite`.
        Nothing is removed here: the conversion takes the lock (lock_for_writing) first, then
        remove_conversion_outputs()."""
        if storage.is_url(path):
            raise ValueError(f"{path}: a conversion writes to a local directory (transformers writes its hf/ files); "
                             "convert into one, then copy it to the bucket (gcloud storage cp -r)")
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a directory")
        if path.is_dir() and any(path.iterdir()) and not overwrite:
            raise FileExistsError(f"{path} is not empty; choose an empty or new directory, or pass --overwrite")
        if not storage.writable(path):
            raise PermissionError(f"{path} is not writable (a read-only file system, or no permission): choose a "
                                  "directory the conversion can write")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    @classmethod
    def for_params(cls, path: str | Path) -> "RunDir":
        """A directory a params-only checkpoint is written into (save_params: a conversion's, a merge's, a user's),
        created; refused if it holds checkpoints or one never completed."""
        run = cls(storage.absolute(path))
        if run.has_checkpoints():
            raise FileExistsError(f"{run.checkpoints} already holds checkpoints; choose an empty directory")
        if run.incomplete.exists():
            raise FileExistsError(f"{run.incomplete} holds a checkpoint that was never completed (a conversion that "
                                  "did not finish): remove it (a conversion's --overwrite does) or choose an empty "
                                  "directory")
        run.path.mkdir(parents=True, exist_ok=True)
        return run

    def remove_conversion_outputs(self) -> None:
        """Removes what a conversion writes (its --overwrite), nothing else; call it holding lock_for_writing()."""
        for name in CONVERSION_OUTPUTS:
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            elif entry.exists() or entry.is_symlink():
                entry.unlink()

    @classmethod
    def of_step(cls, step_dir: str | Path) -> "RunDir":
        return cls(storage.as_path(step_dir).parent.parent)

    def absolute(self) -> "RunDir":
        """The same directory by its absolute path (what Orbax needs; a gs:// URL is one already)."""
        return RunDir(storage.absolute(self.path))

    # ---- paths

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def damaged_checkpoints(self) -> Path:
        return self.path / DAMAGED_DIR

    @property
    def incomplete(self) -> Path:
        """Where a params-only checkpoint is written until it is complete (diffjax.params_checkpoint)."""
        return self.path / INCOMPLETE_DIR

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD_DIR

    @property
    def hf(self) -> Path:
        return self.path / HF_DIR

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK_FILE

    @property
    def wandb(self) -> Path:
        return self.path / WANDB_DIR

    @property
    def wandb_run_file(self) -> Path:
        return self.path / WANDB_RUN_FILE

    def lock_for_training(self) -> "TrainerLock":
        """Makes this directory one trainer's until `release()` (or the process's end: an flock, which the
        kernel drops when its holder dies). A second trainer gets RunDirInUseError naming the holder; the
        lock file of a holder that died is taken over (TrainerLock.took_over names it). Multi-process runs:
        process 0 alone calls this (diffjax.train.run)."""
        return TrainerLock.take(self.lock_file)

    def lock_for_writing(self, command: str) -> "TrainerLock":
        """The trainer's lock, for `command` (a conversion, adopt) before it removes or writes anything here:
        RunDirInUseError while a trainer or another command holds it. A dead holder's is taken over."""
        return TrainerLock.take(self.lock_file, command=command)

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / str(step)

    def steps(self) -> list[int]:
        """The steps with a checkpoint (a state item), oldest first."""
        return _complete_steps(self.checkpoints) if self.checkpoints.is_dir() else []

    def has_checkpoints(self) -> bool:
        return self.checkpoints.exists() and any(self.checkpoints.iterdir())

    def damaged(self) -> tuple[str, ...]:
        """The names in damaged-checkpoints/ (the checkpoints set aside there), sorted."""
        if not self.damaged_checkpoints.is_dir():
            return ()
        return tuple(sorted(p.name for p in self.damaged_checkpoints.iterdir()))


def state_dir(step_dir: str | Path) -> Path:
    """The Orbax state item of a checkpoint (params, and the trainer's optimizer state, step and RNG)."""
    return storage.as_path(step_dir) / STATE_ITEM


def _complete_steps(checkpoints: Path) -> list[int]:
    finished = (lambda p: (p / COMMIT_FILE).exists()) if storage.is_url(checkpoints) else (lambda p: True)
    return sorted(int(p.name) for p in checkpoints.iterdir()
                  if p.name.isdigit() and (p / STATE_ITEM).is_dir() and finished(p))


class RunDirInUseError(OSError):
    """Another trainer holds the run directory's lock."""


@dataclasses.dataclass
class TrainerLock:
    """The run directory's lock file, flock-ed while held and holding {host, pid, started} (what a second
    trainer's error names). Released: unlocked and removed, so a lock file with a holder in it that nobody
    flocks was left by a trainer that died (kill -9, power loss).

    On gs:// (no flock on an object store) the lock is the record alone, like a local file system without flock: a
    holder alive on this host refuses a second trainer; another host's record cannot be checked and is taken over
    with a note saying so (a preempted pod job's record is one of those)."""

    path: storage.AnyPath
    took_over: dict | None  # the record of a dead holder whose lock this one took over
    _fd: int | None = None
    _record_only: bool = False  # gs://: the record is the lock

    @classmethod
    def take(cls, path: Path, command: str | None = None) -> "TrainerLock":
        """command: what takes it when not a trainer (its record names it; so do its errors)."""
        if storage.is_url(path):
            previous = _read_record(path)
            if previous and _alive_here(previous):
                raise RunDirInUseError(_in_use_message(path, previous, command))
            path.write_text(json.dumps(_own_record(command)))
            return cls(path, previous or None, _record_only=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flocked = True
            except BlockingIOError:
                os.close(fd)
                raise RunDirInUseError(_in_use_message(path, _read_record(path), command)) from None
            except OSError as error:
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                flocked = False  # a file system without flock: the record decides
            try:
                if os.fstat(fd).st_ino != os.stat(path).st_ino:  # its holder removed it as we opened it: again
                    raise FileNotFoundError
            except FileNotFoundError:
                os.close(fd)
                continue
            previous = _read_record(path)
            if not flocked and previous and _alive_here(previous):
                os.close(fd)
                raise RunDirInUseError(_in_use_message(path, previous, command))
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_own_record(command)).encode(), 0)
            os.fsync(fd)
            return cls(path, previous or None, fd)

    def release(self) -> None:
        if self._record_only:
            self._record_only = False
            record = _read_record(self.path)
            if (record.get("host"), record.get("pid")) == (socket.gethostname(), os.getpid()):  # not taken over since
                self.path.unlink(missing_ok=True)
            return
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before unlocking: a trainer that opens it now retries
        finally:
            os.close(self._fd)
            self._fd = None

    def describe_takeover(self) -> str:
        held = self.took_over
        if self._record_only and held.get("host") != socket.gethostname():
            return (f"note: took over {self.path} from pid {held.get('pid')} on {held.get('host')} (started "
                    f"{held.get('started')}), which cannot be checked from here (gs:// has no file locks): make sure "
                    "no other trainer writes to this run directory")
        return (f"note: took over {self.path}, left by {held.get('command') or 'a trainer'} that is no longer running "
                f"(pid {held.get('pid')} on {held.get('host')}, started {held.get('started')})")


def _own_record(command: str | None = None) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            **({"command": command} if command else {})}


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _alive_here(record: dict) -> bool:
    """Whether the record's process runs on this host (another host's cannot be checked: False)."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    if record["pid"] == os.getpid():
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use_message(path: Path, holder: dict, command: str | None = None) -> str:
    """The refusal of a trainer (command None) or of `command` by the holder of the lock file `path`."""
    who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder
           else "a process that has not written its name yet")
    by = holder.get("command") or ("another trainer" if command is None else "a trainer")
    what, other = ("train.run_dir", "train.run_dir") if command is None else (f"{command}: run directory", "directory")
    return f"{what} {path.parent} is in use by {by} ({who}; lock {path}): wait for it to end, or choose another {other}"
