"""How the command lines keep stderr to one line per thing said: log records with one prefix, and no tracebacks
from the writes a failed checkpoint save left in flight (their callbacks, and their unretrieved failures).

The messages are lines for a person, most already starting "warning: "; printed through the root logger they were
prefixed again ("WARNING:diffjax.checkpoint:warning: ..." once absl, the first time Orbax logs, has installed
Python's default handler; "WARNING: warning: ..." under the converter's format)."""

from __future__ import annotations

import logging
import re
import sys
import traceback
import warnings


class _OnePrefix(logging.Handler):
    """A record as "<level>: <message>", the level not repeated when the message starts with it; written to the
    sys.stderr of the moment (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line, prefix = self.format(record), f"{record.levelname.lower()}: "
            print(line if line.startswith(prefix) else prefix + line, file=sys.stderr)
        except Exception:
            self.handleError(record)


class _DropLateWriteCallbacks:
    """sys.unraisablehook, passing on all but one kind: when a checkpoint write fails (a full disk), Orbax's event
    loop closes while tensorstore's other writes are in flight, and each of their completion callbacks then fails in
    `call_soon_threadsafe` with "Event loop is closed", printed as a traceback (36 of them on the first save of a
    tiny model). The failure itself reaches the caller, which says it in one line."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        outermost = unraisable.exc_traceback
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
                and outermost is not None and outermost.tb_frame.f_code.co_name == "call_soon_threadsafe"):
            self.previous(unraisable)


_UNRETRIEVED = re.compile(r"\w+ exception was never retrieved")  # asyncio's words, after the future's class


class _DropOrphanedWriteFailures(logging.Filter):
    """On asyncio's logger, drops one kind of record: when one of a save's writes fails, Orbax's `asyncio.gather`
    raises that failure to the caller and leaves its sibling writes running. Those fail too (the same full disk)
    and nobody awaits them, so asyncio logs each, when it is collected, as "Task exception was never retrieved"
    (or "_GatheringFuture ...", "Future ...") with a traceback; which and how many depends on timing. Dropped only
    when the failure was raised in Orbax or names a file under one of `file_marks` (tensorstore's futures have no
    Python frames; the checkpoint layer gives the mark of a save in progress)."""

    def __init__(self):
        super().__init__()
        self.file_marks: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and _UNRETRIEVED.match(record.msg) and record.exc_info):
            return True
        _, error, trace = record.exc_info
        in_orbax = any("/orbax/checkpoint/" in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(trace))
        return not (in_orbax or any(mark in str(error) for mark in self.file_marks))


def drop_late_write_callbacks(*file_marks: str) -> None:
    """Installs _DropLateWriteCallbacks and _DropOrphanedWriteFailures (with `file_marks` added) for the process's
    life (both kinds may come after the failed save returned, or before it did)."""
    if not isinstance(sys.unraisablehook, _DropLateWriteCallbacks):
        sys.unraisablehook = _DropLateWriteCallbacks(sys.unraisablehook)
    asyncio_logger = logging.getLogger("asyncio")
    orphans = next((f for f in asyncio_logger.filters if isinstance(f, _DropOrphanedWriteFailures)), None)
    if orphans is None:
        asyncio_logger.addFilter(orphans := _DropOrphanedWriteFailures())
    orphans.file_marks.update(file_marks)


def after_a_failed_write() -> None:
    """Called where a write failure is raised to be reported: the writes Orbax left un-started are collected at
    exit with Python's "RuntimeWarning: coroutine '...' was never awaited" (and a tracemalloc hint), one each."""
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


def first_line(error: BaseException) -> str:
    """An error's message in one line: its first, or its class's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def os_error_line(error: OSError) -> str:
    """An OSError as "<file>: <reason>" (its str is "[Errno 28] No space left on device: '<file>'")."""
    if error.strerror is None:
        return str(error)
    return f"{error.filename}: {error.strerror}" if error.filename else error.strerror


def print_package_logs() -> None:
    """For a command line: every record (warnings and up) through _OnePrefix, in place of the handler absl's first
    log (importing Orbax logs) put on the root logger with Python's default format. A handler set up otherwise
    (a host program's, pytest's) is kept, and then nothing is added."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and getattr(handler.formatter, "_fmt", None) == logging.BASIC_FORMAT:
            root.removeHandler(handler)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[_OnePrefix()])
    drop_late_write_callbacks()
